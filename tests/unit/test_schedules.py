"""Megatron-Bridge schedules, weight-decay increment, layer-wise LR and the run's batch arithmetic, each
against values computed by hand."""

from __future__ import annotations

import io
import math

import pytest
import torch

from posttrain.config import load_config
from posttrain.errors import UserError
from posttrain.optim.adamw import layer_ratio, param_groups
from posttrain.optim.megatron import LRSchedule, WeightDecaySchedule, build_megatron_scheduler
from posttrain.plan import BatchSizes, batch_sizes, rampup_problems, resolve, step_plan


def schedule(style: str, **kw) -> LRSchedule:
    base = dict(peak=1.0, min_lr=0.1, warmup_init=0.0, warmup_steps=2, decay_steps=10, style=style)
    return LRSchedule(**{**base, **kw})


def test_linear_and_cosine_with_warmup() -> None:
    linear = schedule("linear")
    # warmup counts the update being made: step 0 (the first update) runs at half the peak, not at 0
    assert [linear(s) for s in (0, 1, 2, 6, 10, 12)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    cosine = schedule("cosine")
    assert cosine(6) == pytest.approx(0.55)
    assert cosine(4) == pytest.approx(0.1 + 0.9 * 0.5 * (math.sqrt(0.5) + 1))  # 0.868198
    assert schedule("constant")(7) == 1.0
    assert schedule("linear", warmup_init=0.2, warmup_steps=4)(1) == pytest.approx(0.6)  # 0.2 + 0.8 x 2/4


def test_inverse_square_root_has_the_min_lr_floor() -> None:
    inv = schedule("inverse-square-root", warmup_steps=4, min_lr=0.0, decay_steps=100)
    assert [inv(4), inv(9), inv(16)] == pytest.approx([1.0, 2 / 3, 0.5])
    assert schedule("inverse-square-root", warmup_steps=4, min_lr=0.6, decay_steps=100)(16) == 0.6


def test_inverse_square_root_drops_to_min_lr_after_the_decay_steps() -> None:
    # Megatron's get_lr returns min_lr once the step passes lr_decay_steps, before the inverse-square-root
    # branch: a 1000-update run with lr_decay_iters 600 runs its update 601 on at min_lr
    inv = LRSchedule(
        peak=3e-4, min_lr=1e-6, warmup_init=0.0, warmup_steps=10, decay_steps=600, style="inverse-square-root"
    )
    assert inv(599) == pytest.approx(3e-4 * math.sqrt(10) / math.sqrt(599), rel=1e-15)
    assert [inv(s) for s in (600, 601, 999)] == [1e-6, 1e-6, 1e-6]


@pytest.mark.parametrize(
    ("shape", "midway"),
    [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5**0.5 - 1), ("minus_sqrt", 1 - 0.5**0.5)],
)
def test_wsd_is_flat_then_anneals(shape: str, midway: float) -> None:
    wsd = schedule("WSD", min_lr=0.0, warmup_steps=0, wsd_style=shape, wsd_steps=4)
    assert wsd(3) == 1.0 and wsd(6) == 1.0
    assert wsd(8) == pytest.approx(midway)
    assert wsd(10) == 0.0


def test_polynomial_ends_at_lr_end_and_respects_min_lr() -> None:
    poly = schedule("polynomial", warmup_steps=0, min_lr=0.0, power=2.0, lr_end=0.2)
    assert [poly(5), poly(10)] == pytest.approx([0.4, 0.2])  # 0.2 + 0.8 * 0.5**2
    floored = schedule("polynomial", warmup_steps=0, min_lr=0.3, power=2.0, lr_end=0.2)
    assert [floored(5), floored(10)] == pytest.approx([0.4, 0.3])


def test_weight_decay_increment() -> None:
    assert WeightDecaySchedule(0.0, 0.1, 10, "linear")(5) == pytest.approx(0.05)
    cosine = WeightDecaySchedule(0.0, 0.1, 10, "cosine")
    assert cosine(5) == pytest.approx(0.05)
    assert cosine(2) == pytest.approx(0.1 * 0.5 * (math.cos(0.8 * math.pi) + 1))  # 0.0095492
    assert cosine(10) == pytest.approx(0.1)
    assert WeightDecaySchedule(0.03, 0.03, 10)(7) == 0.03


