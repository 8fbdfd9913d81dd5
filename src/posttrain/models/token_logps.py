"""Negative log-likelihood of the labels, summed per sequence: the one place where a model's LM head meets
the loss. SFT and causal add the rows up, DPO compares them. Two paths give the same numbers:

- plain: the model returns ``[batch, tokens, vocab]`` logits and cross-entropy runs on them;
- tiled (``tiled_loss_compute``): while the model runs, its LM head computes the loss itself
  (:class:`ChunkedHeadNLL`), only for the positions that have a label and a chunk of them at a time, so the
  full logits never exist. The head's ``forward`` is swapped for the duration of one call, so it still runs as
  the head module (ZeRO-3 gathers its weight for that call and for its backward). A model factory may bring
  its own fused head loss instead (``liger``: Liger's fused linear cross-entropy).

Labels are the *next* tokens: ``batch["shift_labels"]`` when the batch carries them (sequence parallelism
slices already-shifted labels), else ``labels`` shifted left by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.data.samples import DOCUMENT_KEYS, IGNORE_INDEX, JOINED, SLICED, target_labels
from posttrain.errors import UserError
from posttrain.models.peft import base_model
from posttrain.models.sampling_policy import Replay, SamplingPolicy, entropy_of, replay_for
from posttrain.vision.collate import IMAGE_INPUTS
from posttrain.vision.positions import with_modality_inputs

#: ``tiled_loss_compute: auto`` tiles a micro-batch of at least this many tokens (per rank)
TILED_LOSS_MIN_TOKENS = 8192
#: the most logits the tiled loss holds at once: 2**27 floats (512 MiB in fp32)
TILED_LOSS_CHUNK_ELEMENTS = 2**27
#: the fewest rows of a chunk (smaller matrix products waste the hardware)
TILED_LOSS_MIN_ROWS = 256

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", SLICED, *DOCUMENT_KEYS, *IMAGE_INPUTS)


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {key: batch[key] for key in MODEL_INPUTS if key in batch}


@contextmanager
def forward_inputs(model: Any, batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The model's inputs for ``batch``. A micro-batch whose rows were joined (``data.samples.joined_rows``,
    under ``JOINED``) runs as that one row, and while active the LM head receives the hidden states laid back
    out as the batch's ``[rows, tokens]`` (zeros at the padding): everything from the head on, the tiled loss,
    the sampler's replay, the masks, sees the padded batch, and the decoder spends nothing on padding."""
    joined = batch.get(JOINED)
    base = unwrap(model)
    if joined is None:
        yield with_modality_inputs(base, model_inputs(batch))
        return
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        raise UserError(f"padding_free: {type(base).__name__} has no LM head to lay the rows back out at")
    rows, tokens = batch["input_ids"].shape
    index = joined["index"]

    def laid_out(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0].reshape(-1, args[0].shape[-1])
        flat = hidden.new_zeros(rows * tokens, hidden.shape[-1]).index_copy(0, index, hidden)
        return (flat.view(rows, tokens, -1), *args[1:])

    handle = head.register_forward_pre_hook(laid_out)
    try:
        inputs = {key: value for key, value in joined.items() if key in MODEL_INPUTS}
        yield with_modality_inputs(base, inputs | {key: batch[key] for key in IMAGE_INPUTS if key in batch})
    finally:
        handle.remove()


