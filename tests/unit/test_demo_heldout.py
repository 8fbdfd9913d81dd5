"""The demos' held-out sets hold nothing trained on: the shipped example data, the agent demo's drawn pairs,
and the check itself catching a shared question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.testing import tool_task
from posttrain.testing.heldout import check_disjoint

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def test_the_shipped_held_out_sets_are_disjoint_from_their_training_sets() -> None:
    assert "none among" in check_disjoint(DATA / "reverse-eval.jsonl", [DATA / "reverse-train.jsonl"])
    check_disjoint(
        DATA / "reverse-prompts-eval.jsonl", [DATA / "reverse-train.jsonl", DATA / "reverse-prompts.jsonl"]
    )
    check_disjoint(DATA / "prefs-eval.jsonl", [DATA / "prefs-train.jsonl"])
    check_disjoint(DATA / "reward-eval.jsonl", [DATA / "reward-train.jsonl"])


def test_the_agent_demos_pairs_are_distinct_and_a_shared_question_is_caught(tmp_path: Path) -> None:
    taught, asked, kept = tool_task.distinct_pairs([2000, 512, 64], seed=0)
    unordered = [{frozenset(p) if p[0] != p[1] else p for p in s} for s in (taught, asked, kept)]
    assert sum(len(s) for s in unordered) == 2000 + 512 + 64  # no pair twice, in either order
    held = tool_task.write_rows(tmp_path / "held.jsonl", [tool_task.prompt_row(a, b) for a, b in kept])
    train = tool_task.write_rows(
        tmp_path / "sft.jsonl", [tool_task.tool_call_row(a, b) for a, b in taught[:50]]
    )
    assert "none among the 50" in check_disjoint(held, [train])
    leaked = tmp_path / "leaked.jsonl"
    leaked.write_text(train.read_text() + json.dumps(tool_task.direct_row(*kept[3])) + "\n")
    with pytest.raises(SystemExit, match="1 of its 64 held-out questions are in the training sets"):
        check_disjoint(held, [leaked])