def _config(tmp_path, **extra):
    data = {"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}, **extra}
    return load_config(data=data, base_dir=tmp_path)


def test_megatron_scheduler_drives_groups_in_proportion(tmp_path) -> None:
    cfg = _config(
        tmp_path,
        scheduler={
            "type": "megatron",
            "lr_decay_style": "linear",
            "lr_warmup_fraction": 0.2,
            "start_weight_decay": 0.0,
            "end_weight_decay": 0.1,
            "weight_decay_incr_style": "linear",
        },
    )
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    groups = param_groups(model, 0.05, 1.0)
    groups[0]["lr"] = 4.0  # a group with 4x the base LR (as LoRA+ makes)
    optimizer = torch.optim.AdamW(groups, lr=1.0, weight_decay=0.05)
    scheduler = build_megatron_scheduler(cfg.scheduler, optimizer, 10, None)  # type: ignore[arg-type]
    seen = []
    for _ in range(6):
        seen.append(
            [g["lr"] for g in optimizer.param_groups] + [g["weight_decay"] for g in optimizer.param_groups]
        )
        optimizer.step()
        scheduler.step()
    # warmup 2 steps (0.2 x 10), then linear to 0 at step 10; step 5 -> 5/8
    assert seen[0][:2] == pytest.approx([2.0, 0.5])
    assert seen[1][:2] == pytest.approx([4.0, 1.0])
    assert seen[5][:2] == pytest.approx([4 * 5 / 8, 5 / 8])
    assert seen[5][2:] == pytest.approx([0.05, 0.0])  # decay only where weight decay applies at all
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)  # checkpoints pickle it
    assert "schedule" not in scheduler.state_dict()


def test_megatron_config_errors(tmp_path) -> None:
    from posttrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _config(
            tmp_path,
            scheduler={
                "type": "megatron",
                "lr_decay_style": "WSD",
                "lr_warmup_iters": 5,
                "lr_warmup_fraction": 0.1,
            },
        )
    text = info.value.render()
    assert "lr_wsd_decay_iters" in text and "not both" in text
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, scheduler={"type": "megatron", "lr_decay_style": "exp"})
    assert "scheduler.lr_decay_style" in info.value.render()


def test_layerwise_lr_ratios() -> None:
    assert layer_ratio("model.embed_tokens.weight", 2, 0.5) == 0.5
    assert layer_ratio("model.layers.0.mlp.up_proj.weight", 2, 0.5) == pytest.approx(0.5 + 0.5 / 3)
    assert layer_ratio("model.layers.1.mlp.up_proj.weight", 2, 0.5) == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert layer_ratio("lm_head.weight", 2, 0.5) == 1.0
    assert layer_ratio("model.layers.1.mlp.up_proj.weight", 2, 1.0) == 1.0


def test_batch_sizes_from_a_total(tmp_path) -> None:
    cfg = _config(tmp_path, total_train_batch_size=12, max_per_device_train_batch_size=4)
    assert batch_sizes(cfg, 2) == BatchSizes(3, 2, 2)
    assert batch_sizes(cfg, 1) == BatchSizes(4, 3, 1)
    assert batch_sizes(_config(tmp_path, total_train_batch_size=8), 1) == BatchSizes(8, 1, 1)
    with pytest.raises(UserError, match="cannot be split over 5 processes"):
        batch_sizes(cfg, 5)


def test_effective_lr(tmp_path) -> None:
    common = {"lr": 1e-4, "lr_multiplier": 2.0, "lr_reference_batch_size": 4}
    sqrt = _config(tmp_path, total_train_batch_size=16, optimizer={**common, "lr_batch_size_scaling": "sqrt"})
    assert resolve(sqrt, 2)[2] == pytest.approx(4e-4)
    linear = _config(
        tmp_path, total_train_batch_size=16, optimizer={**common, "lr_batch_size_scaling": "linear"}
    )
    resolved, _, lr = resolve(linear, 2)
    assert lr == pytest.approx(8e-4) and resolved.optimizer.lr == lr and resolved.micro_batch_size == 8


def test_step_plan_with_and_without_rampup() -> None:
    sizes = BatchSizes(1, 4, 1)
    assert step_plan(10, 2, sizes, None) == [[4, 4, 2], [4, 4, 2]]
    # start 1, +1 every 2 samples (3 intervals over 6 samples) up to 4
    assert step_plan(12, 1, sizes, (1, 1, 6)) == [[1, 1, 2, 3, 4, 1]]
    assert "not a multiple of the increment" in rampup_problems((1, 2, 6), sizes)[0]


