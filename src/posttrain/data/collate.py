"""Batching: pad to the longest sample in the micro-batch; count the target tokens on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

import torch

from posttrain.data.packing import join_samples
from posttrain.data.sft import IGNORE_INDEX


class Batch(TypedDict):
    """What a collator hands the loop: model inputs plus the host-side counts the loop normalises by.

    ``num_loss_units`` is what the summed loss is divided by (target tokens; pairs for DPO), summed over the
    step's micro-batches and all ranks. The counts are plain ints, taken on the CPU, so the loop never waits
    on the device for them. Methods may add their own tensors (DPO: ``ref_chosen``, ``pair_weight``...)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: NotRequired[torch.Tensor]
    position_ids: NotRequired[torch.Tensor]
    num_target_tokens: int
    num_loss_units: int
    num_input_tokens: int
    num_samples: int


class Collator:
    """Pads ``input_ids`` with ``pad_id`` and ``labels`` with -100.

    Packed samples (with ``position_ids``) are passed with ``position_ids`` and no attention mask, which is
    how transformers recognises packed sequences. ``num_target_tokens`` (labels that are predicted, i.e.
    after the one-token shift) is counted here, on the CPU, so the loop never syncs with the device for it.
    Samples hold lists or numpy arrays of token ids.

    ``padding_free``: the samples are laid one after another in a single row instead, with ``position_ids``
    restarting per sample (so, as for packed rows, no token attends across samples) and each sample's first
    label ignored (it would be predicted from the previous sample's last token; in a padded row the first
    label is never predicted either). The counts are those of the padded batch.
    """

    def __init__(self, pad_id: int, padding_free: bool = False) -> None:
        self.pad_id = pad_id
        self.padding_free = padding_free

    def __call__(self, samples: Sequence[dict[str, Any]]) -> Batch:
        if self.padding_free and "position_ids" not in samples[0]:
            return self.flat(samples)
        longest = max(len(s["input_ids"]) for s in samples)
        packed = "position_ids" in samples[0]
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(samples), longest), dtype=torch.long)
        positions = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            input_ids[row, :n] = torch.as_tensor(sample["input_ids"])
            labels[row, :n] = torch.as_tensor(sample["labels"])
            attention[row, :n] = 1
            if packed:
                positions[row, :n] = torch.as_tensor(sample["position_ids"])
                positions[row, n:] = torch.arange(longest - n)
        target_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
        batch = Batch(
            input_ids=input_ids,
            labels=labels,
            num_target_tokens=target_tokens,
            num_loss_units=target_tokens,  # the loss is normalised per target token
            num_input_tokens=sum(len(s["input_ids"]) for s in samples),
            num_samples=len(samples),
        )
        if packed:
            if longest != min(len(s["input_ids"]) for s in samples):
                raise ValueError("packed micro-batches hold one sequence each (micro_batch_size: 1)")
            batch["position_ids"] = positions
        else:
            batch["attention_mask"] = attention
        return batch

    def flat(self, samples: Sequence[dict[str, Any]]) -> Batch:
        batch = self([join_samples(samples)])  # one packed row, collated as packed rows are
        batch["num_samples"] = len(samples)
        return batch
