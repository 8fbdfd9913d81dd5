"""grpo's dynamic sampling on two processes: the batches (and so every record) are the one-process run's,
and a run SIGKILLed in the middle of a refill round resumes from its checkpoint with the uninterrupted
records."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.dynamic_sampling_helpers import dynamic_config, write_mixed
from tests.resume_helpers import cli, last_metrics

pytestmark = pytest.mark.distributed
KEYS = ("reward", "num_tokens", "dynamic_sampling/generation_rounds", "dynamic_sampling/filtered_groups")


@pytest.mark.slow  # make test-slow (CI runs it)
def test_two_processes_give_one_processs_batches_and_a_kill_mid_refill_resumes_exactly(
    base_config: dict, tmp_path: Path
) -> None:
    files = write_mixed(tmp_path)
    base = dynamic_config(base_config, files, train_iters=4, micro_batch_size=8)

    def run(name: str, nproc: int, **changes: object) -> int:
        config = copy.deepcopy(base)
        config.update(logger={"output_dir": str(tmp_path / name)}, **changes)
        if nproc == 1:
            config["micro_batch_size"] = 16
        return cli(config, tmp_path / f"{name}.yaml", nproc).returncode

    assert run("one", 1) == 0
    checkpoint = {
        "type": "deepspeed",
        "output_dir": str(tmp_path / "ckpt"),
        "auto_resume": True,
        "save_every_n_steps": 1,
    }
    (files["reward"].with_name("die_at")).write_text("2")  # the reward kills its process in step 3's refill
    assert run("two", 2, checkpoint=[checkpoint]) != 0
    assert not files["reward"].with_name("die_at").exists()
    assert sorted(last_metrics(tmp_path / "two")) == [1, 2]  # killed in step 3, after the checkpoint of 2
    assert run("two", 2, checkpoint=[checkpoint]) == 0
    one, two = last_metrics(tmp_path / "one"), last_metrics(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert one[step]["dynamic_sampling/generation_rounds"] >= 2, step
        for key in KEYS:
            assert two[step][key] == one[step][key], (step, key)
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-6), step
