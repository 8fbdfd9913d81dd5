"""Config of the ``distill`` trainer (on-policy distillation: the student samples, the teacher scores every token),
named as TRL 1.16's ``DistillationConfig``: ``teacher_model_name_or_path``, ``teacher_model_init_kwargs``,
``beta`` (the divergence), ``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``use_vllm``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import Field

from posttrain.config.base import Problem
from posttrain.config.human import HumanFloat, HumanInt
from posttrain.config.model import ModelConfig
from posttrain.config.online import OnlineTrainerConfig

#: ``teacher_model_init_kwargs`` posttrain passes on (``from_pretrained`` arguments it has a key for)
TEACHER_KWARGS = {
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "attn_implementation": "attn_implementation",
    "revision": "revision",
    "trust_remote_code": "trust_remote_code",
}


class DistillTrainerConfig(OnlineTrainerConfig):
    type: str = "distill"
    """Trainer type."""

    teacher_model_name_or_path: str
    """TRL's name: the teacher (a local directory or a hub name), loaded frozen beside the student. It must share
    the student's tokenizer (compared token by token before any model loads; a head padded to another size is
    sliced to the rows both heads have)."""

    teacher_model_init_kwargs: dict[str, Any] | None = None
    """TRL's name: how the teacher is loaded (``dtype``, ``attn_implementation``, ``revision``,
    ``trust_remote_code``). Its dtype defaults to the student's ``model.dtype``."""

    beta: HumanFloat = Field(default=1.0, ge=0.0, le=1.0)
    """TRL's name and default: the divergence of the generalized Jensen-Shannon loss per completion token: 0 the
    forward KL(teacher || student), 1 the reverse KL(student || teacher), between them the JSD of the mixture
    (1 - beta) student + beta teacher."""

    lmbda: HumanFloat = Field(default=1.0, ge=0.0, le=1.0)
    """GKD's name: the share of batches trained on the student's own completions, each batch drawn from the
    seed (the same on every process and after a resume); the other batches train on the data's completions
    (a ``completion`` column: text, or an assistant message) or, with ``seq_kd``, on the teacher's. 1 (the
    default): always on-policy, as TRL's DistillationTrainer; GKD's default is 0.5."""

    seq_kd: bool = False
    """GKD's name: the batches that are not on-policy train on completions the teacher samples (sequence-level
    KD) instead of the data's."""

    max_completion_length: HumanInt = Field(default=512, gt=0)
    """Longest completion the student samples, in tokens (TRL's default 512)."""

    @property
    def teacher(self) -> ModelConfig:
        """The teacher as a model config: its path, the init arguments posttrain has keys for, the student's
        dtype unless they name one."""
        values: dict[str, Any] = {"name_or_path": self.teacher_model_name_or_path, "dtype": self.model.dtype}
        for key, value in (self.teacher_model_init_kwargs or {}).items():
            if key in TEACHER_KWARGS:
                values[TEACHER_KWARGS[key]] = value
        return ModelConfig.model_validate(values)

    def model_problems(self, facts: Any) -> Iterator[Problem]:
        """The teacher must read text as the student does: the same tokenizer (token -> id), and an LM head
        covering it (a padded head, as Qwen2.5-7B's 152,064 rows beside 0.5B's 151,936, is sliced to the
        rows both have); the divergence compares their next-token distributions id by id."""
        from transformers import AutoConfig, AutoTokenizer

        teacher, student = self.teacher, self.tokenizer.name_or_path or self.model.name_or_path
        where = "teacher_model_name_or_path"
        try:
            found = AutoConfig.from_pretrained(
                teacher.name_or_path, trust_remote_code=teacher.trust_remote_code
            )
            theirs = AutoTokenizer.from_pretrained(
                teacher.name_or_path, trust_remote_code=teacher.trust_remote_code
            )
        except (OSError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            yield Problem(
                where,
                f"{teacher.name_or_path}: cannot read its config and tokenizer ({first}); distillation checks "
                "the teacher reads text as the student does",
            )
            return
        try:
            ours = AutoTokenizer.from_pretrained(student, trust_remote_code=self.model.trust_remote_code)
        except (OSError, ValueError):
            return  # the run's tokenizer stage says what is wrong with the student's
        mismatch = tokenizer_mismatch(ours.get_vocab(), theirs.get_vocab())
        if mismatch:
            yield Problem(
                where,
                f"{teacher.name_or_path} has another tokenizer than the student ({student}): {mismatch}; "
                "distillation compares the two models' next-token distributions id by id, so the teacher "
                "must share the student's tokenizer (a model of its family)",
            )
            return
        text = found.get_text_config() if hasattr(found, "get_text_config") else found
        rows = [int(v) for v in (getattr(text, "vocab_size", None), facts.vocab_size) if v]
        if rows and min(rows) < len(ours):
            yield Problem(
                where,
                f"the LM heads have {' and '.join(f'{r:,}' for r in rows)} rows (teacher, student), fewer than "
                f"the {len(ours):,} tokens of their tokenizer: a head must score every token",
            )

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        unknown = sorted(set(self.teacher_model_init_kwargs or {}) - set(TEACHER_KWARGS))
        if unknown:
            yield Problem(
                "teacher_model_init_kwargs",
                f"{', '.join(unknown)}: not taken; posttrain loads the teacher with {', '.join(sorted(TEACHER_KWARGS))}",
            )
        else:
            try:
                self.teacher  # noqa: B018 - its validation
            except ValueError as error:
                yield Problem("teacher_model_init_kwargs", str(error).splitlines()[0])


def tokenizer_mismatch(student: dict[str, int], teacher: dict[str, int]) -> str:
    """How two vocabularies (token -> id) differ, for a message; "" when they are the same."""
    if student == teacher:
        return ""
    by_id = {i: t for t, i in teacher.items()}
    agree = sum(by_id.get(i) == t for t, i in student.items())
    differing = sorted((i, t) for t, i in student.items() if by_id.get(i) != t)
    example = ""
    if differing:
        i, token = differing[0]
        other = by_id.get(i)
        example = f" (id {i} is {token!r} to the student, {'no token' if other is None else repr(other)} to the teacher)"
    return (
        f"{agree:,} of the student's {len(student):,} ids name the same token in the teacher's "
        f"{len(teacher):,}{example}"
    )
