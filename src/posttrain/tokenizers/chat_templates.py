"""Chat-template presets and how a tokenizer gets its template.

Every preset marks what the assistant says with ``{% generation %}`` (its end-of-turn token included), so
labels come from the template's own assistant mask. The presets are posttrain's own renderings of the
formats they are named after. Templates are written as single-line expression chains because HF's Jinja
environment trims the newline after a block tag.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import UserError


@dataclass(frozen=True)
class Preset:
    template: str
    special_tokens: tuple[str, ...]  # must be single tokens; added to the tokenizer when missing
    end_of_turn: str | None  # None: the tokenizer's EOS


_CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ChatML with tools, Hermes / Qwen style, compact for small models: each tool as one line, its name, argument
# names and description, in a system turn (after the conversation's own system message); an assistant's tool
# calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> inside its trained turn; a tool's result as a
# turn of role tool.
_HERMES = (
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% set ns.start = 1 %}{% endif %}"
    "{% for tool in tools %}{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ 'tool ' + f['name'] + '(' + (f.get('parameters', {}).get('properties', {}) | list | join(', ')) + '): ' + f.get('description', '') + '\\n' }}"
    '{% endfor %}{{ \'call tools as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson + '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Mistral's [INST] format with a system message folded into the next user turn.
_MISTRAL_WITH_SYSTEM = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{% set ns.system = '' %}"
    "{% endif %}{% endfor %}"
)

# SiloGen's poro: each turn is its role tag, a newline, the content and EOS
_PORO = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

PRESETS: dict[str, Preset] = {
    "chatml": Preset(_CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "hermes": Preset(_HERMES, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "llama3": Preset(_LLAMA3, _LLAMA3_TOKENS, "<|eot_id|>"),
    # Llama 3.1's turn format without its date header and tool calls: the same rendering as llama3.
    "simplified-llama31": Preset(_LLAMA3, _LLAMA3_TOKENS, "<|eot_id|>"),
    "mistral-with-system": Preset(_MISTRAL_WITH_SYSTEM, (), None),
    "poro": Preset(_PORO, ("<|user|>", "<|assistant|>"), None),
}
ALIASES = {"chat-ml": "chatml"}
KEEP_ORIGINAL = "keep-original"
CHOICES = (KEEP_ORIGINAL, *PRESETS, *ALIASES)

#: end-of-turn tokens recognised in any tokenizer (besides its EOS)
KNOWN_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<end_of_utterance>",  # Idefics3 / SmolVLM
)


def check_choice(value: str) -> str:
    """Config-time check (no file is opened): a preset name or a path ending in ``.jinja``."""
    if value in CHOICES or value.endswith(".jinja"):
        return value
    raise ValueError(
        f"unknown chat template {value!r}; allowed: {', '.join(CHOICES)}, or a path to a .jinja file"
    )


def apply_chat_template(tokenizer: Any, choice: str) -> list[str]:
    """Give ``tokenizer`` the chosen template; returns the special tokens that had to be added (the model's
    embeddings must then be resized)."""
    choice = ALIASES.get(choice, choice)
    if choice == KEEP_ORIGINAL:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "the tokenizer has no chat template; set tokenizer.chat_template to a preset "
                f"({', '.join(PRESETS)}) or a .jinja file"
            )
        return []
    if choice.endswith(".jinja"):
        path = Path(choice).expanduser()
        if not path.is_file():
            raise UserError(f"tokenizer.chat_template: no such file {choice!r}")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
        return []
    preset = PRESETS[choice]
    vocab = tokenizer.get_vocab()
    missing = [token for token in preset.special_tokens if token not in vocab]
    if missing:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": missing}, replace_extra_special_tokens=False
        )
    tokenizer.chat_template = preset.template
    return missing


#: a tool's schema whose name a template that renders tools writes into the prompt
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "posttrain_probe_tool",
        "description": "Probe whether a chat template renders tools.",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer", "description": "a number"}},
            "required": ["x"],
        },
    },
}


@functools.lru_cache(maxsize=16)
def template_renders_tools(template: str, special: tuple[tuple[str, str], ...] = ()) -> bool:
    """Whether a chat template writes the tools it is given into the prompt (many base models' templates
    ignore ``tools``: the model would never see them)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "hello"}]],
        tools=[_PROBE_TOOL],
        chat_template=template,
        add_generation_prompt=True,
        **dict(special),
    )
    return "posttrain_probe_tool" in rendered[0]


def tool_presets() -> list[str]:
    """The presets that render tools (read from the templates themselves)."""
    return [name for name, preset in PRESETS.items() if template_renders_tools(preset.template, _SPECIAL)]


_SPECIAL = (("bos_token", ""), ("eos_token", ""))


def check_tools_rendered(tokenizer: Any, what: str) -> None:
    """Refuse, in one line, a tokenizer whose chat template drops the tools ``what`` gives it."""
    template = tokenizer.get_chat_template()
    special = tuple(sorted((k, v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)))
    if template_renders_tools(template, special):
        return
    presets = " or ".join(tool_presets())
    raise UserError(
        f"{what}, but the chat template of {tokenizer.name_or_path} does not render tools: its prompts would show "
        f"the model none of them. Set tokenizer.chat_template: {presets} (presets that render them), or a .jinja "
        "file of a template that does"
    )


def end_of_turn_ids(tokenizer: Any) -> frozenset[int]:
    """Token ids that may close an assistant turn: EOS and the known end-of-turn tokens in the vocabulary.
    A few id lookups (no vocabulary copy), cheap enough to run for every row."""
    found = tokenizer.convert_tokens_to_ids(list(KNOWN_END_OF_TURN))
    unknown = tokenizer.unk_token_id  # what a missing token maps to when the tokenizer has an UNK token
    ids = {i for i in found if i is not None and i != unknown}
    eos = tokenizer.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)
