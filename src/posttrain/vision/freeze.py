"""What of a vision-language model trains: its vision tower, its projector (the layers that map image
features into the language model's width) and its language model, each frozen or trained by
``model.freeze_vision_tower``, ``model.freeze_multi_modal_projector`` and ``model.freeze_language_model``
(LLaMA-Factory's names and defaults: the tower and the projector frozen, the language model trained).

The parts are found by the names transformers gives them: ``vision_tower`` / ``vision_model`` / ``visual``
for the tower, ``multi_modal_projector`` / ``connector`` / ``visual.merger`` for the projector (Qwen's merger
sits inside its tower), ``language_model`` / ``text_model`` for the language model (its LM head with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import UserError
from posttrain.vision.processor import is_vision_language

if TYPE_CHECKING:
    from posttrain.config.model import ModelConfig
    from posttrain.config.trainer import TrainerConfig

TOWERS = ("vision_tower", "vision_model", "visual")
PROJECTORS = ("multi_modal_projector", "connector", "visual.merger", "mm_projector")
LANGUAGE = ("language_model", "text_model", "lm_head")
#: the ``model:`` keys that say what of a vision-language model is frozen
KEYS = frozenset({"freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model"})


def part_of(name: str) -> str | None:
    """Which part of a VLM a parameter (by its name in the model) belongs to: ``projector``, ``tower``,
    ``language`` or None (none of the known names)."""
    pieces = name.split(".")
    for part, names in (("projector", PROJECTORS), ("tower", TOWERS), ("language", LANGUAGE)):
        for known in names:
            width = known.count(".") + 1
            if any(".".join(pieces[i : i + width]) == known for i in range(len(pieces))):
                return part
    return None


def freeze_transform(
    model: torch.nn.Module, config: TrainerConfig, facts: Any, tokenizer: Any
) -> torch.nn.Module:
    """The model stage's step: freeze the parts the config freezes. On a text model the keys mean nothing:
    one written in the config is refused rather than ignored."""
    hf_config = getattr(model, "config", None)
    written = sorted(KEYS & config.model.model_fields_set)
    if written and (hf_config is None or not is_vision_language(hf_config)):
        raise UserError(
            f"{', '.join('model.' + k for k in written)}: {type(model).__name__} is a text model (no vision "
            "tower or projector), so there is nothing to freeze; remove the key"
        )
    return freeze_parts(model, config.model)


def freeze_parts(model: torch.nn.Module, settings: ModelConfig) -> torch.nn.Module:
    """Freeze the parts of a vision-language model that ``settings`` (``model:``) freezes; the memory plan
    calls it on the model it builds on the meta device, so it counts what trains as the run does."""
    hf_config = getattr(model, "config", None)
    if hf_config is None or not is_vision_language(hf_config):
        return model
    frozen = {
        "tower": settings.freeze_vision_tower,
        "projector": settings.freeze_multi_modal_projector,
        "language": settings.freeze_language_model,
    }
    found = {"tower": 0, "projector": 0, "language": 0}
    for name, parameter in model.named_parameters():
        part = part_of(name)
        if part is None:
            continue
        found[part] += 1
        if frozen[part]:
            parameter.requires_grad_(False)
    missing = [part for part, count in found.items() if not count and part != "projector"]
    if missing:
        raise UserError(
            f"{type(model).__name__}: no parameters named as a vision-language model's "
            f"{' and '.join(missing)} ({', '.join(TOWERS + LANGUAGE)}), so model.freeze_* cannot apply; "
            "this architecture is not supported yet"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(
            "model.freeze_vision_tower, freeze_multi_modal_projector and freeze_language_model freeze the "
            "whole model: nothing would train; set one of them to false"
        )
    return model


def language_adapter_targets(
    model: torch.nn.Module, peft_config: dict[str, Any] | None
) -> dict[str, Any] | None:
    """A LoRA config on a vision-language model targets the language model's linear layers when it names no
    target modules or ``all-linear`` (as LLaMA-Factory and TRL's VLM scripts do): the tower and projector keep
    their frozen weights, and an adapter never lands on the image encoder by accident. A list of names or a
    pattern is kept as written."""
    hf_config = getattr(model, "config", None)
    if peft_config is None or hf_config is None or not is_vision_language(hf_config):
        return peft_config
    if peft_config.get("target_modules") not in (None, "all-linear"):
        return peft_config
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and part_of(name) == "language"
        and not name.endswith("lm_head")
    ]
    return {**peft_config, "target_modules": names}
