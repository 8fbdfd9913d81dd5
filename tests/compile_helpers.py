"""The compiled-blocks checks shared by the CPU (stand-in kernels) and GPU tests: an eager bf16 model with
activation checkpointing and per-document attention beside its compiled copy, and the compile counters."""

from __future__ import annotations

import copy
from typing import Any

import torch


def eager_and_compiled(model: Any) -> tuple[Any, Any]:
    """``model`` (bf16, training) prepared as a packed run prepares it, and a copy with compiled blocks; the
    dynamo counters are cleared for :func:`assert_few_graphs`."""
    from torch._dynamo.utils import counters

    from posttrain.models.compile import compile_blocks
    from posttrain.models.document_attention import use_document_attention

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    use_document_attention(model)
    compiled = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled)
    return model, compiled


def assert_few_graphs() -> None:
    """No graph break, and changing document bounds compiled into at most four graphs."""
    from torch._dynamo.utils import counters

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
