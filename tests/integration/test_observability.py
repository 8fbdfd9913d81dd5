"""Issue #6: trackers read back offline, step metrics, profilers, the resolved config with provenance,
plots, starters and the progress bar."""

from __future__ import annotations

import io
import json
import pstats
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.cli import main
from tests.integration.helpers import merge, metrics, train
from tests.wandb_records import history

pytestmark = pytest.mark.integration


def test_trackers_write_what_the_run_logged_and_resume_the_same_runs(
    base_config: dict, tmp_path: Path, monkeypatch
) -> None:
    for optional in ("wandb", "mlflow", "tensorboard"):  # the trackers extra: skip cleanly without it
        pytest.importorskip(optional)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    config = merge(
        base_config,
        train_iters=4,
        wandb={"enable": True, "mode": "offline", "name": "tiny"},
        tracking={
            "mlflow_server_uri": str(tmp_path / "mlflow"),
            "experiment_name": "exp",
            "hf_mlflow_log_artifacts": True,
        },
        tensorboard={"enable": True, "log_params_norm": True},
        metrics={"timers": True},
        checkpoint=[
            {
                "type": "deepspeed",
                "output_dir": str(out / "state"),
                "save_every_n_steps": 2,
                "auto_resume": True,
            },
            {"type": "huggingface", "output_dir": str(out / "export"), "save_end_of_training": True},
        ],
    )
    first = train(config)
    lines = metrics(config)
    ids = first.state.tracker_ids
    assert set(ids) == {"wandb", "mlflow"}

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([x["loss"] for x in lines], rel=1e-6)
    for tag in ("lr", "grad_norm", "tokens_per_second", "memory_rss_gib", "time_forward", "params_norm"):
        assert tag in events.Tags()["scalars"], tag

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    logged = client.get_metric_history(ids["mlflow"], "loss")
    assert [m.step for m in logged] == [1, 2, 3, 4]
    run = client.get_run(ids["mlflow"])
    assert run.data.params["optimizer.lr"] == "0.001" and run.info.status == "FINISHED"
    assert "export" in [a.path for a in client.list_artifacts(ids["mlflow"])]

    (offline,) = (out / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    rows = history(offline)
    assert [row["_step"] for row in rows] == [1, 2, 3, 4]
    assert [row["loss"] for row in rows] == pytest.approx([x["loss"] for x in lines])

    resumed = train(merge(config, train_iters=6))
    assert resumed.resumed_from is not None and resumed.state.tracker_ids == ids  # the same runs continue
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "loss")] == [1, 2, 3, 4, 5, 6]
    assert len(list((out / "wandb").glob(f"offline-run-*-{ids['wandb']}"))) == 2


def test_step_metrics(base_config: dict) -> None:
    config = merge(
        base_config,
        train_iters=3,
        metrics={"timers": True, "peak_tflops": 2.0},
        model={"disable_activation_checkpoint": False},
    )
    train(config)
    for line in metrics(config):
        assert line["mfu"] == pytest.approx(line["tflops"] / 2.0)
        # with activation checkpointing the recomputed forward is counted apart
        assert line["hfu"] == pytest.approx(line["hardware_tflops"] / 2.0) and line["hfu"] > line["mfu"]
        assert line["samples_per_second"] == pytest.approx(4 / line["step_time"], rel=1e-6)
        memory = line["memory_allocated_gib"] if torch.cuda.is_available() else line["memory_rss_gib"]
        assert memory > (0.0 if torch.cuda.is_available() else 0.1)
        split = sum(line[f"time_{name}"] for name in ("data", "forward", "backward", "optimizer"))
        assert 0 < split - line["time_data"] <= line["step_time"]


def test_profilers(base_config: dict, tmp_path: Path) -> None:
    out = Path(base_config["logger"]["output_dir"])
    config = merge(
        base_config,
        train_iters=4,
        mem_profiler="step",
        profiling={
            "use_pytorch_profiler": True,
            "profile_step_start": 2,
            "profile_step_end": 3,
            "python_profile": True,
        },
    )
    train(config)
    trace = json.loads((out / "profile" / "trace-rank0.json").read_text())
    assert trace["traceEvents"]
    stats = pstats.Stats(str(out / "profile" / "python-rank0.prof"))
    assert any("train_step" in key[2] for key in stats.stats)  # type: ignore[attr-defined]
    if torch.cuda.is_available():  # on a GPU: CUDA memory history, one snapshot per step
        assert len(list((out / "mem-prof").glob("memory-rank0*.pickle"))) == 4
        return
    timeline = [json.loads(x) for x in (out / "mem-prof" / "memory-rank0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in timeline] == [1, 2, 3, 4] and all(x["memory_rss_gib"] > 0 for x in timeline)
    assert not list(out.rglob(".*.tmp-*"))  # no temporary files left by atomic_write


def test_resolved_config_names_every_origin(base_config: dict, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**base_config, "train_iters": 2}))
    assert main(["train", str(path), "optimizer.weight_decay=0.05"]) == 0
    text = (Path(base_config["logger"]["output_dir"]) / "resolved-config.yaml").read_text()
    resolved = yaml.safe_load(text)
    assert resolved["optimizer"]["weight_decay"] == 0.05 and resolved["train_iters"] == 2
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if "#" in line and ":" in line}
    assert lines["weight_decay"].endswith("# command line")
    assert lines["train_iters"].endswith(f"# {path}:{text and _line_of(path, 'train_iters')}")
    assert lines["seed"].endswith("# default")
    assert lines["kill_switch_path"].endswith("# derived")


