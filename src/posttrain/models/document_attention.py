"""Attention within each document of a row whose ``position_ids`` restart at every document.

Packed and padding-free rows hold several samples one after another. Given only ``position_ids``,
transformers builds a block-diagonal mask over the whole row for ``sdpa`` (memory and compute grow with the
row's length squared, and the masked call is slower than a causal one). :func:`per_document` instead cuts
the row where the positions restart and runs causal ``sdpa`` on each document, so the cost is the sum of
the documents' squared lengths and no mask is built. Flash attention separates documents by itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

#: the attention name the model is switched to (transformers builds no mask for a name it does not know)
DOCUMENT_SDPA = "posttrain_sdpa_documents"


def per_document(core: Callable[..., Any]) -> Callable[..., Any]:
    """``core`` (an ``sdpa`` attention function) over each document of a row (batch 1) on its own, cut
    where ``position_ids`` restart at 0; other batches go to ``core`` unchanged."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        positions = kwargs.get("position_ids")
        if positions is None or query.shape[0] != 1:
            return core(module, query, key, value, mask, *args, **kwargs)
        starts = (positions[0] == 0).nonzero().squeeze(1).tolist()
        if starts[:1] != [0]:
            starts = [0, *starts]
        if len(starts) == 1:
            return core(module, query, key, value, mask, *args, **kwargs)
        bounds = [*starts, query.shape[2]]
        outputs = [
            core(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, *args, **kwargs)[0]
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat(outputs, dim=1), None

    return attention


def use_document_attention(model: torch.nn.Module) -> None:
    """Switch an ``sdpa`` model to per-document attention. Without a mask, a right-padded batch is still
    exact: with causal attention no real token sees the padding after it, and padding carries no label."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(DOCUMENT_SDPA, per_document(sdpa_attention_forward))
    model.set_attn_implementation(DOCUMENT_SDPA)
