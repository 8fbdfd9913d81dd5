from __future__ import annotations

import pytest
import torch

from posttrain.config import load_config
from posttrain.config.deepspeed import (
    accumulation_dtype,
    build_deepspeed_config,
    single_process_stage,
    uses_bf16_optimizer,
)
from posttrain.optim.adamw import param_groups


def config(tmp_path, **extra):
    data = {"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}, **extra}
    return load_config(data=data, base_dir=tmp_path)


def test_no_weight_decay_on_bias_and_norms() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False)
    )
    model[2].weight.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1, 1e-3)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3  # linear bias, norm weight, norm bias; the frozen weight is left out


def hf_lrs(tmp_path, name: str, steps: int, **scheduler) -> list[float]:
    from posttrain.optim.schedulers import build_huggingface_scheduler

    cfg = config(tmp_path, scheduler={"name": name, **scheduler}, optimizer={"lr": 1.0})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_huggingface_scheduler(cfg.scheduler, optimizer, steps, None)  # type: ignore[arg-type]
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    return lrs


def test_linear_schedule_with_warmup_ratio(tmp_path) -> None:
    lrs = hf_lrs(tmp_path, "linear", 10, warmup_ratio=0.2)
    # warmup counts the update being made: no step runs at lr 0; after the warmup, transformers' schedule
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8])


def test_no_schedule_spends_a_step_at_lr_zero(tmp_path) -> None:
    from posttrain.config.scheduler import KNOWN_SCHEDULES

    kwargs = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1}}
    for name in set(KNOWN_SCHEDULES) - {"reduce_lr_on_plateau", "greedy", "constant"}:
        scheduler = {"warmup_ratio": 0.25, "scheduler_kwargs": kwargs.get(name, {})}
        assert hf_lrs(tmp_path, name, 20, **scheduler)[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]), name


def test_known_schedule_names_are_transformers_own() -> None:
    from transformers import SchedulerType

    from posttrain.config.scheduler import KNOWN_SCHEDULES

    assert set(KNOWN_SCHEDULES) == {member.value for member in SchedulerType}


def test_cosine_and_constant(tmp_path) -> None:
    assert hf_lrs(tmp_path, "constant", 4, warmup_ratio=0) == [1.0] * 4
    cosine = hf_lrs(tmp_path, "cosine", 4, warmup_ratio=0)
    assert cosine == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466])


def test_scheduler_kwargs_pass_through(tmp_path) -> None:
    lrs = hf_lrs(
        tmp_path, "warmup_stable_decay", 10, warmup_ratio=0.1, scheduler_kwargs={"num_decay_steps": 2}
    )
    assert lrs[:9] == pytest.approx([1.0] * 9)  # 1 warmup step (at the peak), then stable until the decay
    assert lrs[9] < 1.0  # the 2 decay steps start at step 8 (lr 1.0) and go down


def test_unknown_scheduler_name(tmp_path) -> None:
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="unknown scheduler name 'cosin'"):
        config(tmp_path, scheduler={"name": "cosin"})


def test_deepspeed_autofill_and_partial_zero_merge(tmp_path) -> None:
    cfg = config(
        tmp_path,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        deepspeed={"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5},
    )
    ds = build_deepspeed_config(cfg, world_size=2, hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16
    assert ds["zero_optimization"] == {
        "stage": 3,
        "stage3_param_persistence_threshold": 640,
        "stage3_max_live_parameters": 2 * 64 * 64,
        "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
        "reduce_bucket_size": 2**24,  # hidden^2 with a floor, so a small model is not cut into tiny buckets
    }
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["gradient_clipping"] == 0.5


def test_deepspeed_defaults_follow_dtype(tmp_path) -> None:
    cfg = config(tmp_path, model={"name_or_path": "m", "dtype": "fp32"})
    ds = build_deepspeed_config(cfg, world_size=2, hidden_size=8)
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 1.0
    # one process: nothing to partition, so stage 0; a stage 1 or 2 the user chose runs as 0 (and says so)
    assert build_deepspeed_config(cfg, world_size=1, hidden_size=8)["zero_optimization"]["stage"] == 0
    for stage in (1, 2):
        fp32 = {"name_or_path": "m", "dtype": "fp32"}
        cfg = config(tmp_path, model=fp32, deepspeed={"zero_optimization": {"stage": stage}})
        one = build_deepspeed_config(cfg, world_size=1, hidden_size=8)
        assert one["zero_optimization"]["stage"] == 0 and not uses_bf16_optimizer(one)
        assert f"stage {stage} with one process shards nothing" in single_process_stage(stage, one)
        two = build_deepspeed_config(cfg, world_size=2, hidden_size=8)
        assert two["zero_optimization"]["stage"] == stage and not single_process_stage(stage, two)
    # bfloat16 on one process: DeepSpeed's BF16_Optimizer (stage 1, float32 gradient accumulation), whatever
    # stage 0-2 was asked for; several processes keep their stage
    for stage in (None, 0, 1, 2):
        zero = {} if stage is None else {"deepspeed": {"zero_optimization": {"stage": stage}}}
        one = build_deepspeed_config(config(tmp_path, **zero), world_size=1, hidden_size=8)
        assert one["zero_optimization"]["stage"] == 1 and one["data_types"] == {"grad_accum_dtype": "fp32"}
        assert uses_bf16_optimizer(one)
        assert ("BF16_Optimizer" in single_process_stage(stage, one)) == (stage != 1)
        two = build_deepspeed_config(config(tmp_path, **zero), world_size=2, hidden_size=8)
        assert (
            two["zero_optimization"]["stage"] == (2 if stage is None else stage) and "data_types" not in two
        )
    # bf16 accumulation asked for: stage 1 without BF16_Optimizer, and the line says so (not float32)
    bf16_accumulation = {"data_types": {"grad_accum_dtype": "bf16"}}
    one = build_deepspeed_config(config(tmp_path, deepspeed=bf16_accumulation), world_size=1, hidden_size=8)
    assert one["zero_optimization"]["stage"] == 1 and not uses_bf16_optimizer(one)
    assert accumulation_dtype(one) == "bfloat16" and accumulation_dtype(two) == "bfloat16"
    note = single_process_stage(None, one)
    assert "gradients accumulated in bfloat16" in note and "BF16_Optimizer (ZeRO" not in note
    cfg = config(tmp_path, deepspeed={"zero_optimization": {"stage": 3}})
    assert build_deepspeed_config(cfg, world_size=1, hidden_size=8)["zero_optimization"]["stage"] == 3
    # optimizer offload needs stage >= 1, parameter offload stage 3; "auto" precision follows model.dtype
    cfg = config(
        tmp_path,
        optimizer={"type": "cpu_adam"},
        model={"name_or_path": "m", "dtype": "bfloat16"},
        deepspeed={
            "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
            "bf16": {"enabled": "auto"},
        },
    )
    ds = build_deepspeed_config(cfg, world_size=1, hidden_size=8)
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True}
    cfg = config(tmp_path, deepspeed={"zero_optimization": {"offload_param": {"device": "cpu"}}})
    assert build_deepspeed_config(cfg, world_size=1, hidden_size=8)["zero_optimization"]["stage"] == 3


def test_disagreeing_deepspeed_batch_is_refused(tmp_path) -> None:
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="set micro_batch_size instead"):
        config(tmp_path, deepspeed={"train_micro_batch_size_per_gpu": 8})
