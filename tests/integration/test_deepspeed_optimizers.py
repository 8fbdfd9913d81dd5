"""DeepSpeed's own optimizers: ``cpu_adam`` with ZeRO optimizer offload trains like torch AdamW."""

from __future__ import annotations

import pytest

from tests.integration.helpers import max_diff, merge, metrics, train, weights

pytestmark = pytest.mark.integration


def test_cpu_adam_with_optimizer_offload_matches_adamw(base_config, monkeypatch) -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    steps: list[int] = []
    real_step = DeepSpeedCPUAdam.step

    def counted_step(self, *args, **kwargs):  # the real step, counted
        steps.append(len(self.param_groups))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedCPUAdam, "step", counted_step)
    # the first use compiles DeepSpeed's cpu_adam op (about 80 s on 2 cores; cached in TORCH_EXTENSIONS_DIR)
    base = merge(base_config, train_iters=3, optimizer={"lr": 1e-3})
    offloaded = merge(
        base,
        optimizer={"type": "cpu_adam"},
        deepspeed={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        logger={"output_dir": base["logger"]["output_dir"] + "-offload"},
    )
    reference = merge(base, deepspeed={"zero_optimization": {"stage": 2}})
    got = train(offloaded)  # one process: ZeRO stage 2 is filled in, as offload needs stage 1 or more
    # DeepSpeed's CPU Adam took every optimizer step: ZeRO steps the two parameter groups (decay, no decay)
    # one by one
    assert len(steps) == 3 * 2
    want = train(reference)
    losses = [row["loss"] for row in metrics(offloaded)]
    assert losses == pytest.approx([row["loss"] for row in metrics(reference)], abs=1e-4)
    assert max_diff(weights(got.model), weights(want.model)) < 1e-4
