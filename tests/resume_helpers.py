"""Run the CLI for resume tests: a reference run, a run killed with SIGKILL, and its resumed continuation."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file

from posttrain.testing.env import child_env

DYING = Path(__file__).parent / "resources" / "dying_checkpoint.py"


def cli(
    config: dict[str, Any], path: Path, nproc: int = 1, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """``posttrain train`` on ``config`` in a process of its own. Past ``timeout`` the run is stopped with
    SIGABRT first, so Python's fault handler prints where every thread of it was (the test's error ends with
    those stacks), then killed."""
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", str(nproc)]
    env = child_env(PYTHONFAULTHANDLER="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # the main process: where the run waits
        try:
            out, err = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        stacks = err[err.rfind("Fatal Python error") :].split("\nExtension modules:")[0]
        raise AssertionError(
            f"posttrain train {path.name} ran past {timeout} s; its last output:\n{out[-2000:]}\n{err[-1500:]}\n"
            f"where it was:\n{stacks[:8000]}"
        ) from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def two_nodes(path: Path, timeout: int = 300) -> list[str]:
    """``posttrain train PATH`` as two "nodes" on this machine (two commands joined by ``--launcher-args``,
    one process each): their outputs, after both ended with status 0."""
    from posttrain.dist import free_port

    port = free_port()
    train_command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", "1", "--launcher-args"]
    nodes = [
        subprocess.Popen(
            [*train_command, f"--nnodes 2 --node_rank {rank} --master_addr 127.0.0.1 --master_port {port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(),
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return outputs


def last_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """iter -> the last line written for it (a resumed run appends to the same file)."""
    out: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "train-log-metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["iter"]] = record
    return out


def kill_and_resume(
    base: dict[str, Any], tmp: Path, *, nproc: int, kill_at: int, total: int
) -> dict[str, Any]:
    """Reference run of ``total`` steps vs. a run SIGKILLed after the checkpoint of ``kill_at`` and resumed."""
    results: dict[str, Any] = {}
    for name in ("reference", "killed", "resumed"):
        config = copy.deepcopy(base)
        run_dir = tmp / ("reference" if name == "reference" else "interrupted")
        config.update(train_iters=total, logger={"output_dir": str(run_dir)})
        export = {"type": "huggingface", "output_dir": str(run_dir / "export"), "save_end_of_training": True}
        resumable = {"output_dir": str(run_dir / "ckpt"), "auto_resume": True, "save_every_n_steps": kill_at}
        if name == "killed":
            config.update(code=str(DYING), skip_validation=True)
            resumable.update(type="deepspeed-dies", die_at_step=kill_at)
        else:
            resumable.update(type="deepspeed")
        config["checkpoint"] = [export, resumable]
        done = cli(config, tmp / f"{name}.yaml", nproc)
        results[name] = done
        if name == "killed":
            assert done.returncode != 0, "the run should have been killed"
        else:
            assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results["reference_metrics"] = last_metrics(tmp / "reference")
    results["resumed_metrics"] = last_metrics(tmp / "interrupted")
    results["reference_weights"] = load_file(tmp / "reference" / "export" / "final" / "model.safetensors")
    results["resumed_weights"] = load_file(tmp / "interrupted" / "export" / "final" / "model.safetensors")
    return results


def resume_chain(base: dict[str, Any], tmp: Path, legs: list[tuple[int, int | None]]) -> list[Any]:
    """One run in legs, ``(processes, step to die at with SIGKILL after its checkpoint, or None: to the
    end)``, each resuming the last; checkpoints every ``legs[0][1]`` steps. The legs' outputs."""
    run_dir, done = tmp / "chain", []
    every = legs[0][1]
    for number, (nproc, die_at) in enumerate(legs):
        config = copy.deepcopy(base)
        config["logger"] = {"output_dir": str(run_dir)}
        resumable: dict[str, Any] = {
            "output_dir": str(run_dir / "ckpt"),
            "auto_resume": True,
            "save_every_n_steps": every,
            "type": "deepspeed",
        }
        if die_at is not None:
            config.update(code=str(DYING), skip_validation=True)
            resumable.update(type="deepspeed-dies", die_at_step=die_at)
        export = {"type": "huggingface", "output_dir": str(run_dir / "export"), "save_end_of_training": True}
        config["checkpoint"] = [export, resumable]
        result = cli(config, tmp / f"leg{number}.yaml", nproc)
        assert (result.returncode != 0) == (die_at is not None), result.stdout[-3000:] + result.stderr[-3000:]
        done.append(result)
    return done


