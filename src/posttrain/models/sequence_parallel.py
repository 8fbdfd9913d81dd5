"""Ulysses sequence parallelism on DeepSpeed's ``UlyssesSPAttentionHF``.

The ``sequence_parallel_size`` consecutive ranks of a group hold the same sample, each a contiguous slice of
its sequence (:class:`SequenceSlicer`, applied after the method's collator). Inside attention, DeepSpeed's
all-to-all trades the sequence split for a head split, so each rank attends over the whole sequence with
its share of the heads, and trades back afterwards. Everything else (embeddings, MLPs, the LM head and the
loss) runs on the local slice, with labels shifted before slicing so every token keeps its target.

Gradients: posttrain hands DeepSpeed no model-parallel unit, so DeepSpeed reduces gradients over all ranks
as data parallelism and divides by the world size, under every ZeRO stage alike. The loop multiplies the
loss by world size / (label tokens of the step over all ranks), so the result is the gradient of the summed
loss per token, the same as with one process; each rank's slice counts only its own tokens.

Packed sequences: flash attention separates the documents by ``position_ids``; for ``sdpa`` the gathered
sequence is cut at every position reset and each document attends causally on its own, as transformers'
packed-sequence mask does without sequence parallelism (and without an O(tokens^2) mask).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.config.trainer import TrainerConfig
from posttrain.data.samples import IGNORE_INDEX, SLICED, document_bounds, target_labels
from posttrain.errors import UserError
from posttrain.models.dimensions import read_dimensions
from posttrain.models.document_attention import per_document


@dataclass
class _Installed:
    implementation: str
    original: Callable[..., Any]


_installed: _Installed | None = None


def _fit_batch(attention: Any, batch_size: int) -> None:
    """DeepSpeed fixes the micro-batch size at registration; eval and short last batches may differ."""
    if attention.batch_size == batch_size:
        return
    attention.batch_size = batch_size
    query, kv, context = (
        attention.required_query_shape,
        attention.required_key_value_shape,
        attention.required_context_shape,
    )
    attention.required_query_shape = torch.Size([query[0], batch_size, *query[2:]])
    attention.required_key_value_shape = torch.Size([kv[0], batch_size, *kv[2:]])
    attention.required_context_shape = torch.Size([context[0], batch_size, *context[2:]])


def install_sequence_parallel(model: torch.nn.Module, sp: int, attention_impl: str, micro_batch: int) -> Any:
    """Route the model's attention through Ulysses (process-wide, undone by :func:`uninstall`); returns
    the sequence-parallel process group."""
    global _installed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as groups
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    uninstall()
    if groups._SEQUENCE_PARALLEL_GROUP is None:
        groups.initialize_sequence_parallel(sequence_parallel_size=sp)
    elif groups.get_sequence_parallel_world_size() != sp:
        raise UserError(
            f"this process already runs sequence parallelism of degree {groups.get_sequence_parallel_world_size()}"
        )
    dims = read_dimensions(model.config)
    original = ALL_ATTENTION_FUNCTIONS[attention_impl]
    core = per_document(original) if attention_impl == "sdpa" else original
    shapes: dict[tuple[int, int, int], Any] = {}  # one Ulysses per attention shape (a teacher has its own)

    def ulysses_for(heads: int, kv_heads: int, head_dim: int, layers: int) -> Any:
        if (heads, kv_heads, head_dim) not in shapes:
            made = UlyssesSPAttentionHF(
                attn=core,
                batch_size=micro_batch,
                attn_head_count=heads,
                attn_head_size=head_dim,
                kv_head_count=kv_heads,
                num_hidden_layers=layers,
                process_group=groups.get_sequence_parallel_group(),
                seq_length_is_variable=True,
            )
            made.core_attn_implementation = attention_impl
            shapes[heads, kv_heads, head_dim] = made
        return shapes[heads, kv_heads, head_dim]

    ulysses_for(dims.heads, dims.kv_heads, dims.head_dim, dims.layers)  # the model's own, checked now

    def attention(
        module: Any, query: torch.Tensor, key: Any, value: Any, mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not kwargs.get(SLICED):  # whole rows on every process (generation): the plain kernel
            return original(module, query, key, value, mask, *args, **kwargs)
        config = getattr(module, "config", None)
        layers = int(getattr(config, "num_hidden_layers", 0) or dims.layers)
        ulysses = ulysses_for(query.shape[1], key.shape[1], query.shape[-1], layers)
        _fit_batch(ulysses, query.shape[0])
        return ulysses(
            module, query, key, value, None, *args, **kwargs
        )  # the local-slice mask is meaningless

    ALL_ATTENTION_FUNCTIONS[attention_impl] = attention
    _installed = _Installed(attention_impl, original)
    return groups.get_sequence_parallel_group()


def uninstall() -> None:
    global _installed
    if _installed is None:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[_installed.implementation] = _installed.original
    _installed = None


def slice_rows(
    batch: dict[str, Any], pad_id: int, sp: int, sp_rank: int, rows: int, token_keys: Sequence[str] = ()
) -> dict[str, Any]:
    """A batch every rank of a sequence-parallel group holds whole, cut to this rank's slice of the sequence:
    padded to a multiple of the group size (padding has no label) and to ``rows`` rows, its labels shifted to
    ``shift_labels``, and ``token_keys`` (per-position values aligned with the shifted labels: an online
    micro-batch's completion mask, the engine's log-probabilities) padded with 0 and cut alike. The counts the
    loop normalises by are this slice's, so their sum over the group is the batch's; the samples are counted
    by the group's first rank."""
    batch = dict(batch)
    input_ids = batch["input_ids"]
    count, length = input_ids.shape
    real = batch.pop("attention_mask", torch.ones_like(input_ids)).bool()
    positions = batch.get("position_ids")
    packed = positions is not None
    if positions is None:
        positions = torch.arange(length).expand(count, length)
    target = -(-length // sp) * sp
    extra_cols, extra_rows = target - length, max(rows - count, 0)
    shift = target_labels(batch)
    pad = (0, extra_cols, 0, extra_rows)
    input_ids = F.pad(input_ids, pad, value=pad_id)
    shift = F.pad(shift, pad, value=IGNORE_INDEX)
    real = F.pad(real, pad, value=False)
    tail = positions[:, -1:] + 1 + torch.arange(extra_cols) if extra_cols else positions[:, :0]
    positions = torch.cat([positions, tail], dim=1)
    positions = torch.cat([positions, torch.arange(target).expand(extra_rows, target)], dim=0)
    width = target // sp
    part = slice(sp_rank * width, (sp_rank + 1) * width)
    targets = shift[:, part].contiguous()
    trained = int((targets != IGNORE_INDEX).sum())
    for key in token_keys:
        if key in batch:
            batch[key] = F.pad(batch[key], pad, value=0)[:, part].contiguous()
    batch.update(
        input_ids=input_ids[:, part].contiguous(),
        position_ids=positions[:, part].contiguous(),
        shift_labels=targets,
        num_target_tokens=trained,
        num_loss_units=trained,
        num_input_tokens=int(real[:, part].sum()),
        num_samples=batch["num_samples"] if sp_rank == 0 else 0,
    )
    batch[SLICED] = True
    # every rank attends over the whole (gathered) sequence with its share of the heads; the bounds of the
    # whole row reach attention for unpacked rows too (one document per row), so no layer reads them back from
    # the device
    bounds = document_bounds(positions)
    squares = bounds["num_attention_sq"] if packed else batch.get("num_attention_sq", 0)
    bounds["num_attention_sq"] = squares // sp
    batch.update(bounds)
    del batch["labels"]
    return batch


class SequenceSlicer:
    """Wraps a collator: the batch every rank of a sequence-parallel group builds (the same samples) is cut
    to this rank's slice (:func:`slice_rows`, ``micro_batch_size`` rows)."""

    def __init__(self, collate: Callable[..., Any], pad_id: int, sp: int, sp_rank: int, rows: int) -> None:
        self.collate, self.pad_id, self.sp, self.sp_rank, self.rows = collate, pad_id, sp, sp_rank, rows

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return slice_rows(dict(self.collate(samples)), self.pad_id, self.sp, self.sp_rank, self.rows)


def sequence_parallel_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: Ulysses attention over ``sequence_parallel_size`` processes."""
    if config.sequence_parallel_size > 1:
        from posttrain.models.token_logps import unwrap

        install_sequence_parallel(
            unwrap(model),
            config.sequence_parallel_size,
            config.model.attn_implementation,
            config.micro_batch_size,
        )
    return model
