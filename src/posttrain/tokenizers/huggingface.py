"""Tokenizer factory ``huggingface``: ``AutoTokenizer`` from the tokenizer (or model) path, with the chosen
chat template and a pad token. A vision-language model's tokenizer is its processor's, carrying the
processor (``vision.processor``)."""

from __future__ import annotations

from typing import Any

from posttrain.config.tokenizer import TokenizerConfig
from posttrain.context import RunContext
from posttrain.logs import say
from posttrain.tokenizers.chat_templates import apply_chat_template, check_tools_rendered
from posttrain.tokenizers.padding import ensure_pad_token
from posttrain.utils.hub import load_or_explain
from posttrain.vision.processor import attach, load_processor


def build_huggingface_tokenizer(config: TokenizerConfig, ctx: RunContext) -> Any:
    from transformers import AutoTokenizer

    # the model's hub settings (revision, remote code, token) apply to the tokenizer read beside it
    name = config.name_or_path or ctx.config.model.name_or_path
    own = config.name_or_path and config.name_or_path != ctx.config.model.name_or_path
    key = "tokenizer.name_or_path" if own else "model.name_or_path"  # the tokenizer beside the model
    processor = load_processor(name, ctx.config.model)
    tokenizer = (
        attach(processor.tokenizer, processor)
        if processor is not None
        else load_or_explain(
            key, name, lambda: AutoTokenizer.from_pretrained(name, **ctx.config.model.hub_arguments())
        )
    )
    added = apply_chat_template(tokenizer, config.chat_template)
    if added:
        say(f"chat template {config.chat_template}: added special tokens {', '.join(added)}")
    if any((getattr(ctx.config.data, "tool_schemas", None) or {}).values()):  # online, with tools
        check_tools_rendered(tokenizer, "tools / environment_factory give the model tools")
    padding = ensure_pad_token(tokenizer, config.missing_pad_token_strategy)
    if padding:
        say(padding)
    return tokenizer
