"""A method's checks that need no weights run before any model loads: at validation when the config alone
decides, once the world size is known otherwise (``validate --world-size``, ``train`` before it starts
processes, every rank before its tokenizer and model); step counts of methods whose steps come from a rollout
are optimizer steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.config import load_config
from posttrain.config.errors import ConfigError
from posttrain.errors import UserError
from posttrain.preflight import preflight
from tests.grpo_helpers import DIGITS, grpo_config, write_prompts
from tests.integration.helpers import train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompts")
    reward = root / "digits.py"
    reward.write_text(DIGITS)
    return {"train": write_prompts(root / "train.jsonl", 16), "reward": reward}


def test_a_total_batch_of_partial_groups_is_refused_at_validation(
    base_config: dict, prompt_files: dict[str, Path]
) -> None:
    config = grpo_config(base_config, prompt_files, total_train_batch_size=12)
    del config["micro_batch_size"], config["gradient_accumulation_steps"]
    with pytest.raises(ConfigError) as raised:
        load_config(data=config)
    assert "total_train_batch_size: the global batch counts completions: 12" in raised.value.render()
    assert "not a multiple of num_generations=8; set total_train_batch_size: 16" in raised.value.render()


def test_a_batch_that_depends_on_the_world_size_is_checked_before_the_model_loads(
    base_config: dict,
    prompt_files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """6 completions per process: fine on 4 processes (24 = 3 groups), not on 1 or 2. ``validate`` checks it
    for the world size it is given; ``train`` fails before it reads the tokenizer or the model (a missing
    model here: had it been read first, the error would be that one)."""
    monkeypatch.delenv(
        "LOCAL_RANK", raising=False
    )  # an earlier run in this process set it: not a launched rank
    config = grpo_config(base_config, prompt_files, micro_batch_size=6, gradient_accumulation_steps=1)
    config["model"]["name_or_path"] = str(tmp_path / "no-such-model")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["validate", str(path)]) == 0
    assert main(["validate", str(path), "--world-size", "4"]) == 0
    capsys.readouterr()
    assert main(["validate", str(path), "--world-size", "2"]) == 2
    said = capsys.readouterr().err
    assert "12 (micro-batch 6 x accumulation 1 x 2 processes) is not a multiple of num_generations=8" in said
    assert main(["train", str(path), "--nproc", "2"]) == 2  # before any process starts
    assert "x 2 processes) is not a multiple" in capsys.readouterr().err
    with pytest.raises(
        UserError, match=r"6 \(micro-batch 6 x accumulation 1 x 1 processes\) is not a multiple"
    ):
        train(config)  # one rank: before its tokenizer and model


def test_a_launched_rank_leaves_the_check_to_its_real_world_size(
    base_config: dict, prompt_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank started by ``train --nproc 4`` runs ``posttrain train`` again without --nproc: it must not check
    its batch for one process (6 completions fill 3 groups on 4 processes); its run checks the real world
    size before its model loads."""
    import posttrain.run

    config = grpo_config(base_config, prompt_files, micro_batch_size=6, gradient_accumulation_steps=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    started: list[object] = []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(posttrain.run, "run", started.append)  # the rank's run itself is not under test
    assert main(["train", str(path)]) == 0 and len(started) == 1


def test_min_iterations_counts_the_optimizer_steps_of_a_rollout(
    base_config: dict, prompt_files: dict[str, Path]
) -> None:
    """16 prompts, 2 per generated batch (16 completions / 8), 2 updates each: 16 optimizer steps an epoch.
    40 steps take 3 copies of the prompts (48 steps), not 20 copies (the count of samples per global batch
    of completions gave 2 steps an epoch)."""
    config = grpo_config(
        base_config,
        prompt_files,
        micro_batch_size=8,
        gradient_accumulation_steps=2,
        num_iterations=2,
        min_iterations=40,
    )
    plan = preflight(load_config(data=config), 1)
    assert plan.repeats == 3 and plan.total_steps == 48
    plain = preflight(load_config(data={**config, "min_iterations": 0}), 1)
    assert plain.repeats == 1 and plain.total_steps == 16
