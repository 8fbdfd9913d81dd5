"""On-policy distillation (``type: distill``) on tiny models: a 3-layer teacher of width 128 and a 2-layer student
of width 64 with the same tokenizer. The student moves toward the teacher (held-out divergence falls), the step
records carry TRL's names, a SIGKILL resumes exactly, two processes give the one-process records, a teacher
with another tokenizer stops the run in one line, and a padded teacher head is sliced to the shared rows."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.testing.env import child_env
from tests.grpo_helpers import distill_config, write_prompts
from tests.resume_helpers import assert_same_continuation, cli, kill_and_resume, last_metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("distill")
    config = distill_config(
        root,
        write_prompts(root / "train.jsonl", 64),
        scheduler={"name": "constant", "warmup_ratio": 0},
        completions_log_interval=1,
    )
    return {"root": root, "config": config, "eval": write_prompts(root / "eval.jsonl", 8, seed=1)}


def test_the_student_moves_toward_the_teacher_and_logs_trls_names(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    config = copy.deepcopy(setup["config"])
    config["data"]["eval_sources"] = [str(setup["eval"])]
    config.update(
        train_iters=8, eval_interval=8, eval_on_start=True, logger={"output_dir": str(tmp_path / "run")}
    )
    done = cli(config, tmp_path / "run.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distill: teacher" in done.stdout + done.stderr
    records = last_metrics(tmp_path / "run")
    start, end = records[0]["eval_divergence"], records[8]["eval_divergence"]
    assert end < 0.8 * start, (start, end)
    step = records[4]
    for name in (
        "loss",
        "entropy",
        "teacher_entropy",
        "completions/mean_length",
        "completions/clipped_ratio",
    ):
        assert name in step, name
    assert step["teacher_entropy"] > 0 and step["entropy"] > 0
    assert (tmp_path / "run" / "completions.jsonl").read_text().count(
        "\n"
    ) == 8 * 16  # every batch, one process


@pytest.mark.slow  # make test-slow (CI runs it)
def test_a_killed_run_resumes_exactly(setup: dict[str, Any], tmp_path: Path) -> None:
    results = kill_and_resume(setup["config"], tmp_path, nproc=1, kill_at=2, total=4)
    assert_same_continuation(results, 2, 4)


@pytest.mark.slow  # make test-slow (CI runs it)
@pytest.mark.distributed
def test_two_processes_give_the_one_process_records(setup: dict[str, Any], tmp_path: Path) -> None:
    runs = {}
    for nproc, accumulation in ((1, 2), (2, 1)):
        config = copy.deepcopy(setup["config"])
        out = tmp_path / f"p{nproc}"
        config.update(
            train_iters=3, gradient_accumulation_steps=accumulation, logger={"output_dir": str(out)}
        )
        done = cli(config, tmp_path / f"p{nproc}.yaml", nproc=nproc)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[nproc] = last_metrics(out)
    for step in (1, 2, 3):
        for name in ("loss", "entropy", "completions/mean_length"):
            assert runs[2][step][name] == pytest.approx(runs[1][step][name], abs=1e-6), (step, name)
    # ZeRO-3 on two processes: student and teacher partitioned; the first step's loss and gradient are the same
    config = copy.deepcopy(setup["config"])
    config.update(
        train_iters=1,
        gradient_accumulation_steps=1,
        deepspeed={"zero_optimization": {"stage": 3}},
        logger={"output_dir": str(tmp_path / "z3")},
    )
    done = cli(config, tmp_path / "z3.yaml", nproc=2)
    assert done.returncode == 0 and "teacher: partitioned by ZeRO-3" in done.stdout + done.stderr, (
        done.stderr[-3000:]
    )
    first = last_metrics(tmp_path / "z3")[1]
    assert (first["loss"], first["grad_norm"]) == pytest.approx(
        (runs[1][1]["loss"], runs[1][1]["grad_norm"]), rel=1e-5
    )


def test_a_teacher_with_another_tokenizer_is_refused(setup: dict[str, Any], tmp_path: Path) -> None:
    """Another tokenizer of the same size (276 of its 1,024 ids agree) and one of another size are refused by
    validate and by train, in one line naming both models, before anything trains."""
    from posttrain.tiny_model import write_tiny_model

    same_size = write_tiny_model(
        tmp_path / "same", seed=1, hidden_size=64, layers=1, vocab_size=1024, heads=2
    )
    bigger = write_tiny_model(tmp_path / "bigger", seed=0, hidden_size=64, layers=1, vocab_size=2048, heads=2)
    student = setup["config"]["model"]["name_or_path"]
    for other in (same_size, bigger):
        config = copy.deepcopy(setup["config"])
        config.update(
            teacher_model_name_or_path=str(other), train_iters=1, logger={"output_dir": str(tmp_path / "x")}
        )
        path = tmp_path / f"{other.name}.yaml"
        done = cli(config, path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        said = f"teacher_model_name_or_path: {other} has another tokenizer than the student ({student}): "
        assert said in done.stderr, done.stderr[-2000:]
        checked = subprocess.run(
            [sys.executable, "-m", "posttrain", "validate", str(path)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )  # validation refuses it too
        assert checked.returncode == 2 and said in checked.stderr, checked.stderr
        if other == same_size:
            assert "276 of the student's 1,024 ids name the same token in the teacher's 1,024" in done.stderr


def test_a_padded_teacher_head_is_sliced_to_the_shared_vocabulary(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    """The teacher with 64 padding rows added to its head (as Qwen2.5-7B's beside 0.5B's) trains exactly as the
    teacher without them: the divergence compares the rows both heads have, and says so."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    teacher = Path(setup["config"]["teacher_model_name_or_path"])
    padded = tmp_path / "padded"
    model = AutoModelForCausalLM.from_pretrained(teacher)
    model.resize_token_embeddings(model.config.vocab_size + 64, mean_resizing=False)
    torch.manual_seed(3)
    model.get_output_embeddings().weight.data[-64:].normal_(0, 5.0)  # rows that would move the divergence
    model.save_pretrained(padded)
    for file in teacher.iterdir():
        if "token" in file.name:
            shutil.copy(file, padded / file.name)
    runs = {}
    for name, path in (("plain", teacher), ("padded", padded)):
        config = copy.deepcopy(setup["config"])
        config.update(
            teacher_model_name_or_path=str(path), train_iters=2, logger={"output_dir": str(tmp_path / name)}
        )
        done = cli(config, tmp_path / f"{name}.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = last_metrics(tmp_path / name)
        if name == "padded":
            assert "the teacher's LM head has 1,088 rows and the student's 1,024" in done.stdout + done.stderr
    for step in (1, 2):
        for key in ("loss", "teacher_entropy", "grad_norm"):
            assert runs["padded"][step][key] == pytest.approx(runs["plain"][step][key], rel=1e-6), (step, key)


def test_gkd_mixes_the_datas_and_the_teachers_completions_in(setup: dict[str, Any], tmp_path: Path) -> None:
    """lmbda < 1: some batches train on the data's completions (or, with seq_kd, the teacher's), drawn per
    batch from the seed; a row without a completion stops the run in one line naming it."""
    import json

    rows = [json.loads(line) for line in (setup["root"] / "train.jsonl").read_text().splitlines()]
    with_answers = tmp_path / "completions.jsonl"
    with_answers.write_text(
        "".join(
            json.dumps({**r, "completion": [{"role": "assistant", "content": r["answer"]}]}) + "\n"
            for r in rows
        )
    )
    seen = {}
    for name, changes, data in (
        ("data", {"lmbda": 0.5}, with_answers),
        ("teacher", {"lmbda": 0.5, "seq_kd": True}, setup["root"] / "train.jsonl"),
    ):
        config = copy.deepcopy(setup["config"])
        config["data"]["sources"] = [str(data)]
        config.update(changes, train_iters=4, logger={"output_dir": str(tmp_path / name)})
        done = cli(config, tmp_path / f"{name}.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        seen[name] = last_metrics(tmp_path / name)
    for records in seen.values():
        assert {records[step]["on_policy"] for step in (1, 2, 3, 4)} == {0.0, 1.0}  # this seed mixes both
        assert all(math.isfinite(records[step]["loss"]) for step in (1, 2, 3, 4))
    off = next(step for step in (1, 2, 3, 4) if seen["data"][step]["on_policy"] == 0.0)
    assert seen["data"][off]["completions/clipped_ratio"] == 0.0  # the answers end within the limit
    config = copy.deepcopy(setup["config"])
    config.update(lmbda=0.0, train_iters=1, logger={"output_dir": str(tmp_path / "missing")})
    done = cli(config, tmp_path / "missing.yaml")
    assert done.returncode == 2 and "has no 'completion'" in done.stderr, done.stderr[-3000:]


def test_zero3_gives_the_unpartitioned_losses(setup: dict[str, Any], tmp_path: Path) -> None:
    """Under ZeRO-3 the student's head is gathered for the divergence computed inside it (and its backward)."""
    losses = {}
    for stage in (0, 3):
        config = copy.deepcopy(setup["config"])
        config.update(
            train_iters=1,
            deepspeed={"zero_optimization": {"stage": stage}},
            logger={"output_dir": str(tmp_path / f"z{stage}")},
        )
        done = cli(config, tmp_path / f"z{stage}.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("teacher: partitioned by ZeRO-3" in done.stdout + done.stderr) == (stage == 3)
        first = last_metrics(tmp_path / f"z{stage}")[1]
        losses[stage] = (first["loss"], first["grad_norm"])  # the same weights: the forward and the backward
    assert losses[3] == pytest.approx(losses[0], rel=1e-5)
