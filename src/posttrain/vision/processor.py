"""The processor of a vision-language model: found from the checkpoint's config, loaded beside the tokenizer
and carried by it (the run hands one tokenizer to every stage; a stage that needs images asks it for its
processor with :func:`processor_of`)."""

from __future__ import annotations

from typing import Any

from posttrain.errors import UserError

#: the tokenizer attribute that carries the processor of a vision-language model
ATTRIBUTE = "posttrain_processor"


def is_vision_language(hf_config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower's config)."""
    return getattr(hf_config, "vision_config", None) is not None


def processor_of(tokenizer: Any) -> Any:
    """The processor the tokenizer carries (None: a text model)."""
    return getattr(tokenizer, ATTRIBUTE, None)


def attach(tokenizer: Any, processor: Any) -> Any:
    """Let ``tokenizer`` (the processor's own) carry ``processor``; the processor's chat template is the
    tokenizer's from here on when the processor has one (TRL renders a VLM's rows with the processor's)."""
    setattr(tokenizer, ATTRIBUTE, processor)
    template = getattr(processor, "chat_template", None)
    if template:
        tokenizer.chat_template = template
    return tokenizer


def image_token(processor: Any) -> tuple[str, int]:
    """The processor's image placeholder token and its id (what the chat template writes per image)."""
    token = getattr(processor, "image_token", None) or "<image>"
    token = getattr(token, "content", token)
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(token)
    return str(token), int(token_id)


def feature_token_id(processor: Any) -> int:
    """The id of the token an image's features replace, one per feature. Most families write it in the
    template too (Idefics3's and LLaVA's ``<image>``); Gemma 3 writes ``<start_of_image>``, which the processor
    expands to that marker, the tokenizer's ``image_token`` once per feature and ``<end_of_image>``."""
    token_id = getattr(processor.tokenizer, "image_token_id", None)
    return image_token(processor)[1] if token_id is None else int(token_id)


def input_only_tokens(tokenizer: Any) -> tuple[int, ...]:
    """The tokens a model only reads (the template's image token and the token the features replace), which
    sampling never draws: none for a text model."""
    processor = processor_of(tokenizer)
    if processor is None:
        return ()
    return tuple(sorted({image_token(processor)[1], feature_token_id(processor)}))


def fingerprint(tokenizer: Any) -> dict[str, Any] | None:
    """What of the processor decides the stored tokens (how many tokens each image expands to), for the
    data cache's key; None: no processor."""
    processor = processor_of(tokenizer)
    if processor is None:
        return None
    images = getattr(processor, "image_processor", None)
    settings = images.to_dict() if images is not None and hasattr(images, "to_dict") else {}
    return {
        "class": type(processor).__name__,
        "image_processor": {k: str(v) for k, v in sorted(settings.items())},
        "image_seq_len": getattr(processor, "image_seq_len", None),
        "patch_size": getattr(processor, "patch_size", None),
    }


def load_processor(name: str, model: Any) -> Any:
    """``AutoProcessor`` from ``name`` when the model (``model:``, a ``ModelConfig``) is a vision-language
    model; None for a text model (or a checkpoint with no transformers config)."""
    from transformers import AutoConfig, AutoProcessor

    from posttrain.utils.hub import load_or_explain

    try:  # through the hub helper: a missing model or an unreachable Hub is one line, at once
        config = load_or_explain(
            "model.name_or_path",
            model.name_or_path,
            lambda: AutoConfig.from_pretrained(
                model.name_or_path, **model.hub_arguments(), **model.hf_config_kwargs
            ),
        )
    except ValueError:  # not a transformers config: the tokenizer's own load says what is wrong
        return None
    except UserError:
        if name == model.name_or_path:  # the tokenizer beside the model would fail the same way: say it now
            raise
        return None  # a model only its own factory reads, its tokenizer elsewhere
    if not is_vision_language(config):
        return None
    key = "tokenizer.name_or_path" if name != model.name_or_path else "model.name_or_path"
    return load_or_explain(key, name, lambda: AutoProcessor.from_pretrained(name, **model.hub_arguments()))


def auto_model_class(hf_config: Any) -> Any:
    """The transformers auto class that builds a checkpoint for training: ``AutoModelForImageTextToText``
    for a vision-language model, ``AutoModelForCausalLM`` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM
