"""Attention within each document of a row holding several (packed and padding-free rows).

Given only ``position_ids``, transformers builds a block-diagonal mask over the whole row for ``sdpa`` and
``eager`` (memory and compute grow with the row's length squared, and the masked call is slower than a causal
one). Here the collator computes the documents' bounds once per micro-batch on the host
(``data.samples.document_bounds``: ``cu_seq_lens_*`` and ``max_length_*``, transformers' names, and
``document_bounds``, a tensor that stays on the host; ``data.collate.HostPrepared`` adds them to any
collator's rows) and every layer receives them with the model's inputs:

- on CUDA, in bf16/fp16, one varlen flash-attention call per layer covers every document
  (``torch.nn.attention.varlen.varlen_attn``, called as the installed torch's signature asks: 2.10 takes
  ``is_causal`` and no scale, 2.11 ``window_size`` and ``scale``, 2.12 to 2.14 also ``enable_gqa``, later ones
  handle fewer key/value heads natively): no mask, no plan per document length, no host sync. Under
  autocast the fp32 query, key and value (RoPE's output) are cast to the autocast dtype first, as autocast
  would for ``sdpa``;
- elsewhere (CPU, fp32), causal ``sdpa`` runs on each document in turn, cut at the host bounds: the cost is the
  sum of the documents' squared lengths and no mask over the row is built.

A layer with a sliding window (``sliding_window=W``: each token sees itself and the W - 1 before it) is exact on
both paths: the varlen call takes the window, and a document longer than W gets its own banded mask. The
window is the layer's own (``layer_window``): models that mix sliding and full layers (Gemma-2/3/4, Qwen2's
``max_window_layers``, EXAONE-4) pass ``sliding_window=None`` from their full layers. A row without documents
that is longer than the window is attended as one banded document too, unless padding comes first in it
(generation's left-padded prompts): that forward keeps transformers' mask.

A vision-language model whose image tokens see the rest of their image, the later tokens too (Gemma 3:
transformers' ``block_sequence_ids``, an image being a run of consecutive image tokens), adds those blocks to
each document's attention, as transformers' mask does (on a windowed layer a token sees the window before it
and, within the window, the rest of its image): the model's pre-hook finds the images' runs once per forward
(one read of the modality types), and a document holding an image gets a mask of its own (the others stay on
the unmasked path). Other models with such blocks keep transformers' masked row.

Under ``torch.compile`` the varlen call runs as it is inside the compiled block (torch's own operator, with the
maximum length from the batch); the per-document ``sdpa`` loop is one opaque operator
(``posttrain::causal_documents``), so the compiled blocks neither unroll the documents nor recompile for every
new set of bounds.

``flash_attention_2/3`` take the same ``cu_seq_lens_*`` from the inputs themselves (transformers then derives
nothing per layer), and flex attention builds a sparse document block mask, so both are used as they are.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.config.trainer import TrainerConfig
from posttrain.data.samples import document_bounds
from posttrain.errors import UserError
from posttrain.logs import say
from posttrain.models.dimensions import more_than_causal, read_dimensions, text_config
from posttrain.models.peft import base_model
from posttrain.vision.collate import token_type_keys
from posttrain.vision.processor import is_vision_language

#: the attention name the model is switched to: transformers builds no mask for a name it does not know, and
#: checks a name holding "sdpa" against the model's sdpa support (Gemma-2 has none, yet is causal attention)
DOCUMENT_ATTENTION = "posttrain_documents"
#: implementations whose whole-row mask per-document attention replaces
REPLACED = ("sdpa", "eager")
#: device types where torch's varlen flash kernel runs (tests add "cpu" over stand-in kernels)
VARLEN_DEVICES = {"cuda"}
HALF = (torch.bfloat16, torch.float16)
#: vision-language models whose image tokens attend both ways within an image that is a run of consecutive
#: image tokens (the modality type 1) in a row, with the window, where a layer has one, over that: Gemma 3
IMAGE_BLOCK_MODELS = frozenset({"gemma3"})


# ------------------------------------------------------------------------------------ torch's varlen call


def _varlen_attn() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_SIGNATURES: dict[Any, frozenset[str]] = {}


def _parameters(function: Callable[..., Any]) -> frozenset[str]:
    """The parameters of the installed ``varlen_attn`` (``functools.wraps`` wrappers see through), read once
    outside any compiled region (``use_document_attention`` reads them first)."""
    found = _SIGNATURES.get(function)
    if found is None:
        found = _SIGNATURES[function] = frozenset(inspect.signature(function).parameters)
    return found


def varlen_applies(query: torch.Tensor, key: torch.Tensor, scale: float, window: int | None) -> bool:
    """Whether one varlen flash call can run these inputs: a device and dtype it has kernels for, a head size
    the kernel takes (a multiple of 8, at most 256), query heads a multiple of the key/value heads, and the
    scale and window the installed signature can express."""
    function = _varlen_attn()
    if function is None or query.device.type not in VARLEN_DEVICES or query.dtype not in HALF:
        return False
    parameters = _parameters(function)
    if "scale" not in parameters and abs(scale - query.shape[-1] ** -0.5) > 1e-9 * scale:
        return False
    if window and "window_size" not in parameters:
        return False
    dim = query.shape[-1]
    return dim % 8 == 0 and dim <= 256 and query.shape[-3] % key.shape[-3] == 0


def varlen_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cumulative: torch.Tensor,
    longest: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention per document of ``[tokens, heads, dim]`` inputs (``cumulative``: int32 bounds on the
    device; ``longest``: the longest document, a Python int) in one call of the installed ``varlen_attn``."""
    function = _varlen_attn()
    assert function is not None
    parameters = _parameters(function)
    options: dict[str, Any] = {}
    if "window_size" in parameters:
        options["window_size"] = (window - 1 if window and window < longest else -1, 0)
    else:
        options["is_causal"] = True
    if "scale" in parameters:
        options["scale"] = scale
    if "enable_gqa" in parameters and key.shape[1] != query.shape[1]:
        options["enable_gqa"] = True
    return function(query, key, value, cumulative, cumulative, longest, longest, **options)


