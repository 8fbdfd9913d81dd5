"""``harness:`` — lm-evaluation-harness tasks run on the model being trained, every N steps and at the end
(Axolotl's ``lm_eval_tasks`` and ``lm_eval_batch_size``; ``posttrain eval`` runs the same harness on an export).
Pure: the tasks themselves are looked up when the run starts, before the first step."""

from __future__ import annotations

from pydantic import Field, field_validator

from posttrain.config.base import BaseConfig
from posttrain.config.human import HumanFloat, HumanInt


class HarnessConfig(BaseConfig):
    tasks: list[str] = Field(min_length=1)
    """Harness task names (Axolotl's ``lm_eval_tasks``): the harness's own, or local tasks under
    ``include_path``. Results are logged as ``eval/<task>/<metric>``."""

    include_path: str | None = None
    """A directory (or one YAML file) of local task definitions, as ``lm_eval --include_path``."""

    interval: HumanInt = Field(default=0, ge=0)
    """Run the tasks every N optimizer steps (0: only at the end)."""

    at_end: bool = True
    """Run them once more after the last step (the final weights)."""

    limit: HumanFloat | None = Field(default=None, gt=0)
    """At most this many samples per task (a number >= 1), or this share of each task (< 1): the harness's
    ``--limit``. Null: every sample."""

    num_fewshot: HumanInt | None = Field(default=None, ge=0)
    """Few-shot examples per prompt (null: each task's own setting)."""

    batch_size: HumanInt = Field(default=8, ge=1)
    """The harness's batch size (Axolotl's ``lm_eval_batch_size``)."""

    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (the harness's ``--apply_chat_template``)."""

    @field_validator("tasks")
    @classmethod
    def _named(cls, value: list[str]) -> list[str]:
        names = [name.strip() for name in value]
        if any(not name for name in names):
            raise ValueError("an empty task name; name each task (lm-eval ls tasks lists them)")
        return names
