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
    the student's vocabulary (checked before any model loads)."""

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
        """The teacher's vocabulary (its ``config.json``) must be the student's: the divergence compares their
        next-token distributions token by token."""
        from transformers import AutoConfig

        teacher = self.teacher
        try:
            found = AutoConfig.from_pretrained(
                teacher.name_or_path, trust_remote_code=teacher.trust_remote_code
            )
        except (OSError, ValueError) as error:
            yield Problem(
                "teacher_model_name_or_path", f"{teacher.name_or_path}: cannot read its config ({error})"
            )
            return
        text = found.get_text_config() if hasattr(found, "get_text_config") else found
        vocab = getattr(text, "vocab_size", None)
        if facts.vocab_size and vocab and int(vocab) != int(facts.vocab_size):
            yield Problem(
                "teacher_model_name_or_path",
                f"{self.teacher_model_name_or_path} has a vocabulary of {vocab} tokens and the student "
                f"({self.model.name_or_path}) {facts.vocab_size}: distillation compares their next-token "
                "distributions token by token; use a teacher from the student's family (the same tokenizer)",
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