# ------------------------------------------------------------------------------- the per-document sdpa


def _document_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int,
    blocks: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Causal ``sdpa`` on one document ``[1, heads, length, dim]``; a mask only when the document is longer
    than the window or holds image ``blocks`` (``[start, end)`` in the document: each token of one sees the
    whole block, then the window, if any, cuts what every token sees before it)."""
    gqa = key.shape[1] != query.shape[1]
    if gqa and query.is_cuda and query.dtype == torch.float32:
        # only sdpa's math kernel takes grouped heads in float32 on CUDA, and it holds the [heads, length,
        # length] scores: the heads repeated instead keep the memory-efficient kernel
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        gqa = False
    length = query.shape[2]
    if not blocks and (not window or length <= window):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    index = torch.arange(length, device=query.device)
    allowed = index[None, :] <= index[:, None]
    for start, end in blocks or ():
        allowed[start:end, start:end] = True  # a fill on the device: nothing read back
    if window:
        allowed &= index[None, :] > index[:, None] - window
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def image_blocks(types: torch.Tensor) -> torch.Tensor:
    """Where each image's run of tokens starts and ends over the rows laid end to end (``[images, 2]``
    int64 on the host, ``[start, end)``), from the modality types ``[rows, tokens]`` (1 at an image's
    tokens): one read of the types; a run never continues into the next row."""
    image = (types == 1).cpu().to(torch.int8)
    change = torch.diff(F.pad(image, (1, 1)), dim=1)  # +1 where a run starts, -1 just past its end
    length = types.shape[-1]
    starts, ends = ((change == sign).nonzero() for sign in (1, -1))  # row-major, so they pair up
    return torch.stack([starts[:, 0] * length + starts[:, 1], ends[:, 0] * length + ends[:, 1]], dim=1)


def blocks_by_document(bounds: list[int], blocks: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    """The image blocks of each document that holds any, as ``[start, end)`` within it (a block is cut at
    the document's bounds: transformers' document mask cuts it there too)."""
    found: dict[int, list[tuple[int, int]]] = {}
    spans = blocks.tolist()
    first = 0
    for document, (a, b) in enumerate(itertools.pairwise(bounds)):
        while first < len(spans) and spans[first][1] <= a:
            first += 1
        inside = itertools.takewhile(lambda span: span[0] < b, spans[first:])  # noqa: B023
        local = [(max(s, a) - a, min(e, b) - a) for s, e in inside]
        if local:
            found[document] = local
    return found


def causal_documents_eager(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    cumulative: torch.Tensor | None = None,
    window: int = 0,
    longest: int = 0,
    varlen: bool = True,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention per document of ``[1, heads, tokens, dim]`` inputs whose documents end at ``bounds``
    (host int64: 0, ends...; ``cumulative``: the same on the device, when the batch brought it there;
    ``longest``: the longest document when the batch says, else read from the host bounds), with the image
    ``blocks`` (``image_blocks``) attended both ways; ``[1, heads, tokens, dim]`` out. ``varlen``: False keeps
    to ``sdpa`` (inside the compiled operator)."""
    edges = bounds.tolist()
    images = blocks_by_document(edges, blocks) if blocks is not None and len(blocks) else {}
    if varlen and varlen_applies(query, key, scale, window):
        longest = longest or int((bounds[1:] - bounds[:-1]).max())  # host tensor: no device read
        if cumulative is None or cumulative.device != query.device:
            cumulative = bounds.to(device=query.device)
        out = varlen_causal(
            *(x[0].transpose(0, 1) for x in (query, key, value)),  # [1, h, t, d] -> [t, h, d]
            cumulative.to(torch.int32),
            longest,
            scale,
            window,
        )
        out = out.transpose(0, 1).unsqueeze(0)
        if not images:
            return out
        # the documents holding an image again, with their blocks: the others keep the one varlen call
        outputs = [
            _document_sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale, window, images[index])
            if index in images
            else out[:, :, a:b]
            for index, (a, b) in enumerate(itertools.pairwise(edges))
        ]
        return torch.cat(outputs, dim=2)
    outputs = [
        _document_sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale, window, images.get(index))
        for index, (a, b) in enumerate(itertools.pairwise(edges))
    ]
    return torch.cat(outputs, dim=2)


