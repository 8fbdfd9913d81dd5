"""Issue #6's GPU paths (run on a machine with a GPU): CUDA memory history, GPU memory metrics, MFU for a
known GPU, and CUDA activity in the PyTorch profiler trace."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from posttrain.tracking.flops import PEAK_TFLOPS_16BIT
from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["step", "e2e"])
def test_cuda_memory_history_and_gpu_metrics(base_config: dict, mode: str) -> None:
    out = Path(base_config["logger"]["output_dir"] + f"-{mode}")
    config = merge(
        base_config,
        train_iters=3,
        model={"dtype": "bfloat16"},
        mem_profiler=mode,
        metrics={"timers": True},
        profiling={"use_pytorch_profiler": True, "profile_step_start": 2, "profile_step_end": 2},
        logger={"output_dir": str(out)},
    )
    train(config)
    snapshots = sorted((out / "mem-prof").glob("memory-rank0*.pickle"))
    assert len(snapshots) == (3 if mode == "step" else 1)
    snapshot = pickle.loads(snapshots[-1].read_bytes())
    assert snapshot["device_traces"] and snapshot["segments"]  # what pytorch.org/memory_viz reads
    for line in metrics(config):
        assert line["memory_peak_gib"] >= line["memory_allocated_gib"] > 0
        assert line["time_forward"] > 0 and line["time_optimizer"] > 0
        name = torch.cuda.get_device_name()
        if any(key in name for key in PEAK_TFLOPS_16BIT):
            assert 0 < line["mfu"] < 1
    trace = json.loads((out / "profile" / "trace-rank0.json").read_text())
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])