def test_megatron_scheduler_state_resumes_the_same_curve(tmp_path) -> None:
    cfg = _config(tmp_path, scheduler={"type": "megatron", "lr_decay_style": "cosine", "lr_warmup_iters": 2})

    def fresh():
        optimizer = torch.optim.AdamW(param_groups(torch.nn.Linear(2, 2), 0.1, 1.0), lr=1.0)
        return optimizer, build_megatron_scheduler(cfg.scheduler, optimizer, 10, None)  # type: ignore[arg-type]

    optimizer, scheduler = fresh()
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    saved = io.BytesIO()
    torch.save(scheduler.state_dict(), saved)
    expected = [scheduler.get_last_lr()[0]]
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        expected.append(scheduler.get_last_lr()[0])
    optimizer, scheduler = fresh()
    saved.seek(0)
    scheduler.load_state_dict(torch.load(saved, weights_only=False))
    optimizer.param_groups[0]["lr"] = scheduler.get_last_lr()[0]
    resumed = [scheduler.get_last_lr()[0]]
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        resumed.append(scheduler.get_last_lr()[0])
    assert resumed == pytest.approx(expected)
    assert expected[0] == pytest.approx(0.5 * (math.cos(math.pi * 2 / 8) + 1))  # step 4 of a 2 + 8 cosine


def test_a_one_step_run_trains_at_the_peak_and_idle_steps_are_said(tmp_path, caplog) -> None:
    """The default warmup (10%) of a one-step smoke run takes its only step: it trains at the peak, not at 0
    (transformers' decay would put it there); a schedule that leaves steps at lr 0 is said in one line."""
    import logging

    from posttrain.optim.schedulers import build_huggingface_scheduler

    def lrs(scheduler_config: dict, total: int) -> list[float]:
        config = _config(tmp_path, scheduler=scheduler_config)
        optimizer = torch.optim.AdamW(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        if config.scheduler.type == "megatron":
            scheduler = build_megatron_scheduler(config.scheduler, optimizer, total, None)  # type: ignore[arg-type]
        else:
            scheduler = build_huggingface_scheduler(config.scheduler, optimizer, total, None)  # type: ignore[arg-type]
        seen = []
        for _ in range(total):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    with caplog.at_level(logging.INFO, logger="posttrain"):
        logging.getLogger("posttrain").propagate = True
        try:
            for name in ("linear", "cosine", "constant_with_warmup"):
                assert lrs({"name": name}, 1) == [1.0], name
            assert lrs({"name": "linear"}, 10)[:3] == pytest.approx(
                [1.0, 1.0, 8 / 9]
            )  # transformers after it
            assert "learning rate 0" not in caplog.text
            megatron = {"type": "megatron", "lr_decay_style": "linear", "lr_decay_iters": 4, "min_lr": 0.0}
            assert lrs(megatron, 8)[4:] == [0.0] * 4
        finally:
            logging.getLogger("posttrain").propagate = False
    said = [r.getMessage() for r in caplog.records if "learning rate 0" in r.getMessage()]
    assert set(said) == {  # once (a handler another test left may capture it twice)
        "scheduler megatron (linear): 4 steps, from step 5 of the run's 8 train at learning rate 0, and nothing "
        "moves on them; check the schedule against train_iters (plot-lr draws it)"
    }


def test_warmup_steps_replaces_the_ratio(tmp_path) -> None:
    """``scheduler.warmup_steps`` (TrainingArguments' and Axolotl's name) warms up over that many updates, the
    first at ``peak / warmup_steps``; set beside a non-zero ``warmup_ratio`` it is refused."""
    from posttrain.config.errors import ConfigError
    from posttrain.optim.schedulers import build_huggingface_scheduler

    config = _config(tmp_path, scheduler={"name": "linear", "warmup_steps": 4})
    optimizer = torch.optim.AdamW(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    scheduler = build_huggingface_scheduler(config.scheduler, optimizer, 20, None)  # type: ignore[arg-type]
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 15 / 16])  # then transformers' decay
    with pytest.raises(ConfigError, match="warmup_steps or warmup_ratio, not both"):
        _config(tmp_path, scheduler={"name": "linear", "warmup_steps": 4, "warmup_ratio": 0.2})
