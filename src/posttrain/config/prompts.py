"""The prompts an online method samples completions of (``data.type: prompts``, grpo's and distill's): TRL's
layout, a ``prompt`` (a list of messages or plain text) per row, or chat rows (``messages``) ending with a
user turn; every other column is handed to the reward functions. Built by ``data.prompts``."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from posttrain.config.data import PromptedDataConfig


class PromptsDataConfig(PromptedDataConfig):
    """Prompt rows: ``prompt`` as a list of messages or plain text (TRL's layout), or chat rows
    (``messages``) ending with a user turn. Every other column is handed to the reward functions."""

    reward_columns: list[str] = Field(default_factory=list)
    """Columns every row must hold (a row without one is a bad row, reported with its file and row when the
    data is built); the columns the built-in rewards read are added to it."""

    tool_schemas: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    """Filled from ``tools`` and ``environment_factory`` (not set by hand): the tools' JSON schemas each prompt
    is rendered with, by environment name (``""``: every row; otherwise the row's ``environment``)."""

    unsupported: ClassVar[dict[str, str]] = {
        "pack_samples": "prompts are generated from one by one; completions are batched per group",
        "padding_free": (
            "the prompts are not trained on; the completions' micro-batches are joined by the method's own "
            "padding_free (top level, on by default)"
        ),
    }
