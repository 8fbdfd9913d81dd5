"""Every check of sequence parallelism in one place: the pure ones on the config (run at validation) and the
ones that need the model's facts (run when the model's config is known, before any weight is read)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from posttrain.config.base import Problem
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.config.trainer import TrainerConfig
    from posttrain.models.facts import ModelFacts

#: attention implementations Ulysses can wrap (eager needs the full 4-D mask)
SP_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def config_problems(config: TrainerConfig) -> Iterator[Problem]:
    """Settings that cannot run with ``sequence_parallel_size`` > 1."""
    sp = config.sequence_parallel_size
    if sp == 1:
        return
    if config.model.attn_implementation == "eager":
        yield Problem(
            "model.attn_implementation",
            f"eager cannot run with sequence_parallel_size={sp} (it needs the whole attention mask); "
            "use sdpa or flash_attention_2",
        )
    if config.data.padding_free:
        yield Problem(
            "data.padding_free",
            f"true cannot run with sequence_parallel_size={sp} yet; use pack_samples: true (packed rows "
            "are split over the sequence-parallel processes) or padding_free: false",
        )
    if config.model.compile:
        yield Problem(
            "model.compile",
            f"true cannot run with sequence_parallel_size={sp} yet (the split attention's collectives "
            "are not compiled); set model.compile: false or sequence_parallel_size: 1",
        )


def check_model(sp: int, facts: ModelFacts | None, attention: str) -> None:
    """What the model's heads allow (``plan.data_parallel_size`` checks the world size)."""
    if sp == 1:
        return
    problems = []
    if attention not in SP_ATTENTION:
        problems.append(
            f"model.attn_implementation={attention} cannot run with sequence parallelism; use one of "
            + ", ".join(SP_ATTENTION)
        )
    if facts is not None and facts.attention_heads and facts.attention_heads % sp:
        problems.append(
            f"{facts.architecture} has {facts.attention_heads} attention heads, not divisible by "
            f"sequence_parallel_size={sp}; use a divisor of {facts.attention_heads}"
        )
    kv = facts.kv_heads if facts is not None else None
    if kv and kv % sp and sp % kv:
        problems.append(
            f"{facts.architecture if facts else 'the model'} has {kv} key/value heads; "
            f"sequence_parallel_size={sp} must divide it or be a multiple of it"
        )
    if facts is not None and facts.vision:
        problems.append(
            f"{facts.architecture} is a vision-language model: sequence parallelism does not split its image "
            "tokens from their pixels yet; set sequence_parallel_size: 1"
        )
    if problems:
        raise UserError("; ".join(problems))
