from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError, load_config

GOOD = """\
model:
  name_or_path: some/model
data:
  sources:
    - train.jsonl
"""


def errors_of(text: str, tmp_path: Path, overrides: list[str] | None = None) -> ConfigError:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def test_good_config_fills_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.type == "sft"
    assert config.model.type == "huggingface" and config.model.dtype == "bfloat16"
    assert config.tokenizer.name_or_path == "some/model"
    assert config.data.type == "sft" and config.data.sources[0].type == "local"
    assert (
        config.optimizer.type == "adamw"
        and config.optimizer.lr == 5e-4
        and config.optimizer.weight_decay == 0.1
    )
    assert config.scheduler.type == "huggingface" and config.scheduler.name == "linear"
    assert config.logger.output_dir == "runs/run"
    assert config.kill_switch_path == "runs/run/kill-switch"
    assert config.train_log_metrics_path == "runs/run/train-log-metrics.jsonl"


def test_every_seed_key_is_accepted_at_its_default(tmp_path: Path) -> None:
    keys = {
        "type": "sft", "skip_validation": False, "epochs": 1, "loss_log_interval": 1, "train_log_iter_interval": 1,
        "gradient_accumulation_steps": 1, "micro_batch_size": 1, "sequence_parallel_size": 1,
        "activation_checkpoint_cpu_offload": False, "tiled_mlp_compute": False, "seed": 42, "checkpoint": [],
        "train_iters": 0, "eval_interval": 0, "eval_log_iter_interval": 1, "exit_iteration": 0,
        "exit_iteration_this_run": 0, "min_iterations": 0, "overfit_first_batch": False, "mem_profiler": None,
        "mem_profiler_max_entries": 100000, "deepspeed": {}, "wandb": {"enable": False, "entity": None, "name": None},
        "logger": {"level": "WARNING", "print_output_ranks": [0], "file_output_ranks": "*"},
        "tokenizer": {"type": "huggingface", "name_or_path": ""},
        "optimizer": {"type": "adamw", "weight_decay": 0.1, "betas": [0.9, 0.999], "lr": 5e-4},
        "scheduler": {"type": "huggingface", "lr": None},
        "model": {"type": "huggingface", "name_or_path": "m", "dtype": "torch.bfloat16", "save_name": None,
                  "attn_implementation": "sdpa", "disable_activation_checkpoint": False, "peft_config": None},
        "data": {"type": "sft", "sources": [{"type": "local", "name_or_path": "a.jsonl", "split": "", "sample_ratio": None,
                 "sample_count": None, "sample_seed": 42, "process": True}], "eval_sources": [],
                 "train_eval_split": [1.0, 0.0], "max_length": 8192, "num_proc": 16, "dl_num_workers": 2, "seed": 42,
                 "use_data_cache": None, "cache_processed_data": None, "cache_fs_type": "auto"},
    }  # fmt: skip
    config = load_config(data=keys, base_dir=tmp_path)
    assert config.model.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("overrides", "paths", "says"),
    [
        (["enable_routing_replay=true"], ["enable_routing_replay"], "no later pass to replay"),
        (["enable_arctic_moe_custom_optimization=true"], ["enable_arctic_moe_custom_optimization"], "CUDA"),
        (
            ["expert_parallel_size=2", "deepspeed.zero_optimization.stage=3"],
            ["deepspeed.zero_optimization.stage"],
            "use stage 0, 1 or 2",
        ),
        (
            ["expert_parallel_size=2", "deepspeed.zero_optimization.offload_param.device=cpu"],
            ["deepspeed.zero_optimization.stage"],
            "implied by offload_param",
        ),
        (
            ["expert_parallel_size=2", "sequence_parallel_size=2", "model.compile=true"],
            ["sequence_parallel_size", "model.compile", "model.compile"],
            "expert_parallel_size=2",
        ),
        (["expert_parallel_size=2", "arctic_moe=false"], ["arctic_moe"], "contradicts"),
    ],
    ids=[
        "routing-replay",
        "custom-kernels",
        "ep-zero3",
        "ep-param-offload",
        "ep-sp-compile",
        "ep-without-grouped",
    ],
)
def test_moe_combinations_that_cannot_run_are_refused(
    tmp_path: Path, overrides: list[str], paths: list[str], says: str
) -> None:
    error = errors_of(GOOD, tmp_path, overrides)
    assert sorted(issue.path for issue in error.issues) == sorted(paths), error.render()
    assert says in error.render()


