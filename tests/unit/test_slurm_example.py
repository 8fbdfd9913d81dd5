"""``examples/slurm/grpo-pool.sbatch`` splits a SLURM allocation into trainer and generator nodes: run here with
``scontrol``, ``srun`` and ``posttrain`` stand-ins on PATH that record what each node would run (SLURM's own
variables set as SLURM sets them), so the servers' ports and GPUs, the trainers' launcher arguments and the
pool's addresses (read back by posttrain's own config loading) are checked without a cluster. The run itself on
two trainer "nodes" and two servers: ``tests/integration/test_server_pool_vllm.py``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "grpo-pool.sbatch"
NODES = ["gpu1", "gpu2", "gpu3", "gpu4"]
GRPO = {
    "type": "grpo",
    "model": {"name_or_path": "/models/tiny"},
    "data": {"sources": ["/data/prompts.jsonl"]},
    "rewards": [{"type": "length_penalty"}],
    "use_vllm": True,
    "vllm_mode": "server",
}

SCONTROL = f"""#!/bin/bash
printf '%s\\n' {" ".join(NODES)}
"""
#: runs `bash -c CMD` once per node of --nodelist, with the node's SLURM_NODEID in the job, on a PATH without
#: the stand-ins' folder (a node whose login PATH lacks posttrain: the script names it by its path)
SRUN = f"""#!/bin/bash
nodes=({" ".join(NODES)})
while [[ $1 == --* ]]; do
  case $1 in --nodelist) list=$2; shift 2 ;; *) shift 2 ;; esac
done
IFS=, read -ra chosen <<< "$list"
for node in "${{chosen[@]}}"; do
  for i in "${{!nodes[@]}}"; do [[ ${{nodes[$i]}} == "$node" ]] && id=$i; done
  PATH=/usr/bin:/bin SLURMD_NODENAME=$node SLURM_NODEID=$id "$@"
done
"""
POSTTRAIN = """#!/usr/bin/python3
import json, os, sys, time
if sys.argv[1] == "train":  # the servers are started first, in the background: wait until they are
    def started():
        if not os.path.exists(os.environ["CALLS"]):
            return 0
        with open(os.environ["CALLS"]) as calls:
            return sum("vllm-serve" in line for line in calls)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and started() < int(os.environ.get("SERVERS", "0")):
        time.sleep(0.05)
with open(os.environ["CALLS"], "a") as out:
    out.write(json.dumps({"node": os.environ["SLURMD_NODENAME"], "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "args": sys.argv[1:]}) + "\\n")
"""


def test_the_sbatch_example_splits_the_allocation_into_trainers_and_a_pool(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("posttrain", POSTTRAIN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "SLURM_JOB_NODELIST": "gpu[1-4]",
        "SLURM_GPUS_ON_NODE": "2",
        "TRAIN_NODES": "2",
        "SERVERS": "4",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "grpo.yaml"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    found = [json.loads(line) for line in calls.read_text().splitlines()]
    servers = sorted(
        (c["node"], c["gpu"], c["args"][c["args"].index("--port") + 1])
        for c in found
        if c["args"][0] == "vllm-serve"
    )
    assert servers == [
        ("gpu3", "0", "8000"),
        ("gpu3", "1", "8001"),
        ("gpu4", "0", "8000"),
        ("gpu4", "1", "8001"),
    ]
    trainers = [c for c in found if c["args"][0] == "train"]
    assert [c["node"] for c in trainers] == ["gpu1", "gpu2"]
    for rank, call in enumerate(trainers):
        args = call["args"]
        assert args[:4] == ["train", "grpo.yaml", "--nproc", "2"]
        launcher = shlex.split(args[args.index("--launcher-args") + 1])
        assert launcher == [
            "--nnodes",
            "2",
            "--node_rank",
            str(rank),
            "--master_addr",
            "gpu1",
            "--master_port",
            "29500",
        ]
    override = next(a for a in trainers[0]["args"] if a.startswith("vllm_server_base_url="))
    from posttrain.config.load import load_config
    from posttrain.config.online import server_urls

    config = load_config(overrides=[override], data=GRPO)  # the pool as posttrain reads it
    assert server_urls(config.vllm_server_base_url) == [
        f"http://gpu{n}:{8000 + g}" for n in (3, 4) for g in (0, 1)
    ]


def test_the_sbatch_example_refuses_an_allocation_with_no_generator_node(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[1-4]"}
    done = subprocess.run(
        ["bash", str(SCRIPT), "grpo.yaml"], env={**env, "TRAIN_NODES": "4"}, capture_output=True, text=True
    )
    assert done.returncode == 2 and "4 node(s) for 4 trainer node(s): ask for more nodes" in done.stderr


def test_the_sbatch_example_needs_posttrain_and_a_gpu_count(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    slurm_only = tmp_path / "slurm"
    slurm_only.mkdir()
    for folder, names in ((bin_dir, ("scontrol", "posttrain")), (slurm_only, ("scontrol",))):
        for name in names:
            (folder / name).write_text({"scontrol": SCONTROL, "posttrain": POSTTRAIN}[name])
            (folder / name).chmod(0o755)
    base = {"SLURM_JOB_NODELIST": "gpu[1-4]", "TRAIN_NODES": "1"}
    env = {**base, "PATH": f"{bin_dir}:/usr/bin:/bin"}  # no SLURM_GPUS_ON_NODE, no nvidia-smi here
    done = subprocess.run(["bash", str(SCRIPT), "grpo.yaml"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "no GPU count: submit with --gpus-per-node N" in done.stderr
    env = {**base, "PATH": f"{slurm_only}:/usr/bin:/bin", "SLURM_GPUS_ON_NODE": "8"}
    done = subprocess.run(["/bin/bash", str(SCRIPT), "grpo.yaml"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "no posttrain on PATH: activate its environment" in done.stderr