def _line_of(path: Path, key: str) -> int:
    return next(
        i for i, line in enumerate(path.read_text().splitlines(), start=1) if line.startswith(f"{key}:")
    )


def test_secrets_are_never_printed(tmp_path: Path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {name_or_path: m}\n"
        "data:\n  sources:\n    - {type: huggingface, name_or_path: org/ds, kwargs: {token: hf_SECRET1}}\n"
        "tracking: {mlflow_server_uri: 'https://bob:hunter2@mlflow.example.com', experiment_name: e}\n"
    )
    assert main(["validate", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "hf_SECRET1" not in shown and "hunter2" not in shown
    assert "token: '***'" in shown and "https://bob:***@mlflow.example.com" in shown


def test_plot_overlays_runs(base_config: dict, tmp_path: Path, capsys) -> None:
    first = merge(base_config, train_iters=3, data={"train_eval_split": [0.75, 0.25]})
    second = merge(first, optimizer={"lr": 1e-2}, logger={"output_dir": str(tmp_path / "other")})
    train(first)
    train(second)
    out = tmp_path / "curves.png"
    files = [str(Path(c["logger"]["output_dir"]) / "train-log-metrics.jsonl") for c in (first, second)]
    assert main(["plot", *files, "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such metrics file" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["sft", "lora", "dpo", "kto", "reward", "causal", "grpo", "distill"])
def test_starter_configs_run_as_they_are(kind: str, tmp_path_factory, monkeypatch, capsys) -> None:
    directory = tmp_path_factory.getbasetemp() / "starters"  # one tiny model for all four
    directory.mkdir(exist_ok=True)
    monkeypatch.chdir(directory)
    assert main(["init", kind, "-o", f"{kind}.yaml"]) == 0
    text = Path(f"{kind}.yaml").read_text()
    assert text.startswith("# posttrain starter") and "yaml-language-server" in text
    if kind in ("grpo", "distill"):  # each prompt a question of the task, once
        prompts = [
            json.loads(line)["prompt"][-1]["content"]
            for line in Path("data/prompts.jsonl").read_text().splitlines()
        ]
        assert all(p.startswith("reverse ") for p in prompts) and len(set(prompts)) == len(prompts)
    assert main(["train", f"{kind}.yaml"]) == 0
    assert Path(f"runs/{kind}/export/final").is_dir()
    # eval_on_start: the held-out loss before training (iter 0) and after it; the starters learn clearly
    records = [
        json.loads(line) for line in Path(f"runs/{kind}/train-log-metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in records if "eval_loss" in r]
    if (
        kind == "grpo"
    ):  # the reward of greedy completions to held-out prompts rises (eval_loss is its negative)
        assert evals[0]["iter"] == 0 and evals[-1]["eval_reward"] >= evals[0]["eval_reward"] + 0.25, evals
    elif kind == "distill":  # the taught teacher's divergence from the student's greedy completions falls
        assert evals[0]["iter"] == 0 and evals[-1]["eval_divergence"] < 0.75 * evals[0]["eval_divergence"], (
            evals
        )
        out = capsys.readouterr()
        assert "eval_divergence" in out.out + out.err  # what distill is judged by, on the console
    else:
        assert evals[0]["iter"] == 0 and evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"], evals
    assert all(r["lr"] > 0 for r in records if "lr" in r)  # no step spent at lr 0
    assert main(["init", kind, "-o", f"{kind}.yaml"]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err


def test_progress_bar_renders_step_loss_lr_and_eta() -> None:
    from rich.console import Console

    from posttrain.tracking.outputs import ProgressBar

    sink = io.StringIO()
    bar = ProgressBar(10, console=Console(file=sink, force_terminal=True, width=120))
    bar.update({"iter": 3, "loss": 1.25, "lr": 1e-3, "tokens_per_second": 1234.0})
    bar.update({"iter": 3, "eval_loss": 1.5})
    bar.close()
    shown = sink.getvalue()
    for text in ("3/10", "loss 1.2500 | eval_loss 1.5000 | lr 1.00e-03 | 1234 tok/s", "ETA"):
        assert text in shown, text


def test_a_tracker_that_cannot_start_is_a_clear_error(base_config: dict, tmp_path: Path, capsys) -> None:
    config = {
        **base_config,
        "train_iters": 1,
        "tracking": {
            "mlflow_server_uri": str(tmp_path / "mlflow"),
            "experiment_name": "e",
            "run_id": "nosuchrun",
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the mlflow tracker could not start" in err and "Traceback" not in err
