"""Batching: pad to the longest sample in the micro-batch; count the target tokens on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

import torch

from posttrain.data.packing import join_samples
from posttrain.data.samples import HOST_KEYS, document_bounds, pad_rows, target_rows, trained_tokens


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
    num_attention_sq: int  # sum of the squared lengths of the documents attention runs over (FLOPs)


class Collator:
    """Pads ``input_ids`` with ``pad_id`` and ``labels`` with -100.

    Packed samples (with ``position_ids``) are passed with ``position_ids``, no attention mask, and the
    documents' bounds (``samples.document_bounds``), computed here once so no attention layer derives them.
    ``num_target_tokens`` (labels that are predicted, i.e. after the one-token shift) is counted here, on the
    CPU, so the loop never syncs with the device for it. Samples hold lists or numpy arrays of token ids.

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
        packed = "position_ids" in samples[0]
        rows = [(s["input_ids"], s["labels"]) for s in samples]
        input_ids, labels, attention = pad_rows(rows, self.pad_id)
        target_tokens = trained_tokens(labels)
        batch = Batch(
            input_ids=input_ids,
            labels=labels,
            num_target_tokens=target_tokens,
            num_loss_units=target_tokens,  # the loss is normalised per target token
            num_input_tokens=sum(len(s["input_ids"]) for s in samples),
            num_samples=len(samples),
            num_attention_sq=sum(len(ids) ** 2 for ids, _ in rows),
        )
        if packed:
            lengths = {len(ids) for ids, _ in rows}
            if len(lengths) > 1:
                raise ValueError("packed micro-batches hold one sequence each (micro_batch_size: 1)")
            positions = torch.stack([torch.as_tensor(s["position_ids"]) for s in samples]).long()
            batch["position_ids"] = positions
            batch.update(document_bounds(positions))  # type: ignore[typeddict-item]
        else:
            batch["attention_mask"] = attention
        return batch

    def flat(self, samples: Sequence[dict[str, Any]]) -> Batch:
        batch = self([join_samples(samples)])  # one packed row, collated as packed rows are
        batch["num_samples"] = len(samples)
        return batch


class CollatorWrapper:
    """A collator around the run's collator (``collate``), whose own attributes (its ``pad_id``...) it
    answers for."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __getattr__(self, name: str) -> Any:
        if name == "collate":  # not set yet (unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.collate, name)


class HostPrepared(CollatorWrapper):
    """Wraps the run's collator (and the sequence-parallel slicer, so it sees the slice): what attention and
    the loss would otherwise read back from the device, once per layer or per micro-batch, is computed here on
    the host, once per micro-batch:

    - the documents' bounds of rows given with ``position_ids`` and no attention mask (rows laid end to end),
      when the collator left them out (a user's collator);
    - ``target_rows``, the flat positions that predict a label (the tiled loss computes only those).
    """

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(self.collate(samples))
        if "position_ids" in batch and "document_bounds" not in batch and "attention_mask" not in batch:
            bounds = document_bounds(batch["position_ids"])
            if "num_attention_sq" in batch:  # the collator counted its own
                del bounds["num_attention_sq"]
            batch.update(bounds)
        if "labels" in batch or "shift_labels" in batch:
            batch["target_rows"] = target_rows(batch)
        return batch


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on ``device`` (those of a dict in it too: a joined micro-batch's), except those that
    must stay on the host (``HOST_KEYS``)."""
    return {
        k: (
            v.to(device, non_blocking=True)
            if isinstance(v, torch.Tensor) and k not in HOST_KEYS
            else to_device(v, device)
            if isinstance(v, dict)
            else v
        )
        for k, v in batch.items()
    }