def chunk_rows(vocab_size: int, hidden_size: int, rows: int) -> int:
    """Rows per chunk: logits about as large as the hidden states they come from (so the loss's memory
    scales with the tokens a process holds, as Liger sizes its chunks), at least ``TILED_LOSS_MIN_ROWS``
    and at most ``TILED_LOSS_CHUNK_ELEMENTS`` logits."""
    vocab = max(vocab_size, 1)
    matched = -(-rows * hidden_size // vocab)
    return max(TILED_LOSS_MIN_ROWS, min(TILED_LOSS_CHUNK_ELEMENTS // vocab, matched))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32: for 16-bit CUDA inputs one tensor-core GEMM accumulating in fp32 (``out_dtype``),
    not an fp32 GEMM over upcast copies; fp32 inputs as they are."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without out_dtype for this GEMM
            return (a @ b).float()
    return a.float() @ b.float()


class ChunkedHeadNLL(torch.autograd.Function):
    """``nll[i] = logsumexp(h_i W^T + b) - (h_i W^T + b)[t_i]`` for the rows with a label, 0 elsewhere,
    computed a chunk of rows at a time (:func:`chunk_rows`) in forward and again in backward. The weight is
    an explicit input, so
    its gradient is returned by ``backward`` and scaled by the incoming gradient like any other (gradient
    accumulation and loss scaling stay exact)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        rows: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        replay: Replay | None = None,
    ) -> torch.Tensor:
        if rows is None:  # a batch without the host's ``target_rows``: one device read
            rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        chunk = chunk_rows(weight.shape[0], weight.shape[1], rows.shape[0])
        nll = torch.zeros(targets.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, rows.shape[0], chunk):
            index = rows[start : start + chunk]
            logits = F.linear(hidden[index], weight, bias).float()
            if replay is not None:  # the sampler's distribution (sampling_policy.py)
                logits = replay(logits, index)[0]
            lse[start : start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[index].unsqueeze(1)).squeeze(1)
            nll[index] = lse[start : start + chunk] - picked
            if entropy is not None:  # filled in place (not differentiated)
                entropy[index] = entropy_of(logits)
            del logits  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, targets, rows, lse)
        ctx.chunk, ctx.replay = chunk, replay
        return nll

    @staticmethod
    def backward(ctx: Any, grad_nll: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, rows, lse = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, rows.shape[0], chunk):
            index = rows[start : start + chunk]
            logits = F.linear(hidden[index], weight, bias).float()
            scale = None
            if ctx.replay is not None:
                logits, scale = ctx.replay(logits, index)
            grad = torch.exp(
                logits - lse[start : start + chunk].unsqueeze(1)
            )  # softmax (0 outside a kept set)
            grad[torch.arange(index.shape[0], device=grad.device), targets[index]] -= 1.0
            if scale is not None:  # through the repetition penalty's factor
                grad *= scale
            grad *= grad_nll[index].unsqueeze(1)
            grad_low = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[index] = grad_low @ weight
            if grad_weight is not None:
                grad_weight += _mm_fp32(grad_low.t(), hidden[index])
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            del logits, grad, grad_low  # before the next chunk's logits exist
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
        )


def unwrap(model: Any) -> torch.nn.Module:
    """The Hugging Face model inside a posttrain/DeepSpeed engine and a PEFT wrapper."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return base_model(model)


def tileable_head(model: Any) -> torch.nn.Linear | None:
    """The LM head when the tiled loss can stand in for it: a plain linear layer whose output the model
    uses as it is (no logit soft-capping after it)."""
    base = unwrap(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if getattr(getattr(base, "config", None), "final_logit_softcapping", None):
        return None
    return head if type(head) is torch.nn.Linear else None


#: attribute a model factory sets on the model for its own fused head loss:
#: ``(hidden [rows, tokens, hidden], weight, bias, targets [rows, tokens]) -> NLL per row``
FUSED_HEAD_ATTRIBUTE = "posttrain_fused_head_nll"


def fused_head_nll(model: Any) -> Any:
    """The model factory's own fused head loss (``liger``), or None for posttrain's chunked one."""
    return getattr(unwrap(model), FUSED_HEAD_ATTRIBUTE, None)


@contextmanager
def head_computes_nll(
    model: Any,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    per_token: bool = False,
    temperature: float = 1.0,
    entropy: torch.Tensor | None = None,
    replay: Replay | None = None,
) -> Iterator[None]:
    """While active, the model's LM head returns the NLL of ``targets`` summed per row (``per_token``: per
    position, ``[rows, tokens]``) instead of logits, from logits divided by ``temperature``. ``rows``: the flat
    positions with a label, from the host, when the batch brought them. ``entropy`` (flat, one per position):
    filled with the next-token distribution's entropy at every labelled position, chunk by chunk. ``replay``:
    the sampler's distribution instead of the plain one (``sampling_policy.Replay``)."""
    head = tileable_head(model)
    if head is None:
        base = unwrap(model)
        found = (
            type(base.get_output_embeddings()).__name__ if hasattr(base, "get_output_embeddings") else "none"
        )
        raise UserError(
            f"tiled_loss_compute=true needs a plain linear LM head whose logits are used as they are, and "
            f"{type(base).__name__} has {found} (LoRA on lm_head, or logit soft-capping); set "
            "tiled_loss_compute: auto or false, or leave lm_head out of the adapter"
        )
    fused = fused_head_nll(model)

    def nll_forward(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = head.weight, head.bias
        if temperature != 1.0:  # logits / T from the scaled head (its gradient flows through the division)
            weight = weight / temperature
            bias = None if bias is None else bias / temperature
        if fused is not None and not per_token and entropy is None and replay is None:
            return fused(hidden, weight, bias, targets)
        flat = hidden.reshape(-1, hidden.shape[-1])
        nll = ChunkedHeadNLL.apply(flat, weight, bias, targets.reshape(-1), rows, entropy, replay)
        nll = nll.view(targets.shape)
        return nll if per_token else nll.sum(-1)

    head.forward = nll_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward  # back to the class's forward


def use_tiled(setting: bool | str, batch: dict[str, Any], model: Any) -> bool:
    if setting == "auto":
        return batch["input_ids"].numel() >= TILED_LOSS_MIN_TOKENS and tileable_head(model) is not None
    return bool(setting)


def row_nll(model: Any, batch: dict[str, Any], tiled: bool | str = False) -> torch.Tensor:
    """Per row of the batch, the float32 NLL of its next-token labels, summed (0 for a row without any)."""
    targets = target_labels(batch)
    if use_tiled(tiled, batch, model):
        with (
            forward_inputs(model, batch) as inputs,
            head_computes_nll(model, targets, batch.get("target_rows")),
        ):
            return model(**inputs, use_cache=False).logits
    with forward_inputs(model, batch) as inputs:
        logits = model(**inputs, use_cache=False).logits
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return nll.view(targets.shape).sum(-1)


def token_logps(
    model: Any,
    batch: dict[str, Any],
    tiled: bool | str = False,
    temperature: float = 1.0,
    entropy: bool = False,
    policy: SamplingPolicy | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position, the float32 log-probability of its next-token label at ``temperature`` (0 where there
    is none), ``[rows, tokens]``; and, with ``entropy``, the entropy of the next-token distribution (not
    differentiated; on the tiled path computed chunk by chunk at the labelled positions, 0 elsewhere).
    ``policy``: the distribution a sampler with these settings draws from (``sampling_policy.py``: the
    penalised, truncated and renormalised one), else the plain ``softmax(logits / T)``."""
    targets = target_labels(batch)
    replay = replay_for(policy, batch, targets)
    if use_tiled(tiled, batch, model):
        found = torch.zeros(targets.numel(), dtype=torch.float32, device=targets.device) if entropy else None
        with (
            forward_inputs(model, batch) as inputs,
            head_computes_nll(
                model,
                targets,
                batch.get("target_rows"),
                per_token=True,
                temperature=temperature,
                entropy=found,
                replay=replay,
            ),
        ):
            logps = -model(**inputs, use_cache=False).logits
        return logps, (found.view(targets.shape) if found is not None else None)
    with forward_inputs(model, batch) as inputs:
        logits = model(**inputs, use_cache=False).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if replay is not None:
        return _replayed_logps(logits, targets, replay, batch.get("target_rows"), entropy)
    nll = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -nll.view(targets.shape), (_entropy(logits) if entropy else None)


def _replayed_logps(
    logits: torch.Tensor,
    targets: torch.Tensor,
    replay: Replay,
    rows: torch.Tensor | None,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logps`'s plain path under a sampler's policy: the sampler replayed at the labelled
    positions only (``rows``, flat, from the host when the batch brought them), 0 elsewhere."""
    flat, goals = logits.flatten(0, 1), targets.reshape(-1)
    if rows is None:
        rows = (goals != IGNORE_INDEX).nonzero().squeeze(1)
    rows = rows.to(flat.device)
    processed = replay(flat[rows], rows)[0]
    picked = -F.cross_entropy(processed, goals[rows], reduction="none")
    logps = torch.zeros(goals.shape[0], dtype=picked.dtype, device=flat.device).index_put((rows,), picked)
    found = None
    if entropy:
        with torch.no_grad():
            found = torch.zeros(goals.shape[0], dtype=torch.float32, device=flat.device)
            found[rows] = entropy_of(processed.detach())
        found = found.view(targets.shape)
    return logps.view(targets.shape), found


@torch.no_grad()
def _entropy(logits: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """``H = logsumexp(z) - sum softmax(z) z`` per position, a chunk of positions at a time (the softmax of
    the whole logits would double their memory)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = entropy_of(flat[start : start + rows])
    return out.view(logits.shape[:-1])
