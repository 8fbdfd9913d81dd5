"""A real SFT run on the tiny model: loss falls, metrics and checkpoints are written and reload exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config import load_config
from posttrain.run import run
from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.integration


def test_loss_falls_metrics_and_checkpoint(base_config: dict, tmp_path: Path) -> None:
    config = merge(
        base_config,
        epochs=3,
        data={"train_eval_split": [0.875, 0.125]},
        eval_interval=8,
        optimizer={"lr": 3e-3},
        checkpoint=[
            {"output_dir": str(tmp_path / "ckpt"), "save_end_of_training": True, "save_every_n_steps": 10}
        ],
    )
    result = train(config)
    lines = metrics(config)
    final_eval = lines.pop()  # eval_at_end: one more evaluation after the last step
    assert set(final_eval) == {"iter", "epoch", "eval_loss", "eval_perplexity", "time"}
    assert final_eval["iter"] == 42 and final_eval["eval_perplexity"] == pytest.approx(
        math.exp(final_eval["eval_loss"])
    )
    assert len(lines) == 42 == result.state.step  # 56 training rows / 4 per step = 14 steps x 3 epochs
    keys = (
        "iter",
        "epoch",
        "loss",
        "perplexity",
        "lr",
        "grad_norm",
        "tokens",
        "step_time",
        "tokens_per_second",
    )
    for key in keys:
        assert key in lines[0], key
    assert [line["iter"] for line in lines] == list(range(1, 43))
    assert [line["epoch"] for line in lines[::14]] == [0, 1, 2]
    first, last = sum(x["loss"] for x in lines[:3]) / 3, sum(x["loss"] for x in lines[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    evals = [line for line in lines if "eval_loss" in line]
    assert [line["iter"] for line in evals] == [8, 16, 24, 32, 40]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(line["tokens"] > 0 and line["grad_norm"] > 0 for line in lines)

    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "final",
        "global_step_10",
        "global_step_20",
        "global_step_30",
        "global_step_40",
    ]
    assert (ckpt / "final" / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt / "final", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "final")
    ids = tokenizer("reverse 12345", return_tensors="pt")["input_ids"]
    result.model.cpu().eval()  # compared with the export loaded on the CPU
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, result.model(ids).logits, atol=1e-6)
    assert not any(p.name.startswith(".") for p in ckpt.iterdir())  # no temporary directories left behind


def test_save_every_n_epochs(base_config: dict, tmp_path: Path) -> None:
    config = merge(
        base_config, epochs=4, checkpoint=[{"output_dir": str(tmp_path / "ckpt"), "save_every_n_epochs": 2}]
    )
    train(config)  # 16 steps per epoch
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step_32", "global_step_64"]


def test_activation_checkpointing_and_bf16_dtype_train(base_config: dict) -> None:
    config = merge(
        base_config, train_iters=2, model={"disable_activation_checkpoint": False, "dtype": "bfloat16"}
    )
    result = train(config)
    assert result.state.step == 2
    assert next(result.model.parameters()).dtype == torch.bfloat16
    assert result.model.is_gradient_checkpointing


def test_zero_stages_agree_on_one_process(base_config: dict, tmp_path: Path) -> None:
    from tests.integration.helpers import max_diff, weights

    # stages 1 and 2 run as stage 0 on one process (tests/unit/test_optim_and_deepspeed.py); they are
    # compared with stage 0 across two processes in tests/distributed
    results = {}
    for stage in (0, 3):
        config = merge(
            base_config,
            train_iters=2,
            # eps=1, no clipping: Adam's step ~ lr * g, so float noise in near-zero gradients is not blown up
            # to ~lr (see tests/distributed/test_two_processes.py); weight decay on (once, ZeRO-3's partitioned
            # matrices were put in the no-decay group: 1-D placeholders)
            optimizer={"lr": 0.5, "eps": 1.0, "weight_decay": 0.1},
            deepspeed={"zero_optimization": {"stage": stage}, "gradient_clipping": 0.0},
            logger={"output_dir": str(tmp_path / f"run{stage}")},
            checkpoint=[{"output_dir": str(tmp_path / f"ckpt{stage}"), "save_end_of_training": True}],
        )
        result = train(config)
        norms = [h["grad_norm"] for h in result.state.history]
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / f"ckpt{stage}" / "final", dtype=torch.float32)
        results[stage] = (norms, weights(saved))
    for stage in (3,):
        assert results[stage][0] == pytest.approx(results[0][0], rel=1e-4), stage
        assert max_diff(results[stage][1], results[0][1]) < 1e-5, stage


def test_zero3_creates_the_model_partitioned(base_config: dict, tmp_path: Path) -> None:
    from posttrain.config import load_config
    from posttrain.config.deepspeed import build_deepspeed_config
    from posttrain.context import RunContext
    from posttrain.dist import init_distributed
    from posttrain.registry import MODEL_FACTORIES
    from posttrain.stages.model import zero3_registration

    config = load_config(data=merge(base_config, deepspeed={"zero_optimization": {"stage": 3}}))
    ctx = RunContext(config, init_distributed())
    ds_config = build_deepspeed_config(config, world_size=1, hidden_size=64)
    keep = zero3_registration(ds_config)
    try:
        model = MODEL_FACTORIES.get("huggingface").obj(config.model, ctx)
    finally:
        del keep
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") for p in params)  # created under deepspeed.zero.Init
    assert sum(p.numel() for p in params) == 0  # only partition placeholders live on the module
    assert sum(p.ds_numel for p in params) > 100_000


def test_model_loading_arguments_and_the_token_never_written(base_config, monkeypatch, capsys) -> None:
    secret = "hf_posttrain_test_secret_4f2a"
    monkeypatch.setenv("POSTTRAIN_TEST_TOKEN", secret)
    config = merge(
        base_config,
        train_iters=2,
        model={
            "dtype": "auto",
            "revision": "main",
            "token_env": "POSTTRAIN_TEST_TOKEN",
            "low_cpu_mem_usage": True,
        },
    )
    loaded = load_config(data=config)
    assert loaded.model.hub_arguments() == {"trust_remote_code": False, "revision": "main", "token": secret}
    result = run(loaded)
    assert next(result.model.parameters()).dtype == torch.float32  # the tiny checkpoint's own dtype
    assert "model.dtype auto: float32" in capsys.readouterr().out
    written = [p for p in Path(config["logger"]["output_dir"]).rglob("*") if p.is_file()]
    assert written and not [p for p in written if secret.encode() in p.read_bytes()]


def test_hf_config_kwargs_override_the_checkpoints_config(base_config: dict) -> None:
    """ArcticTraining's ``model.hf_config_kwargs``: the facts, the memory plan and the loaded model all read
    the overridden config."""
    from posttrain.config.model import ModelConfig
    from posttrain.memory.shape import model_shape
    from posttrain.registry import MODEL_FACTORIES

    overrides = {"rms_norm_eps": 1e-3, "max_position_embeddings": 96}
    model = ModelConfig(name_or_path=base_config["model"]["name_or_path"], hf_config_kwargs=overrides)
    assert MODEL_FACTORIES.get("huggingface").obj.facts(model).max_positions == 96
    assert model_shape(model).params > 0
    config = merge(base_config, model={"hf_config_kwargs": overrides}, train_iters=1)
    result = train(config)
    assert result.model.config.rms_norm_eps == 1e-3 and result.model.config.max_position_embeddings == 96
