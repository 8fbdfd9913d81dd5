"""A LoRA run's weights to vLLM as the adapter alone (the colocated engine and the servers): the engine loads the
base model once from its files (the base never changes in a LoRA run) and takes each update's adapter through
vLLM's own LoRA loading, a few MiB instead of the whole model merged.

Where vLLM cannot serve the adapter (another PEFT method, DoRA, ``modules_to_save``, trained biases, adapters on
the embedding or the head, a rank above vLLM's largest, a quantised base, an adapter loaded from a directory),
the merged push is kept (``named_weights``) and the run says why in one line (:func:`adapter_push`, pure: from
the config alone, so ``posttrain vllm-serve`` starts a server with the same choice)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: vLLM's ``max_lora_rank`` choices
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: PEFT's default LoRA rank
PEFT_DEFAULT_RANK = 8


@dataclass(frozen=True)
class AdapterPush:
    """The run's push: ``rank`` > 0, the adapter alone (vLLM's ``max_lora_rank``); 0, merged weights.
    ``said``: the line that says which (empty for a run without adapters)."""

    rank: int
    said: str = ""


def _targets(values: dict[str, Any]) -> list[str]:
    targets = values.get("target_modules") or []
    return [targets] if isinstance(targets, str) else [str(t) for t in targets]


def adapter_push(config: Any) -> AdapterPush:
    """Whether the run's adapter can go to vLLM alone (see the module docstring)."""
    model = config.model
    if model.peft_config is None and model.peft_pretrained is None:
        return AdapterPush(0)
    if not getattr(config, "vllm_push_adapter", True):
        return AdapterPush(0, "vLLM: LoRA weights pushed merged into the base (vllm_push_adapter: false)")
    values = dict(model.peft_config or {})
    why = []
    if model.peft_pretrained is not None:
        why.append("an adapter loaded from peft_pretrained")
    if str(values.get("peft_type", "LORA")).upper() != "LORA":
        why.append(f"peft_type {values['peft_type']} (vLLM serves LoRA adapters)")
    if values.get("use_dora"):
        why.append("use_dora (vLLM does not serve DoRA)")
    if values.get("modules_to_save"):
        why.append("modules_to_save (vLLM serves adapters without fully trained modules)")
    if values.get("bias", "none") != "none" or values.get("lora_bias"):
        why.append("trained biases (vLLM serves adapters without them)")
    if any(t in ("embed_tokens", "lm_head") or "embed" in t for t in _targets(values) if t != "all-linear"):
        why.append("adapters on the embedding or the head")
    if getattr(config, "vllm_enable_sleep_mode", False):
        why.append("vllm_enable_sleep_mode (the adapter alone under sleep mode is not yet measured on a GPU)")
    if model.quantization_config:
        why.append("a quantised base (vLLM's LoRA on it not yet measured)")
    ranks = [int(values.get("r", PEFT_DEFAULT_RANK)), *map(int, (values.get("rank_pattern") or {}).values())]
    if max(ranks) > LORA_RANKS[-1]:
        why.append(f"rank {max(ranks)} (vLLM serves ranks up to {LORA_RANKS[-1]})")
    if why:
        return AdapterPush(
            0, f"vLLM: LoRA weights pushed merged into the base, not the adapter alone ({'; '.join(why)})"
        )
    rank = next(r for r in LORA_RANKS if r >= max(ranks))
    return AdapterPush(
        rank, f"vLLM: the LoRA adapter alone pushed after each update (vLLM's LoRA, max_lora_rank {rank})"
    )


def engine_lora_kwargs(push: AdapterPush) -> dict[str, Any]:
    """The engine's LoRA arguments for the push (none for a merged one)."""
    if not push.rank:
        return {}
    return {"enable_lora": True, "max_lora_rank": push.rank, "max_loras": 1}


def adapter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained adapter's tensors under PEFT's saved names, on the host, gathered under ZeRO-3 (every rank
    takes part)."""
    from peft import get_peft_model_state_dict

    partitioned = [p for n, p in module.named_parameters() if "lora_" in n and hasattr(p, "ds_id")]
    gathered: Any = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned)
    with gathered:
        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(module).items()}


def save_adapter(module: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """``state`` in PEFT's layout under ``folder`` (``adapter_config.json``, ``adapter_model.safetensors``),
    as vLLM's LoRA loading reads it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    module.peft_config["default"].save_pretrained(str(folder))  # type: ignore[index,union-attr,operator]
    save_file(state, str(folder / "adapter_model.safetensors"))


def write_adapter(module: torch.nn.Module, folder: Path) -> int:
    """The adapter gathered and saved under ``folder``; the bytes of its tensors."""
    state = adapter_state(module)
    save_adapter(module, state, folder)
    return sum(t.numel() * t.element_size() for t in state.values())
