"""What a user coming from another trainer meets first: its key names pointed to posttrain's, ``--version``,
and a metrics file read as one run by ``posttrain plot``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.config.errors import ConfigError


def test_other_trainers_keys_are_pointed_to_posttrains(tiny_model_dir: Path, chat_file: Path) -> None:
    config = {
        "type": "sft",
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"sources": [str(chat_file)]},
        "learning_rate": 1e-5,  # TRL / transformers
        "sequence_len": 512,  # Axolotl
        "per_device_train_batch_size": 4,  # TRL
        "num_train_epochs": 3,
        "cutoff_len": 1024,  # LLaMA-Factory
        "gradient_accumulation_steps": 2,  # posttrain's own too: no error
    }
    with pytest.raises(ConfigError) as caught:
        load_config(data=config)
    said = caught.value.render()
    for key, ours in (
        ("learning_rate", "optimizer.lr"),
        ("sequence_len", "data.max_length"),
        ("per_device_train_batch_size", "micro_batch_size"),
        ("num_train_epochs", "epochs"),
        ("cutoff_len", "data.max_length"),
    ):
        assert f"{key}: unknown key; TRL's, Axolotl's or LLaMA-Factory's name: posttrain's is {ours}" in said
    assert "gradient_accumulation_steps" not in said and "max_per_device_train_batch_size" not in said


def test_version_names_posttrain_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from posttrain import __version__
    from posttrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"posttrain {__version__} (torch ") and "Python 3." in out


def test_a_resumed_runs_records_replace_the_killed_runs_later_ones(tmp_path: Path) -> None:
    from posttrain.tracking.plot import read_metrics

    lines = [{"iter": 0, "eval_loss": 3.0}, *({"iter": i, "loss": 10.0 - i} for i in range(1, 6))]
    lines += [{"iter": 5, "eval_loss": 2.0}, *({"iter": i, "loss": 20.0 - i} for i in range(4, 8))]
    path = tmp_path / "train-log-metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_metrics(path)
    assert [r["iter"] for r in records] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [r.get("loss") for r in records[1:4]] == [9.0, 8.0, 7.0] and records[4]["loss"] == 16.0


def test_schedule_names_are_read_without_importing_transformers() -> None:
    from transformers import SchedulerType

    from posttrain.config.scheduler import _hf_scheduler_names

    assert _hf_scheduler_names() == tuple(member.value for member in SchedulerType)


def test_servers_on_other_machines_without_a_shared_weights_folder_are_warned_about(
    tiny_model_dir: Path, chat_file: Path
) -> None:
    def advice(**changes: object) -> list[str]:
        config = {
            "type": "grpo",
            "model": {"name_or_path": str(tiny_model_dir)},
            "data": {"sources": [str(chat_file)]},
            "rewards": [{"type": "exact_match"}],
            "micro_batch_size": 8,
            "use_vllm": True,
            "vllm_mode": "server",
            **changes,
        }
        return load_config(data=config).advice()

    [line] = advice(vllm_server_base_url=["http://127.0.0.1:8000", "http://10.1.2.3:8000"])
    assert "the servers at http://10.1.2.3:8000 read the pushed weights from this machine's /dev/shm" in line
    assert advice(vllm_server_base_url="http://127.0.0.1:8000") == []
    assert advice(vllm_server_base_url="http://10.1.2.3:8000", vllm_server_weights_dir="/shared/w") == []