@torch.library.custom_op("posttrain::causal_documents", mutates_args=())
def causal_documents(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    window: int = 0,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-document ``sdpa`` loop as one operator for ``torch.compile`` (the varlen call needs none)."""
    return causal_documents_eager(
        query, key, value, bounds, scale, window=window, varlen=False, blocks=blocks
    ).contiguous()


@causal_documents.register_fake
def _(
    query: Any, key: Any, value: Any, bounds: Any, scale: float, window: int = 0, blocks: Any = None
) -> Any:
    return query.new_empty(query.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    query, key, value, bounds, scale, window, blocks = inputs
    ctx.save_for_backward(query, key, value, bounds)
    ctx.scale, ctx.window, ctx.blocks = scale, window, blocks  # blocks: a host tensor, never differentiated


@torch.library.custom_op("posttrain::causal_documents_backward", mutates_args=())
def causal_documents_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    window: int = 0,
    blocks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`causal_documents`, recomputing the attention (the operator keeps no
    activations); an operator of its own so that the compiler does not trace into the documents."""
    _, pullback = torch.func.vjp(
        lambda q, k, v: causal_documents_eager(
            q, k, v, bounds, scale, window=window, varlen=False, blocks=blocks
        ),
        query,
        key,
        value,
    )
    gq, gk, gv = pullback(grad)
    return gq.contiguous(), gk.contiguous(), gv.contiguous()


@causal_documents_backward.register_fake
def _(
    grad: Any,
    query: Any,
    key: Any,
    value: Any,
    bounds: Any,
    scale: float,
    window: int = 0,
    blocks: Any = None,
) -> Any:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    query, key, value, bounds = ctx.saved_tensors
    grads = causal_documents_backward(grad, query, key, value, bounds, ctx.scale, ctx.window, ctx.blocks)
    return (*grads, None, None, None, None)


causal_documents.register_autograd(_backward, setup_context=_setup)


# --------------------------------------------------------------------------------- the attention function


def per_document(core: Callable[..., Any]) -> Callable[..., Any]:
    """An attention function: causal attention per document when the inputs carry the documents' bounds (the
    collator's, or those :func:`bounds_hook` derived from a batch-1 row's ``position_ids`` before the
    forward), with image blocks attended both ways when they carry ``image_blocks``; ``core`` (an ``sdpa``
    attention function, over the mask transformers built) otherwise."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        bounds = kwargs.get("document_bounds")  # the batch's, or derived once per forward (bounds_hook)
        window = layer_window(module, kwargs)
        whole = key.shape[2] == query.shape[2] and not _KEEP_MASK[0]  # rows attended without their mask
        blocks = kwargs.get("image_blocks")
        blocks = blocks if blocks is not None and len(blocks) and whole else None
        if bounds is None and whole and (blocks is not None or (window and query.shape[2] > window)):
            bounds = torch.arange(query.shape[0] + 1) * query.shape[2]  # a document per row
        if bounds is None or (len(bounds) <= 2 and query.shape[0] == 1 and not window and blocks is None):
            return core(module, query, key, value, mask, *args, **kwargs)
        scale = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        query, key, value = _autocast(query, key, value)
        batch, heads, length, dim = query.shape
        q, k, v = (_flat(x, batch, length) for x in (query, key, value))
        cumulative = kwargs.get("cu_seq_lens_q")  # the bounds already on the device (the loop moved them)
        longest = int(kwargs.get("max_length_q") or 0)
        if not torch.compiler.is_compiling():
            out = causal_documents_eager(
                q, k, v, bounds, float(scale), cumulative, window, longest, blocks=blocks
            )
        elif (
            blocks is None
            and cumulative is not None
            and longest
            and varlen_applies(q, k, float(scale), window)
        ):
            t = (x[0].transpose(0, 1) for x in (q, k, v))
            out = varlen_causal(*t, cumulative.to(torch.int32), longest, float(scale), window)
            out = out.transpose(0, 1).unsqueeze(0)
        else:
            out = causal_documents(q, k, v, bounds, float(scale), window, blocks)
        # [1, heads, batch x length, dim] -> [batch, length, heads, dim], as transformers' attention returns
        return out.reshape(heads, batch, length, dim).permute(1, 2, 0, 3), None

    return attention


def layer_window(module: Any, kwargs: dict[str, Any]) -> int:
    """The sliding window of this call (0: full causal attention). The call's ``sliding_window`` decides
    whenever the call passes one, ``None`` included: EXAONE-4 keeps the config's window on every layer's
    module and passes ``None`` from its full-attention layers. Only a call that passes none falls back to
    the module's attribute."""
    value = (
        kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    )
    return int(value or 0)


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, float32 inputs in the autocast dtype, as autocast would cast them for ``sdpa``."""
    device = tensors[0].device.type
    if tensors[0].dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) for x in tensors)


def _flat(x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """``[batch, heads, length, dim]`` -> ``[1, heads, batch x length, dim]``: the rows laid end to end."""
    return x.transpose(0, 1).reshape(1, x.shape[1], batch * length, x.shape[3])


#: where a forward may take a cache (generation): no documents are derived there
_CACHES = ("past_key_values", "cache")
_ARGUMENT_AT: dict[Any, int | None] = {}


def _argument(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The forward's argument ``name``, passed by name or by place."""
    if name in kwargs or not args:
        return kwargs.get(name)
    forward = type(module).forward
    if (forward, name) not in _ARGUMENT_AT:
        names = list(inspect.signature(forward).parameters)[1:]  # without self
        _ARGUMENT_AT[forward, name] = names.index(name) if name in names else None
    at = _ARGUMENT_AT[forward, name]
    return args[at] if at is not None and at < len(args) else None


def _padding_masks(on: bool) -> None:
    """Whether transformers builds a mask for per-document attention in this forward: ``sdpa``'s for a
    padded batch (an attention mask given: left-padded prompts in generation, whose padding must not be
    attended, at every cached step too), none otherwise. Set by the model's pre-hook before each forward, so
    a forward of rows of documents builds no mask and reads nothing from the device (transformers looks for
    packed rows in the positions, one device read, whenever it has a mask function and no attention mask)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    mapping = AttentionMaskInterface._global_mapping  # what transformers itself checks
    if on:
        mapping[DOCUMENT_ATTENTION] = sdpa_mask
    else:
        mapping.pop(DOCUMENT_ATTENTION, None)


#: whether this forward's attention keeps transformers' mask: rows with padding before their tokens
#: (generation's left-padded prompts), never attended as one causal document each, and a padded or cached
#: forward of a model with image blocks (transformers' mask holds the blocks). Set by the model's pre-hook.
_KEEP_MASK = [False]


def _left_padded(model: torch.nn.Module, mask: Any) -> bool:
    """Whether a 2-D attention mask pads any row on the left: read (one read of the mask's first column per
    forward) only for a model with a sliding window, the one case where a row is attended as a document of
    its own (``attention``), which left padding would break; a right-padded batch stays on that path."""
    config = text_config(getattr(model, "config", None))
    if not getattr(config, "sliding_window", None) or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    return bool((mask[:, 0] == 0).any())


def derive_bounds(positions: torch.Tensor) -> dict[str, Any]:
    """The documents' bounds of a row from its positions (one read of the positions from the device), with
    the cumulative lengths copied to the positions' device once."""
    found = document_bounds(positions)
    del found["num_attention_sq"]
    found["cu_seq_lens_q"] = found["cu_seq_lens_k"] = found["cu_seq_lens_q"].to(positions.device)
    return found


def bounds_hook(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], blocks: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A forward pre-hook on the model. It tells transformers whether to build a mask for this forward (only
    for a batch with an attention mask: ``_padding_masks``; a model with image ``blocks``, also for a cached
    forward). A batch-1 row with ``position_ids`` that restart
    (documents laid end to end), no attention mask and no bounds of its own (a user's call, or a collator
    ``HostPrepared`` did not wrap) gets the bounds derived here, once per forward: every layer, compiled blocks included, then
    attends per document, and no layer reads the positions or copies bounds to the device. A model with image
    blocks gets them from its ``token_type_ids`` (``image_blocks``) for a forward without mask or cache.
    Nothing is kept between forwards, so a positions tensor changed in place is read afresh."""
    mask = _argument(module, args, kwargs, "attention_mask")
    padded = mask is not None
    cached = any(kwargs.get(name) is not None for name in _CACHES)
    _padding_masks(padded or (blocks and cached))
    _KEEP_MASK[0] = (padded and _left_padded(module, mask)) or (blocks and (padded or cached))
    if padded or cached:
        return None
    found: dict[str, Any] = {}
    types = _argument(module, args, kwargs, "token_type_ids") if blocks else None
    if isinstance(types, torch.Tensor) and "image_blocks" not in kwargs:
        found["image_blocks"] = image_blocks(types)
    positions = _argument(module, args, kwargs, "position_ids")
    if (
        "document_bounds" not in kwargs
        and isinstance(positions, torch.Tensor)
        and positions.dim() == 2
        and positions.shape[0] == 1
    ):
        bounds = derive_bounds(positions)
        if len(bounds["document_bounds"]) > 2:  # one document: plain causal attention
            found |= bounds
    return (args, {**kwargs, **found}) if found else None


def unsupported_by_documents(model: torch.nn.Module) -> str:
    """Why per-document attention would not be exact for this model ('' when it is): it computes causal
    attention, with sliding windows, but without logit soft-capping, attention dropout or attention sinks
    (GPT-OSS: a learned logit per head in every row's softmax), and with image tokens that see later ones
    only in the blocks it finds as the model does (Gemma 3's; not Molmo2's)."""
    config = getattr(model, "config", None)
    reason = more_than_causal(read_dimensions(config)) if config is not None else ""
    if not reason and any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        reason = "its attention has sinks (a learned logit per head in every row's softmax)"
    if not reason and has_image_blocks(model) and not image_blocks_known(model):
        reason = (
            "its image tokens attend both ways in blocks it finds itself (transformers' block_sequence_ids)"
        )
    return reason


def has_image_blocks(model: torch.nn.Module) -> bool:
    """Whether the model's language model lets image tokens see later tokens: a vision-language model given
    modality types (``vision.collate.token_type_keys``) whose transformers module builds attention blocks
    from them (``block_sequence_ids``); a PEFT wrapper's model is the one looked at."""
    model = base_model(model)
    return bool(token_type_keys(model)) and "block_sequence_ids" in _module_source(type(model).__module__)


def image_blocks_known(model: torch.nn.Module) -> bool:
    """Whether per-document attention finds the model's image blocks as it does (``IMAGE_BLOCK_MODELS``)."""
    model = base_model(model)
    family = getattr(getattr(model, "config", None), "model_type", None)
    return family in IMAGE_BLOCK_MODELS and "token_type_ids" in token_type_keys(model)


@functools.cache
def _module_source(name: str) -> str:
    module = sys.modules.get(name)
    try:
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ""


def language_model_only(model: torch.nn.Module, name: str) -> str | dict[str, str]:
    """``set_attn_implementation``'s argument that gives ``name`` to the language model alone: a
    vision-language model's image encoder attends over each image's patches both ways, never per document."""
    config = getattr(model, "config", None)
    if is_vision_language(config) and "text_config" in (getattr(config, "sub_configs", None) or {}):
        return {"text_config": name}
    return name


def use_document_attention(model: torch.nn.Module) -> str:
    """Switch an ``sdpa`` or ``eager`` model to per-document attention for rows of several documents (eager
    per document is causal ``sdpa``: the same product, without the whole-row mask), unless the model's
    attention needs more than that: then transformers' masked attention stays, and the reason is returned.
    Without documents, a right-padded batch is still exact: with causal attention no real token sees the
    padding after it, and padding carries no label."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    reason = unsupported_by_documents(model)
    if reason:
        return reason
    if _varlen_attn() is not None:
        _parameters(_varlen_attn())  # read the signature now, not inside a compiled block
    AttentionInterface.register(DOCUMENT_ATTENTION, per_document(sdpa_attention_forward))
    model.set_attn_implementation(language_model_only(model, DOCUMENT_ATTENTION))
    hook = functools.partial(bounds_hook, blocks=has_image_blocks(model))
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return ""


def document_attention_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: rows of several documents (packed or padding-free) attend per document, with no mask over
    the row (sequence parallelism brings its own per-document attention)."""
    documents = config.joins_documents
    if documents and config.model.attn_implementation in REPLACED and config.sequence_parallel_size == 1:
        kept = use_document_attention(model)
        if "sinks" in kept:
            # GPT-OSS builds its masks without the positions, so its masked row would cross documents too
            key = "data.pack_samples" if config.data.pack_samples else "data.padding_free"
            raise UserError(
                f"{key}: true, but {kept}: per-document attention does not compute them, and transformers' "
                f"masked row for {type(model).__name__} does not keep the documents apart; set {key}: false "
                "(padded rows are exact)"
            )
        if kept:
            say(f"per-document attention does not apply to this model ({kept}): packed rows use a masked row")
    return model


#: attention implementations that keep the documents of a row apart by its positions
DOCUMENT_KERNELS = (DOCUMENT_ATTENTION, "flash_attention_2", "flash_attention_3", "flex_attention")


def attends_per_document(model: torch.nn.Module) -> bool:
    """Whether the model's language model attends per document in a row of several (its attention is
    posttrain's per-document one, or a kernel that reads the documents from the positions)."""
    return _attention_of(model) in DOCUMENT_KERNELS


def _attention_of(model: torch.nn.Module) -> str | None:
    """The attention implementation of the model's language model."""
    config = getattr(model, "config", None)
    return getattr(text_config(config), "_attn_implementation", None) if config is not None else None


def joins_rows(padding_free: bool, model: torch.nn.Module, split: bool = False) -> bool:
    """Whether an online method's micro-batches are joined into one row (``padding_free``, where the model
    attends per document; not when sequence parallelism ``split``s the rows); said in one line when the
    setting is on and the run cannot."""
    if not padding_free:
        return False
    if split:
        say("padding_free: the rows are split over the sequence-parallel processes instead (padded rows)")
        return False
    if attends_per_document(model):
        return True
    why = unsupported_by_documents(model) or "its attention implementation reads a mask over the row"
    say(
        f"padding_free: per-document attention does not apply to this model ({why}): micro-batches stay padded"
    )
    return False


def follow_documents(model: torch.nn.Module, policy: torch.nn.Module, what: str) -> None:
    """A frozen model that reads the policy's micro-batches (a reference, a teacher) attends per document
    when the policy does, so joined rows stay exact for it too; refused in one line when it cannot."""
    if not attends_per_document(policy) or attends_per_document(model):
        return
    implementation = _attention_of(model)
    if implementation not in REPLACED:
        raise UserError(
            f"{what}: its attention ({implementation}) cannot keep the joined rows of padding_free apart; set "
            "padding_free: false"
        )
    reason = use_document_attention(model)
    if reason:
        raise UserError(
            f"{what}: per-document attention does not apply to it ({reason}), and the policy's micro-batches "
            "are joined rows; set padding_free: false"
        )