def assert_same_continuation(results: dict[str, Any], kill_at: int, total: int) -> None:
    assert f"global_step_{kill_at}" in results["resumed"].stdout, results["resumed"].stdout[-2000:]
    reference, resumed = results["reference_metrics"], results["resumed_metrics"]
    assert sorted(reference) == sorted(resumed) == list(range(1, total + 1))
    for step in range(kill_at + 1, total + 1):
        assert abs(reference[step]["loss"] - resumed[step]["loss"]) <= 1e-6, (
            step,
            reference[step],
            resumed[step],
        )
        assert reference[step]["tokens"] == resumed[step]["tokens"], step  # the same data at the same step
        assert abs(reference[step]["lr"] - resumed[step]["lr"]) <= 1e-12, step
    a, b = results["reference_weights"], results["resumed_weights"]
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff


def interrupt_after_three_steps(
    base: dict[str, Any], tmp: Path, sig: int, nproc: int = 1, to: str = "process", workers: int = 0
) -> tuple[str, int, Path]:
    """Start a long run with a deepspeed checkpoint engine and ``workers`` DataLoader workers, send ``sig``
    once three steps are logged, and check it exits 0 after one line and a stop-time checkpoint. ``to``: the
    ``posttrain`` process, its process ``group`` (what ``timeout`` and Ctrl-C signal), or ``every`` process
    of the job, launcher, ranks and workers alike (what SLURM signals at preemption and its time limit).
    Returns (output, last logged step, checkpoint dir)."""
    import signal
    import time

    import psutil

    ckpt = tmp / "ckpt"
    config = copy.deepcopy(base)
    config.update(
        epochs=1000, micro_batch_size=1, checkpoint=[{"type": "deepspeed", "output_dir": str(ckpt)}]
    )
    config.setdefault("data", {})["dl_num_workers"] = workers
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    metrics = Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl"
    command = [sys.executable, "-m", "posttrain", "train", str(path), "--nproc", str(nproc)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        start_new_session=to != "process",
    )
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    if to == "process":
        process.send_signal(signal.Signals(sig))
    elif to == "group":
        os.killpg(process.pid, sig)
    else:
        family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for member in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(sig)
    out, _ = process.communicate(timeout=180)
    assert process.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["iter"]
    assert f"{signal.Signals(sig).name} received" in out and f"stopped early at step {last}" in out
    assert (ckpt / f"global_step_{last}" / "posttrain_state.json").is_file()
    staging = ckpt / ".staging"  # no half-written checkpoint (DeepSpeed's helper scripts may lie there)
    assert not staging.exists() or not any(p.is_dir() for p in staging.iterdir())
    return out, last, ckpt


def stop_then_resume_exactly(
    base: dict[str, Any], tmp: Path, sig: int, nproc: int, to: str, workers: int
) -> None:
    """:func:`interrupt_after_three_steps`, then ``auto_resume`` for three more steps: they are the steps an
    uninterrupted run of the same config takes (losses within 1e-6, the same tokens)."""
    (tmp / "stopped").mkdir(parents=True, exist_ok=True)
    stopped = merge_logger(base, tmp / "stopped" / "run")
    _, last, ckpt = interrupt_after_three_steps(
        stopped, tmp / "stopped", sig, nproc=nproc, to=to, workers=workers
    )
    config = copy.deepcopy(base)
    config["data"]["dl_num_workers"] = workers
    config.update(micro_batch_size=1, epochs=1000, train_iters=last + 3)
    resumed = merge_logger(config, tmp / "stopped" / "run")
    resumed["checkpoint"] = [{"type": "deepspeed", "output_dir": str(ckpt), "auto_resume": True}]
    done = cli(resumed, tmp / "resumed.yaml", nproc)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = merge_logger(config, tmp / "reference")
    done = cli(reference, tmp / "reference.yaml", nproc)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got, expected = last_metrics(tmp / "stopped" / "run"), last_metrics(tmp / "reference")
    for step in range(last + 1, last + 4):
        assert abs(got[step]["loss"] - expected[step]["loss"]) <= 1e-6, (step, got[step], expected[step])
        assert got[step]["tokens"] == expected[step]["tokens"], step


def merge_logger(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    out = copy.deepcopy(config)
    out["logger"] = {**out.get("logger", {}), "output_dir": str(run_dir)}
    return out
