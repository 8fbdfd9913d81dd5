"""Two CPU processes (gloo) under every ZeRO stage: the same update as one process with the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from posttrain.testing.env import child_env
from tests.integration.helpers import merge, train
from tests.launch_helpers import train_in_two_processes
from tests.resume_helpers import two_nodes

pytestmark = pytest.mark.distributed


def one_step(base_config: dict, tmp_path: Path, name: str, **changes) -> dict:
    return merge(
        base_config,
        train_iters=1,
        # eps=1 makes Adam's first step ~ lr * g: sensitive to the gradient's scale (a wrong world-size or
        # token normalisation would show) and free of the sign(g) amplification of float noise. Clipping
        # would rescale the gradient to norm 1 and hide a scale error too.
        optimizer={"lr": 0.5, "eps": 1.0, "weight_decay": 0.0},
        deepspeed={"gradient_clipping": 0.0},
        logger={"output_dir": str(tmp_path / name)},
        checkpoint=[{"output_dir": str(tmp_path / name / "export"), "save_end_of_training": True}],
        **changes,
    )


def test_two_processes_match_one_under_every_zero_stage(base_config: dict, tmp_path: Path) -> None:
    reference = one_step(base_config, tmp_path, "one", micro_batch_size=4)
    train(reference)
    configs = {}
    for stage in (0, 1, 2, 3):
        configs[f"two-z{stage}"] = one_step(base_config, tmp_path, f"two-z{stage}", micro_batch_size=2)
        configs[f"two-z{stage}"]["deepspeed"]["zero_optimization"] = {"stage": stage}
    train_in_two_processes(configs, tmp_path)

    expected = load_file(tmp_path / "one" / "export" / "final" / "model.safetensors")
    initial = load_file(Path(base_config["model"]["name_or_path"]) / "model.safetensors")
    assert (
        max(float((expected[k] - initial[k]).abs().max()) for k in expected) > 1e-3
    )  # the step did something
    one_line = json.loads((tmp_path / "one" / "train-log-metrics.jsonl").read_text())
    for stage in (0, 1, 2, 3):
        got = load_file(tmp_path / f"two-z{stage}" / "export" / "final" / "model.safetensors")
        diff = max(float((expected[k] - got[k]).abs().max()) for k in expected)
        assert diff < 1e-5, (stage, diff)
        line = json.loads((tmp_path / f"two-z{stage}" / "train-log-metrics.jsonl").read_text())
        assert line["tokens"] == one_line["tokens"]  # target tokens summed over ranks
        assert abs(line["loss"] - one_line["loss"]) < 1e-5  # token-weighted loss over ranks
    assert (tmp_path / "two-z0" / "logs" / "rank-1.log").is_file()  # file_output_ranks: "*"


@pytest.mark.parametrize("launcher", ["deepspeed"])  # torchrun: the two-node test below
def test_cli_nproc_two(base_config: dict, tmp_path: Path, launcher: str) -> None:
    config = merge(base_config, train_iters=2, micro_batch_size=2, loss_log_interval=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", "2", "--launcher", launcher]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "world size 2" in done.stdout and "[rank 0]" in done.stdout
    assert "[rank 1]" not in done.stdout  # logger.print_output_ranks: [0]


def test_a_bad_row_stops_both_ranks_with_its_file_and_row(base_config: dict, tmp_path: Path) -> None:
    """Rank 0 builds the data while rank 1 waits on the file system; a bad row ends both (no hang)."""
    data = tmp_path / "bad.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"x": 1}\n'
    )
    config = merge(base_config, train_iters=1, data={"sources": [str(data)]})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=child_env())
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "bad.jsonl row 2: no conversation in this row" in output, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output


def test_launcher_args_reach_the_launcher_with_one_process_per_node(
    base_config: dict, tmp_path: Path
) -> None:
    """`--nproc 1 --launcher-args '--nnodes 2 --node_rank N ...'` on two "nodes" (here two commands on one
    machine) is one run of world size 2, not two runs of world size 1."""
    config = merge(base_config, train_iters=2, micro_batch_size=2)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    outputs = two_nodes(path)
    assert "world size 2" in outputs[0] and "global batch 4" in outputs[0]
    assert "[rank 1]" not in outputs[1]  # logger.print_output_ranks: [0]
    lines = (tmp_path / "run" / "train-log-metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # one run wrote its two steps once (two world-size-1 runs would write four)
