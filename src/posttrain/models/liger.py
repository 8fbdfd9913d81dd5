"""Model factory ``liger`` (ArcticTraining's ``LigerModelFactory``): the Hugging Face model with the
Liger kernels (RMSNorm, RoPE, SwiGLU) and Liger's fused linear cross-entropy as the tiled loss. The kernels
are Triton: a CUDA GPU and the ``liger`` extra (``pip install 'posttrain[liger]'``) are needed."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.model import ModelConfig
from posttrain.context import RunContext
from posttrain.data.samples import IGNORE_INDEX
from posttrain.errors import UserError
from posttrain.models.huggingface import HuggingFaceModelFactory
from posttrain.models.token_logps import FUSED_HEAD_ATTRIBUTE


def _liger() -> Any:
    if not torch.cuda.is_available():
        raise UserError(
            "model.type=liger runs Liger's Triton kernels, which need a CUDA GPU, and none is visible; "
            "use model.type: huggingface (its tiled loss needs no GPU)"
        )
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        raise UserError(
            "model.type=liger needs the liger-kernel package: pip install 'posttrain[liger]'"
        ) from None
    return liger


class LigerModelFactory(HuggingFaceModelFactory):
    def load(self, config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
        liger = _liger()
        model = super().load(config, ctx)
        # posttrain computes the loss itself (methods/token_logps.py): Liger's fused loss enters there
        liger._apply_liger_kernel_to_instance(
            model=model, cross_entropy=False, fused_linear_cross_entropy=False
        )
        setattr(model, FUSED_HEAD_ATTRIBUTE, fused_linear_nll(liger))
        return model


def fused_linear_nll(liger: Any) -> Any:
    """Liger's fused linear cross-entropy, summed per row (its gradients are scaled by the incoming
    scalar gradient, so loss scaling stays exact)."""
    loss = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")

    def nll(
        hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
    ) -> torch.Tensor:
        rows = []
        for i in range(hidden.shape[0]):
            out = loss(weight, hidden[i], targets[i], bias)
            rows.append(out[0] if isinstance(out, tuple) else out)  # some versions add the z-loss
        return torch.stack(rows).float()

    return nll


FACTORY = LigerModelFactory()