def test_expert_parallelism_alone_is_a_valid_config(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    config = load_config(path, ["expert_parallel_size=2", "arctic_moe=auto"])
    assert config.expert_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "path", "says"),
    [
        (
            ["sequence_parallel_size=2", "model.attn_implementation=eager"],
            "model.attn_implementation",
            "sdpa",
        ),
        (
            ["activation_checkpoint_cpu_offload=true", "model.disable_activation_checkpoint=true"],
            "activation_checkpoint_cpu_offload",
            "disable_activation_checkpoint: false",
        ),
        (["type=dpo", "sequence_parallel_size=2"], "sequence_parallel_size", "dpo does not support"),
        (["tiled_loss_compute=sometimes"], "tiled_loss_compute", "auto"),
    ],
)
def test_long_sequence_settings_that_cannot_work_are_refused(
    tmp_path: Path, overrides: list[str], path: str, says: str
) -> None:
    error = errors_of(GOOD, tmp_path, overrides)
    assert path in [issue.path for issue in error.issues]
    assert says in error.render()


def test_long_sequence_settings_validate(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    config = load_config(
        path,
        overrides=[
            "sequence_parallel_size=2",
            "tiled_mlp_compute=true",
            "activation_checkpoint_cpu_offload=true",
            "tiled_loss_compute=true",
        ],
    )
    assert (config.sequence_parallel_size, config.tiled_mlp_compute, config.tiled_loss_compute) == (
        2,
        True,
        True,
    )


def test_duplicate_keys_name_both_lines(tmp_path: Path) -> None:
    error = errors_of(GOOD + "epochs: 2\nepochs: 3\n", tmp_path)
    (issue,) = error.issues
    assert issue.path == "epochs"
    assert "first on line 6, again on line 7" in issue.message
    assert issue.where.endswith("run.yaml:7")


def test_unknown_key_with_suggestion(tmp_path: Path) -> None:
    error = errors_of(GOOD + "optimizer:\n  lrr: 1e-4\n", tmp_path)
    (issue,) = error.issues
    assert issue.path == "optimizer.lrr"
    assert "did you mean 'lr'?" in issue.message
    assert issue.where.endswith("run.yaml:7")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    error = errors_of(GOOD + "micro_batch_sise: 4\n", tmp_path)
    assert "did you mean 'micro_batch_size'?" in error.issues[0].message


def test_all_errors_at_once_with_paths_and_lines(tmp_path: Path) -> None:
    text = """\
model:
  name_or_path: m
  dtype: float99
data:
  sources:
    - name_or_path: a.jsonl
      sample_ratio: 1.5
  max_length: 2.5K5
epochs: -1
micro_batch_size: many
optimizer:
  type: adamz
"""
    error = errors_of(text, tmp_path)
    found = {issue.path: issue for issue in error.issues}
    assert set(found) == {
        "model.dtype",
        "data.sources[0].sample_ratio",
        "data.max_length",
        "epochs",
        "micro_batch_size",
        "optimizer.type",
    }
    assert found["data.sources[0].sample_ratio"].where.endswith(":7")
    assert "less than or equal to 1" in found["data.sources[0].sample_ratio"].message
    assert found["epochs"].where.endswith(":9")
    assert "unknown optimizer type 'adamz'" in found["optimizer.type"].message
    assert "did you mean 'adamw'" in found["optimizer.type"].message
    assert "registered: adamw" in found["optimizer.type"].message
    assert "unknown dtype 'float99'" in found["model.dtype"].message


def test_unknown_trainer_type_lists_registered(tmp_path: Path) -> None:
    error = errors_of("type: sfft\n" + GOOD, tmp_path)
    assert error.issues[0].path == "type"
    assert "did you mean 'sft'" in error.issues[0].message


def test_missing_required_keys(tmp_path: Path) -> None:
    error = errors_of("epochs: 1\n", tmp_path)
    assert {issue.path for issue in error.issues} == {"model", "data"}
    assert all("required" in issue.message for issue in error.issues)


def test_cross_field_errors(tmp_path: Path) -> None:
    text = (
        GOOD.replace("    - train.jsonl\n", "    - train.jsonl\n  pack_samples: true\n")
        + "micro_batch_size: 4\n"
    )
    error = errors_of(text, tmp_path)
    assert "pack_samples=true needs micro_batch_size: 1 (got 4)" in error.render()
    error = errors_of(GOOD + "eval_interval: 10\n", tmp_path)
    assert "eval_interval" in error.render() and "needs eval data" in error.render()
    split = GOOD.replace("train.jsonl", "train.jsonl\n  train_eval_split: [0.9, 0.1]")
    error = errors_of(split + "eval_at_end: false\n", tmp_path)
    assert "eval data is configured but never used" in error.render()
    assert "eval_on_start: true" in error.render()
    loaded = load_config(text=split + "eval_at_end: false\neval_on_start: true\n", base_dir=tmp_path)
    assert loaded.eval_on_start and not loaded.eval_at_end  # the held-out loss at step 0 uses the eval data
    error = errors_of(GOOD + "skip_train: true\n", tmp_path)
    assert "skip_train: evaluates only" in error.render()
    error = errors_of(GOOD + "total_train_batch_size: 8\nmicro_batch_size: 2\n", tmp_path)
    assert "derived from total_train_batch_size" in error.render()


def test_keys_of_another_mode_are_warned_about_the_same_way(tmp_path: Path, capsys) -> None:
    from posttrain.config.mode_keys import inert_warnings

    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    written = [
        "manual_gc_interval=5",
        "max_per_device_train_batch_size=2",
        "optimizer.lora_plus_scale=16",
        "profiling.profile_step_start=3",
        "wandb.project=p",
        "tensorboard.log_dir=tb",
        "data.sources[0].sample_seed=3",
    ]
    warnings = inert_warnings(load_config(path, written))
    assert len(warnings) == len(written), warnings
    assert "manual_gc_interval has no effect: it is used only with manual_gc: true" in warnings
    assert "optimizer.lora_plus_scale has no effect: it is used only with LoRA adapters" in " ".join(warnings)
    assert inert_warnings(load_config(path)) == []  # defaults are never reported
    on = [
        "manual_gc=true",
        "manual_gc_interval=5",
        "wandb.enable=true",
        "wandb.project=p",
        "wandb.mode=offline",
    ]
    assert inert_warnings(load_config(path, on)) == []
    dpo = ["type=dpo", "loss_type=ipo", "label_smoothing=0.1", "simpo_gamma=1"]
    assert {w.split()[0] for w in inert_warnings(load_config(path, dpo))} == {
        "label_smoothing",
        "simpo_gamma",
    }
    assert main(["validate", str(path), "manual_gc_interval=5"]) == 0
    assert "warning: manual_gc_interval has no effect" in capsys.readouterr().err


def test_overrides_validated_like_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    config = load_config(path, ["optimizer.lr=1e-4", "data.max_length=2Ki", "data.sources[0].sample_count=5"])
    assert config.optimizer.lr == 1e-4 and config.data.max_length == 2048
    assert config.data.sources[0].sample_count == 5
    error = errors_of(GOOD, tmp_path, ["optimizer.lr=-1", "optimiser.lr=1"])
    assert {i.path: i.where for i in error.issues} == {
        "optimizer.lr": "command line",
        "optimiser": "command line",
    }


def test_type_not_accepted_by_trainer(tmp_path: Path) -> None:
    error = errors_of(
        GOOD + "checkpoint:\n  - type: huggingface\n    output_dir: out\n    auto_resume: true\n", tmp_path
    )
    assert error.issues[0].path == "checkpoint[0].auto_resume"


def test_missing_code_file_is_an_error(tmp_path: Path) -> None:
    error = errors_of("code: nope.py\n" + GOOD, tmp_path)
    assert error.issues[0].path == "code" and "no such file" in error.issues[0].message


def test_yaml_syntax_error(tmp_path: Path) -> None:
    error = errors_of("model: [unclosed\n", tmp_path)
    assert "invalid YAML" in error.render() and "run.yaml:" in error.render()


def test_validate_is_pure_and_prints_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.yaml").write_text(GOOD)
    before = set(os.listdir(tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["validate", "run.yaml", "--json"]) == 0
    finally:
        os.chdir(cwd)
    assert set(os.listdir(tmp_path)) == before  # nothing created: no runs/, no metrics file
    data = json.loads(capsys.readouterr().out)
    assert data["optimizer"]["lr"] == 5e-4 and data["data"]["max_length"] == 8192
    assert data["scheduler"]["warmup_ratio"] == 0.1
    # issue #5's options are shown with their defaults
    assert data["tokenizer"]["chat_template"] == "keep-original"
    assert data["tokenizer"]["missing_pad_token_strategy"] == "bos-repurpose"
    assert (data["data"]["mix"], data["data"]["mix_seed"], data["data"]["split_seed"]) == (
        "concatenate",
        19851243,
        None,
    )
    assert data["data"]["sources"][0]["sampling_weight"] == 1.0 and data["data"]["check_end_of_turn"] is True
    assert (
        data["optimizer"]["lr_batch_size_scaling"] == "none"
        and data["optimizer"]["layerwise_lr_decay_bound"] == 1.0
    )
    for key in (
        "total_train_batch_size",
        "rampup_batch_size",
        "eval_iters",
        "exit_interval",
        "manual_gc",
        "skip_train",
    ):
        assert key in data, key


def test_megatron_scheduler_validates_and_documents_its_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run.yaml").write_text(
        GOOD + "scheduler:\n  type: megatron\n  lr_decay_style: WSD\n  lr_wsd_decay_iters: 10\n"
    )
    assert main(["validate", str(tmp_path / "run.yaml"), "--json"]) == 0
    scheduler = json.loads(capsys.readouterr().out)["scheduler"]
    assert scheduler["lr_wsd_decay_style"] == "exponential" and scheduler["min_lr"] == 0.0
    assert main(["schema"]) == 0
    schema = capsys.readouterr().out
    for text in ("inverse-square-root", "sampling_weight", "missing_pad_token_strategy", "rampup_batch_size"):
        assert text in schema, text


def test_cli_exit_code_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.yaml").write_text(GOOD + "epochs: 2\nepochs: 3\nbogus: 1\n")
    assert main(["validate", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert "2 config errors" in err and "Traceback" not in err


def test_peft_config_is_validated_by_peft(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    config = load_config(
        path, ["model.peft_config={r: 8, lora_alpha: 16, target_modules: all-linear, use_dora: true}"]
    )
    assert config.model.peft_config["r"] == 8
    error = errors_of(GOOD, tmp_path, ["model.peft_config={rr: 8}"])
    assert error.issues[0].path == "model.peft_config"
    assert "unknown LORA keys: 'rr' (did you mean 'r'?)" in error.issues[0].message
    error = errors_of(GOOD, tmp_path, ["model.peft_config={peft_type: LORAX}"])
    assert "unknown peft_type 'LORAX'; did you mean 'LORA'?" in error.render()
    error = errors_of(GOOD, tmp_path, ["model.quantization_config={load_in_4bit: true}"])
    assert "add peft_config (QLoRA)" in error.render()


def test_bad_process_counts_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.yaml").write_text(GOOD)
    assert main(["train", str(tmp_path / "run.yaml"), "--nproc", "0"]) == 2
    assert main(["preprocess", str(tmp_path / "run.yaml"), "--world-size", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        "--nproc 0: must be >= 1" in err and "--world-size 0: must be >= 1" in err and "Traceback" not in err
    )


@pytest.mark.parametrize(
    ("overrides", "path", "says"),
    [
        (
            ["data.sources=[{name_or_path: train.jsonl, split: 'train[:10%]'}]"],
            "data.sources[0].split",
            "read whole",
        ),
        (
            ["data.eval_sources=[{name_or_path: eval.jsonl, sampling_weight: 0}]", "eval_interval=5"],
            "data.eval_sources[0].sampling_weight",
            "used whole",
        ),
        (["deepspeed.train_batch_size=64"], "deepspeed.train_batch_size", "micro_batch_size"),
        (["deepspeed.optimizer={type: Adam}"], "deepspeed.optimizer", "top-level optimizer:"),
        (["deepspeed.scheduler={type: WarmupLR}"], "deepspeed.scheduler", "top-level scheduler:"),
        (["model.quantization_config={load_in_4bits: true}"], "model.quantization_config", "load_in_4bit"),
        (
            ["scheduler.name=constant", "scheduler.warmup_ratio=0.1"],
            "scheduler.warmup_ratio",
            "constant_with_warmup",
        ),
        (
            ["scheduler.name=cosine", "scheduler.scheduler_kwargs={num_cycle: 2}"],
            "scheduler.scheduler_kwargs.num_cycle",
            "num_cycles",
        ),
        (["type=dpo", "ref_model={name_or_path: m, save_name: x}"], "ref_model.save_name", "never saved"),
        (["deepspeed.zero_optimization.stage=5"], "deepspeed.zero_optimization.stage", "DeepSpeedZeroConfig"),
        (
            ["deepspeed.zero_optimization.offload_optimizr={device: cpu}"],
            "deepspeed.zero_optimization.offload_optimizr",
            "did you mean 'offload_optimizer'?",
        ),
        (["deepspeed.bf16.enabld=true"], "deepspeed.bf16.enabld", "did you mean 'enabled'?"),
        (["model.low_cpu_mem_usage=false"], "model.low_cpu_mem_usage", "always loads"),
        (["deepspeed.gradient_clip=1.0"], "deepspeed.gradient_clip", "did you mean 'gradient_clipping'?"),
        (["optimizer.type=cpu_adam"], "optimizer.type", "offload_optimizer.device: cpu"),
        (
            [
                "optimizer.type=fused_adam",
                "deepspeed.zero_optimization={stage: 2, offload_optimizer: {device: cpu}}",
            ],
            "optimizer.type",
            "use cpu_adam",
        ),
        (
            ["deepspeed.zero_optimization={stage: 0, offload_optimizer: {device: cpu}}"],
            "deepspeed.zero_optimization.stage",
            "cannot offload the optimizer",
        ),
    ],
)
def test_settings_that_would_be_ignored_are_refused(
    tmp_path: Path, overrides: list[str], path: str, says: str
) -> None:
    error = errors_of(GOOD, tmp_path, overrides)
    assert path in [issue.path for issue in error.issues], error.render()
    assert says in error.render()


def test_aliases_work_in_both_directions_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD + "optimizer:\n  learning_rate: 1e-4\neval_frequency: 3\nmax_evaluate_steps: 2\n")
    path.with_name("eval.jsonl").write_text("")
    overrides = ["optimizer.lr=2e-4", "eval_iters=5", "eval_interval=7", "data.train_eval_split=[0.9, 0.1]"]
    config = load_config(path, overrides)
    assert (config.optimizer.lr, config.eval_iters, config.eval_interval) == (2e-4, 5, 7)
    config = load_config(path, ["optimizer.learning_rate=3e-4", "data.train_eval_split=[0.9, 0.1]"])
    assert (config.optimizer.lr, config.eval_interval, config.eval_iters) == (3e-4, 3, 2)


def test_a_config_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(GOOD.encode() + "# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "not UTF-8 text (byte 0xe9" in info.value.render()


@pytest.mark.parametrize(
    ("method", "key", "says"),
    [
        ("dpo", "pack_samples=true", "preference pairs are batched as pairs, not packed"),
        ("dpo", "padding_free=true", "batched as padded pairs"),
        ("causal", "padding_free=true", "holds no padding"),
        ("causal", "overlong_samples=truncate", "always cut into max_length chunks"),
    ],
)
def test_sample_layout_keys_a_method_does_not_honour_are_refused(
    tmp_path: Path, method: str, key: str, says: str
) -> None:
    """The layout keys are declared once on the data config; a method that does not honour one says so."""
    error = errors_of(GOOD, tmp_path, [f"type={method}", f"data.{key}"])
    assert f"data.{key.split('=')[0]}" in [issue.path for issue in error.issues], error.render()
    assert says in error.render() and "remove the key" in error.render()


def test_an_unknown_top_level_key_names_the_closest_not_all_sixty(tmp_path: Path) -> None:
    from posttrain.config import load_config
    from posttrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(
            data={"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}, "eval_intervall": 5}
        )
    message = str(caught.value)
    assert (
        "did you mean 'eval_interval'?" in message and "keys in all: `posttrain schema --markdown`" in message
    )
    assert "kill_switch_path" not in message and len(message) < 400


@pytest.mark.parametrize(
    ("key", "close", "not_close"),
    [
        # a key of another trainer shares only "model" with the allowed ones: no unrelated key is named
        ("teacher_model_name_or_path", ["model"], ["check_memory", "train_log_metrics_path", "scheduler"]),
        ("micro_batch", ["micro_batch_size"], ["check_memory", "seed"]),
        ("eval_every", ["eval_interval", "eval_iters", "eval_on_start"], ["kill_switch_path"]),
        ("exit_iterations", ["exit_iteration", "exit_iteration_this_run", "min_iterations"], ["seed"]),
    ],
)
def test_unknown_keys_suggest_only_keys_close_by_spelling_or_a_shared_word(
    key: str, close: list[str], not_close: list[str]
) -> None:
    from posttrain.config import load_config
    from posttrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(data={"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}, key: 5})
    message = str(caught.value)
    named = message.split("(close: ", 1)[1].split(";", 1)[0].split(", ")
    assert set(close) <= set(named) and not set(not_close) & set(named), named


def test_an_unknown_key_close_to_nothing_gets_the_pointer_alone() -> None:
    from posttrain.config import load_config
    from posttrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(
            data={"model": {"name_or_path": "m"}, "data": {"sources": ["d.jsonl"]}, "lerning_rate": 1}
        )
    message = str(caught.value)
    assert "close:" not in message and "did you mean" not in message
    assert "keys in all: `posttrain schema --markdown` or docs/reference.md" in message
