"""Frozen models to compare the policy against: a loader (DPO's reference, distill's teacher) and an RL
method's KL anchor (``Reference``)."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.model import ModelConfig
from posttrain.context import RunContext
from posttrain.models.peft import apply_peft, is_peft_model
from posttrain.models.sampling_policy import SamplingPolicy
from posttrain.models.token_logps import token_logps
from posttrain.registry import MODEL_FACTORIES


def load_reference_model(config: ModelConfig, ctx: RunContext) -> torch.nn.Module:
    """Loaded by its factory, with the saved adapter of ``peft_pretrained`` when it names one; no training
    transform applies; eval mode, no gradients."""
    model = MODEL_FACTORIES.get(config.type or "huggingface").obj(config, ctx)
    if config.peft_pretrained:
        model = apply_peft(model, None, config.peft_pretrained)
    return model.eval().requires_grad_(False)


class Reference:
    """The frozen model an RL method's KL penalty compares the policy with: the policy's base model with its
    adapters switched off (PEFT, no copy), or a separate frozen copy (``ref_model``, else the policy's initial
    weights) with its embeddings fitted to the tokenizer, on the engine's device."""

    def __init__(
        self, policy: ModelConfig, ref_model: ModelConfig | None, ctx: RunContext, engine: Any, tokenizer: Any
    ) -> None:
        self.engine, self.model = engine, None
        if ref_model is None and is_peft_model(engine.module):
            return
        from posttrain.models.document_attention import follow_documents
        from posttrain.models.embeddings import fit_embeddings
        from posttrain.models.token_logps import unwrap

        reference = load_reference_model(ref_model or policy, ctx)
        fit_embeddings(reference, tokenizer)
        follow_documents(reference, unwrap(engine.module), "ref_model")
        self.model = reference.to(engine.device)

    @torch.no_grad()
    def logps(
        self,
        batch: dict[str, Any],
        temperature: float,
        policy: SamplingPolicy | None = None,
        tiled: bool | str = False,
    ) -> torch.Tensor:
        """Per-token log-probabilities of the batch's targets ``[rows, tokens]`` (``policy``: under the
        sampler's settings, as the policy's are taken: the two agree before the first update; ``tiled``: as
        ``tiled_loss_compute``, the vocabulary projection a chunk of positions at a time, so a long completion
        never holds its whole logits)."""
        if self.model is not None:
            return token_logps(self.model, batch, tiled, temperature, policy=policy)[0]
        with self.engine.module.disable_adapter():
            return token_logps(self.engine, batch, tiled, temperature, policy=policy)[0]
