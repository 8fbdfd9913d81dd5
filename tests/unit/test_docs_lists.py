"""Lists of choices the docs type beside a list the code has stay whole: a run of choices joined by ``|`` in
README or docs/ (``sft|dpo|...`` in a command line, ``chatml | llama3 | ...`` in a YAML comment, wrapped
over comment lines) that names at least three members of one of the code's lists names every member. The
lists: the chat-template presets, the starters, the trainers, the reward types, the tool-call formats, the
pad-token strategies."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {"reference.md", "commands.md"}  # made from the code itself


def code_lists() -> dict[str, set[str]]:
    from posttrain.builtins import TRAINER_SPECS
    from posttrain.config.online import OnlineTrainerConfig
    from posttrain.config.rewards import Reward
    from posttrain.config.tokenizer import TokenizerConfig
    from posttrain.starters import STARTERS
    from posttrain.tiny_model import ARCHITECTURES
    from posttrain.tokenizers.chat_templates import PRESETS
    from posttrain.vision.tiny import VISION_ARCHITECTURES

    def literal(model: type, field: str) -> set[str]:
        return set(typing.get_args(model.model_fields[field].annotation))

    entries = typing.get_args(typing.get_args(Reward)[0])
    reward_types = {typing.get_args(c.model_fields["type"].annotation)[0] for c in entries}
    return {
        "chat-template presets": set(PRESETS),
        "trainers": {spec.name for spec, _ in TRAINER_SPECS},
        "reward types": reward_types,
        "tool-call formats": literal(OnlineTrainerConfig, "tool_call_format") - {"auto"},
        "pad-token strategies": literal(TokenizerConfig, "missing_pad_token_strategy"),
        "starters": set(STARTERS),
        "tiny-model architectures": {*ARCHITECTURES, *VISION_ARCHITECTURES},
    }


CHOICE = r"[`\\]*[\w.-]+[`\\]*"
CHOICES = re.compile(rf"{CHOICE}(?:\s*\\?\|\s*{CHOICE}){{2,}}")


def choice_lists(text: str) -> list[tuple[str, set[str]]]:
    """Each run of ``|``-joined choices (comment lines continued with ``# |`` joined first) and its words."""
    joined = re.sub(r"\n\s*#\s*(?=\|)", " ", text)
    return [(m.group(0), set(re.findall(r"[\w.-]+", m.group(0)))) for m in CHOICES.finditer(joined)]


@pytest.mark.parametrize("name", sorted(code_lists()))
def test_a_typed_list_names_every_member(name: str) -> None:
    members = code_lists()[name]
    short = []
    for page in PAGES:
        if page.name in GENERATED:
            continue
        for found, words in choice_lists(page.read_text()):
            named = members & words
            if len(named) >= 3 and named != members:
                short.append(f"{page.name}: {found[:100]} lacks {sorted(members - named)}")
    assert not short, f"lists of the {name} that miss members:\n" + "\n".join(short)
