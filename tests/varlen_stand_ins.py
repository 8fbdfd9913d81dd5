"""CPU stand-ins for torch's varlen flash attention, so that the CUDA path of per-document attention runs in CPU
tests: kernels for torch's own custom operators (``torch_attn::_varlen_attn`` and its backward, under the
installed torch's ``varlen_attn`` wrapper and autograd registration), and the public ``varlen_attn``
signatures of other torch versions. Each checks the flash kernel's preconditions: int32 cumulative lengths,
Python-int maximum lengths, a contiguous last dimension, query heads a multiple of key/value heads, a head size
that is a multiple of 8 and at most 256, 16-bit inputs. The numbers are causal (optionally banded) ``sdpa``
per document in float32."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.models import document_attention

CALLS: list[str] = []  # which stand-in ran, in order
WINDOWS: list[int] = []  # the left window each forward call was given (-1: none), in order


def check_preconditions(query: Any, key: Any, value: Any, cumulative: Any, max_q: Any, max_k: Any) -> None:
    assert isinstance(max_q, int) and isinstance(max_k, int), "max lengths must be Python ints"
    assert cumulative.dtype == torch.int32, f"cumulative lengths must be int32, got {cumulative.dtype}"
    assert all(x.stride(-1) == 1 for x in (query, key, value)), "the last dimension must be contiguous"
    assert query.shape[1] % key.shape[1] == 0, "query heads must be a multiple of key/value heads"
    dim = query.shape[-1]
    assert dim % 8 == 0 and dim <= 256, f"head size {dim}: a multiple of 8, at most 256"
    assert query.dtype in (torch.bfloat16, torch.float16), f"flash needs 16-bit inputs, got {query.dtype}"


def reference(query: Any, key: Any, value: Any, cumulative: Any, scale: Any, left: int = -1) -> torch.Tensor:
    """``[tokens, heads, dim]`` causal attention per document (keys within ``left`` before, when >= 0)."""
    outputs = []
    for a, b in itertools.pairwise(cumulative.tolist()):
        q, k, v = (x[a:b].transpose(0, 1).float().unsqueeze(0) for x in (query, key, value))
        index = torch.arange(b - a)
        mask = index[None, :] <= index[:, None]
        if left >= 0:
            mask &= index[None, :] >= index[:, None] - left
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs).to(query.dtype)


# ------------------------------------------------------------------- kernels for torch's own operators


def _forward_kernel(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None, *rest
):
    check_preconditions(query, key, value, cu_seq_q, max_q, max_k)
    window = list(window_size or [-1, -1])
    assert is_causal or window[1] == 0, "posttrain asks for causal attention"
    CALLS.append("torch_attn::_varlen_attn")
    WINDOWS.append(window[0])
    out = reference(query, key, value, cu_seq_q, scale, window[0])
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float32)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _backward_kernel(
    grad_out,
    query,
    key,
    value,
    out,
    lse,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    is_causal,
    rng_state,
    scale=None,
    window_size=None,
):
    check_preconditions(query, key, value, cu_seq_q, max_q, max_k)
    CALLS.append("torch_attn::_varlen_attn_backward")
    left = (window_size or [-1, -1])[0]
    _, pullback = torch.func.vjp(lambda q, k, v: reference(q, k, v, cu_seq_q, scale, left), query, key, value)
    return tuple(g.contiguous() for g in pullback(grad_out))


_registered = False


def register_torch_kernels() -> bool:
    """CPU kernels for the installed torch's varlen operators; False when this torch has none."""
    global _registered
    if document_attention._varlen_attn() is None:
        return False
    if not _registered:
        torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _forward_kernel)
        torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _backward_kernel)
        _registered = True
    return True


@contextmanager
def varlen_on_cpu(function: Any = None) -> Iterator[None]:
    """The varlen path taken on CPU tensors: with torch's own ``varlen_attn`` over the stand-in kernels, or
    with ``function`` standing for another torch version's ``varlen_attn``."""
    original = document_attention._varlen_attn
    document_attention.VARLEN_DEVICES.add("cpu")
    if function is not None:
        document_attention._varlen_attn = lambda: function
    CALLS.clear()
    WINDOWS.clear()
    try:
        yield
    finally:
        document_attention.VARLEN_DEVICES.discard("cpu")
        document_attention._varlen_attn = original


# ------------------------------------------------------------------ other torch versions' public signatures


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10: ``is_causal``, no scale (the default 1/sqrt(dim)), no window, no GQA switch."""
    check_preconditions(query, key, value, cu_seq_q, max_q, max_k)
    assert is_causal
    CALLS.append("2.10")
    WINDOWS.append(-1)
    return reference(query, key, value, cu_seq_q, query.shape[-1] ** -0.5)


def varlen_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11: ``scale`` and ``window_size``; fewer key/value heads handled by the kernel itself."""
    check_preconditions(query, key, value, cu_seq_q, max_q, max_k)
    assert window_size[1] == 0
    CALLS.append("2.11")
    WINDOWS.append(window_size[0])
    return reference(query, key, value, cu_seq_q, scale, window_size[0])


def varlen_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.12 to 2.14: ``enable_gqa`` must be set for fewer key/value heads."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads; set enable_gqa=True")
    check_preconditions(query, key, value, cu_seq_q, max_q, max_k)
    assert window_size[1] == 0
    CALLS.append("2.13")
    WINDOWS.append(window_size[0])
    return reference(query, key, value, cu_seq_q, scale, window_size[0])


def varlen_later(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    k_cache=None,
    v_cache=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    page_table=None,
    seqused_k=None,
):
    """After 2.14 (main): no ``enable_gqa`` (native), a KV cache."""
    check_preconditions(query, key, value, cu_seq_q, max_q, max_k)
    assert window_size[1] == 0
    CALLS.append("later")
    WINDOWS.append(window_size[0])
    return reference(query, key, value, cu_seq_q, scale, window_size[0])


SIGNATURES = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.13": varlen_2_13, "later": varlen_later}
