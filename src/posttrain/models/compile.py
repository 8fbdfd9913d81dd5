"""``model.compile``: ``torch.compile`` per transformer block.

Compiling the blocks instead of the whole model keeps the first step short: every block runs the same code,
so they share one compiled graph (the parameters are graph inputs), and what lies between the blocks (the
embeddings, the attention mask, the head and loss) stays eager. Only ``forward`` is compiled, not the
module call: hooks that DeepSpeed ZeRO-3 puts on the module (gathering and releasing the partitioned
parameters) stay outside the graph, and transformers' activation checkpointing, which wraps ``forward``,
is traced as a checkpointed region. ZeRO-3 also hooks every module inside a block, which would break the
graph at each one; the engine marks compiled blocks as ZeRO-3 leaves (``compiled_block_classes``), so the
whole block's parameters are gathered by the block's own hook and nothing inside it is hooked.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.trainer import TrainerConfig
from posttrain.errors import UserError

COMPILED = "_posttrain_compiled"


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: transformers names their classes in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    base = getattr(model, "get_base_model", None)  # a PEFT wrapper
    if not names and base is not None:
        names = set(getattr(base(), "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def compile_blocks(model: torch.nn.Module) -> int:
    """Replace each block's ``forward`` by its compiled version; the number of blocks compiled."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise UserError(
            f"model.compile: found no transformer blocks in {type(model).__name__} (transformers lists them "
            "in the model's _no_split_modules); set model.compile: false"
        )
    for block in blocks:
        block.forward = torch.compile(block.forward)
        setattr(block, COMPILED, True)
    return len(blocks)


def compiled_block_classes(model: torch.nn.Module) -> list[type]:
    """The classes of the blocks ``compile_blocks`` compiled (empty when it did not run)."""
    return sorted({type(m) for m in model.modules() if getattr(m, COMPILED, False)}, key=lambda c: c.__name__)


def compile_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """Model transform: ``model.compile``, last, so that it captures the blocks as they will run."""
    if config.model.compile:
        compile_blocks(model)
    return model
