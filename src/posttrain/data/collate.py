"""Batching: pad to the longest sample in the micro-batch; count the target tokens on the host."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data.sft import IGNORE_INDEX


class Collator:
    """Pads ``input_ids`` with ``pad_id`` and ``labels`` with -100.

    ``num_loss_units`` is what the loop divides the summed loss by (target tokens here; pairs for DPO).

    Packed samples (with ``position_ids``) are passed with ``position_ids`` and no attention mask, which is
    how transformers recognises packed sequences. ``num_target_tokens`` (labels that are predicted, i.e.
    after the one-token shift) is counted here, on the CPU, so the loop never syncs with the device for it.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, list[int]]]) -> dict[str, Any]:
        longest = max(len(s["input_ids"]) for s in samples)
        packed = "position_ids" in samples[0]
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(samples), longest), dtype=torch.long)
        positions = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            input_ids[row, :n] = torch.tensor(sample["input_ids"])
            labels[row, :n] = torch.tensor(sample["labels"])
            attention[row, :n] = 1
            if packed:
                positions[row, :n] = torch.tensor(sample["position_ids"])
                positions[row, n:] = torch.arange(longest - n)
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
        if packed:
            if longest != min(len(s["input_ids"]) for s in samples):
                raise ValueError("packed micro-batches hold one sequence each (micro_batch_size: 1)")
            batch["position_ids"] = positions
        else:
            batch["attention_mask"] = attention
        batch["num_target_tokens"] = int((labels[:, 1:] != IGNORE_INDEX).sum())
        batch["num_loss_units"] = batch["num_target_tokens"]  # the loss is normalised per target token
        batch["num_input_tokens"] = sum(len(s["input_ids"]) for s in samples)
        batch["num_samples"] = len(samples)
        return batch
