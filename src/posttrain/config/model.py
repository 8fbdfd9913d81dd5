"""``model:`` — which weights to load and how."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from posttrain.config.base import BaseConfig, ModeKeys, Problem
from posttrain.config.fp8 import fp8_problems, recipe_value

DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def canonical_dtype(value: str) -> str:
    key = value.lower().removeprefix("torch.")
    if key == "auto":
        return key
    if key not in DTYPE_ALIASES:
        allowed = ", ".join(sorted(DTYPE_ALIASES))
        raise ValueError(
            f"unknown dtype {value!r}; allowed: auto, {allowed} (optionally prefixed with 'torch.')"
        )
    return DTYPE_ALIASES[key]


class ModelConfig(BaseConfig):
    mode_keys: ClassVar[tuple[ModeKeys, ...]] = (
        ModeKeys(("fp8_filter_fqns",), lambda c, root: c.fp8 is not None, "fp8: a recipe"),
    )
    type: str = ""
    """Model factory type. Defaults to the trainer's first accepted model factory (``huggingface``)."""

    name_or_path: str
    """Hugging Face hub name or local directory of the model to train."""

    dtype: str = "bfloat16"
    """Data type of the model weights: ``float32``/``fp32``, ``bfloat16``/``bf16`` or ``float16``/``fp16``
    (a ``torch.`` prefix is accepted), or ``auto``: the checkpoint's own (``dtype`` in its ``config.json``,
    float32 when it names none). Mixed precision in DeepSpeed follows it."""

    trust_remote_code: bool = False
    """Run the modelling (and tokenizer) code a hub repository ships with its weights. Off by default: that
    code runs with your permissions; turn it on only for repositories you trust."""

    revision: str | None = None
    """Hub revision (branch, tag or commit) of the model and its tokenizer. Null: the default branch. A
    commit hash makes a run reproducible."""

    token_env: str = "HF_TOKEN"
    """Environment variable holding the hub token for gated or private models (read when loading; the token
    itself is never written to the config, logs or checkpoints)."""

    low_cpu_mem_usage: bool = True
    """Load the weights without first building a randomly initialised full-size copy. transformers 5 always
    loads this way, so only ``true`` is accepted."""

    save_name: str | None = None
    """Name to use when saving the model (the export directory's name under the checkpoint's output_dir)."""

    attn_implementation: str = "sdpa"
    """Attention kernel: ``eager``, ``sdpa``, ``flash_attention_2``, ``flash_attention_3`` or ``flex_attention``."""

    disable_activation_checkpoint: bool = False
    """Turn off activation (gradient) checkpointing, which is on by default to save memory."""

    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (the blocks share one compiled graph, so the
    first step costs one block's compilation, not the whole model's; a second compile on the first new
    sequence length makes the lengths dynamic, so variable lengths and packing do not recompile every step).
    Works with ZeRO 0-3, LoRA, packing and activation checkpointing; not with ``sequence_parallel_size`` > 1.
    Needs a C++ compiler on CPU."""

    fp8: str | None = None
    """Run the linear layers' matrix products in float8 with torchao's float8 training (PyTorch's own library:
    ``pip install 'posttrain[fp8]'``), one of its recipes: ``tensorwise`` (one scale per tensor, the
    fastest), ``rowwise`` (one scale per row, closer to bf16), ``rowwise_with_gw_hp`` (rowwise, with the
    weight gradients in high precision). Weights, gradients, optimizer states, checkpoints and exports stay
    in ``dtype``; each layer casts its input and weight to float8 for the product. The LM head, LoRA
    adapters and layers whose sizes are not multiples of 16 stay in high precision (listed in one line at
    start). Pays on GPUs with FP8 matrix units (H100 and later) for models from a few billion parameters,
    best with ``compile``; elsewhere (every CPU) torchao's emulation runs the same numerics, slower. Null:
    off."""

    fp8_filter_fqns: list[str] = []
    """Linear layers to leave in high precision under ``fp8``: a layer whose module name contains one of
    these strings is not converted (torchtitan's ``filter_fqns``). The entry ``auto_filter_small_kn`` also
    leaves out layers too small to gain from FP8 (torchao's size thresholds for the recipe, measured on
    H100s)."""

    experts_implementation: Literal["eager", "grouped_mm", "batched_mm"] | None = None
    """Mixture-of-experts models: transformers' kernel for the experts (``eager``: a loop over the experts;
    ``grouped_mm``: one grouped matrix product, transformers 5's default; ``batched_mm``). Null: transformers'
    choice. The expert-parallel dispatch (``expert_parallel_size``) wraps whichever runs."""

    router_aux_loss_coef: float | None = Field(default=None, ge=0)
    """Mixture-of-experts models: weight of the router's load-balancing loss, added to the training loss and
    reported apart as ``router_aux_loss`` (never part of ``eval_loss``). Null: the model's own
    ``router_aux_loss_coef``; 0 turns the loss off (the expert load is still logged). Refused for dense
    models."""

    peft_config: dict[str, Any] | None = None
    """Parameter-efficient fine-tuning: any PEFT config as a dict, ``peft_type`` (default ``LORA``) plus its
    fields, e.g. ``{r: 16, lora_alpha: 32, lora_dropout: 0.05, target_modules: all-linear}``;
    ``use_rslora: true`` for rsLoRA, ``use_dora: true`` for DoRA. Only the adapter is trained."""

    peft_pretrained: str | None = None
    """Directory of a saved PEFT adapter to load and continue training (SiloGen's ``PRETRAINED_PEFT``)."""

    hf_config_kwargs: dict[str, Any] = {}
    """Overrides of the checkpoint's ``config.json`` (``AutoConfig.from_pretrained`` keyword arguments), e.g.
    ``{max_position_embeddings: 65536, rope_scaling: {...}}``, applied before the model is built."""

    quantization_config: dict[str, Any] | None = None
    """Load the base model quantised through bitsandbytes for QLoRA (SiloGen's ``quant_conf``), e.g.
    ``{load_in_4bit: true, bnb_4bit_quant_type: nf4}``: ``transformers.BitsAndBytesConfig`` arguments.
    Needs a CUDA GPU."""

    freeze_vision_tower: bool = True
    """A vision-language model's vision tower (the image encoder) is not trained (LLaMA-Factory's name and
    default). Refused on a text model."""

    freeze_multi_modal_projector: bool = True
    """A vision-language model's projector (the layers that map image features into the language model) is
    not trained (LLaMA-Factory's name and default). Refused on a text model."""

    freeze_language_model: bool = False
    """A vision-language model's language model (its LM head included) is not trained: with the tower and
    projector trained, only the image side learns (LLaMA-Factory's name and default). Refused on a text
    model."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return canonical_dtype(value) if isinstance(value, str) else value

    @field_validator("fp8", mode="before")
    @classmethod
    def _fp8(cls, value: Any) -> Any:
        return recipe_value(value)

    @field_validator("attn_implementation")
    @classmethod
    def _attn(cls, value: str) -> str:
        if value not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attention implementation {value!r}; allowed: {', '.join(ATTN_IMPLEMENTATIONS)}"
            )
        return value

    @field_validator("peft_config")
    @classmethod
    def _peft(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from posttrain.config.peft import peft_config_from_dict

            peft_config_from_dict(value)  # builds PEFT's own config object: checks keys and values
        return value

    @field_validator("quantization_config")
    @classmethod
    def _quantization(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        import inspect

        from transformers import BitsAndBytesConfig

        accepted = set(inspect.signature(BitsAndBytesConfig.__init__).parameters) - {"self", "kwargs"}
        unknown = sorted(set(value) - accepted)
        if unknown:
            import difflib

            hints = [difflib.get_close_matches(key, sorted(accepted), n=1) for key in unknown]
            named = ", ".join(
                f"{key}" + (f" (did you mean {h[0]}?)" if h else "")
                for key, h in zip(unknown, hints, strict=True)
            )
            raise ValueError(f"unknown BitsAndBytesConfig argument {named}")
        return value

    def hub_arguments(self) -> dict[str, Any]:
        """Keyword arguments of every ``from_pretrained`` call for this model (config, weights, tokenizer)."""
        import os

        arguments: dict[str, Any] = {"trust_remote_code": self.trust_remote_code}
        if self.revision is not None:
            arguments["revision"] = self.revision
        token = os.environ.get(self.token_env) if self.token_env else None
        if token:
            arguments["token"] = token
        return arguments

    def problems(self) -> Iterator[Problem]:
        if not self.low_cpu_mem_usage:
            yield Problem(
                "low_cpu_mem_usage",
                "false cannot be honoured: transformers 5 always loads weights without a random full-size "
                "copy; remove the key",
            )
        if self.peft_config is not None and self.peft_pretrained is not None:
            yield Problem(
                "peft_pretrained", "set peft_config (new adapters) or peft_pretrained (a saved one), not both"
            )
        yield from fp8_problems(self)
        if self.quantization_config is not None and self.peft_config is None and self.peft_pretrained is None:
            yield Problem(
                "quantization_config",
                "a quantised base model cannot be trained directly; add peft_config (QLoRA)",
            )
