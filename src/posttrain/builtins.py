"""Import the built-in components so their registrations run (one import, explicit list)."""

from __future__ import annotations


def register_builtins() -> None:
    import posttrain.checkpoint.deepspeed
    import posttrain.checkpoint.huggingface
    import posttrain.data.megatron
    import posttrain.data.sources
    import posttrain.methods.causal
    import posttrain.methods.dpo
    import posttrain.methods.sft
    import posttrain.models.huggingface
    import posttrain.models.liger
    import posttrain.optim.adamw
    import posttrain.optim.deepspeed_adam
    import posttrain.optim.megatron
    import posttrain.optim.schedulers
    import posttrain.tokenizers.huggingface  # noqa: F401
