"""The pre-flight report (`posttrain preprocess`), `posttrain plot-lr`, mixing with a leak-free eval split,
and packing efficiency on the bundled examples."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.config import load_config
from posttrain.data.packing import packing_efficiency
from posttrain.preflight import preflight
from posttrain.testing.data import chat_rows, write_jsonl

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_preprocess_prints_the_report(base_config: dict, tmp_path: Path, capsys) -> None:
    config = {**base_config, "data": {**base_config["data"], "train_eval_split": [0.75, 0.25]}, "epochs": 2}
    assert main(["preprocess", str(_write(tmp_path, config))]) == 0
    report = capsys.readouterr().out
    for expected in (
        "64 rows read, 48 for training, 16 held out",
        "train: 48 rows ->",
        "trained",
        "padding: ",
        "eval rows identical to a training row: 0",
        "end-of-turn check: passed",
        "global batch 4 = micro-batch 4 x accumulation 1 x 1 processes",
        "in total",
        "sample 2 (trained tokens in [[...]])",
        "<|im_start|>assistant\n[[",
        "<|im_end|>]]",
    ):
        assert expected in report, expected
    assert not (Path(config["logger"]["output_dir"]) / "train-log-metrics.jsonl").exists()  # nothing trained
    assert main(["preprocess", str(_write(tmp_path, config)), "--world-size", "2"]) == 0
    assert "x 2 processes" in capsys.readouterr().out


def test_the_report_names_each_sequence_of_kto_and_reward_samples(
    base_config: dict, tmp_path: Path, capsys
) -> None:
    """Which completion is desirable or chosen, and what is only scored (KTO's KL sequence)."""
    import json

    rows = tmp_path / "feedback.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"reverse {n}", "completion": str(n)[::-1], "label": True}) + "\n"
            for n in (123, 456)
        )
    )
    kto = {**base_config, "type": "kto", "data": {**base_config["data"], "sources": [str(rows)]}}
    assert main(["preprocess", str(_write(tmp_path, kto))]) == 0
    report = capsys.readouterr().out
    assert "sample 1 (the completions' tokens the loss reads in [[...]])" in report
    assert "--- desirable completion (label true)" in report and "--- undesirable" not in report
    assert "--- KL baseline: this prompt with the next row's completion (scored, not trained)" in report
    pairs = str(EXAMPLES / "data" / "reward-train.jsonl")
    reward = {**base_config, "type": "reward", "data": {**base_config["data"], "sources": [pairs]}}
    assert main(["preprocess", str(_write(tmp_path, reward))]) == 0
    report = capsys.readouterr().out
    assert "--- chosen (to score higher)" in report and "--- rejected (to score lower)" in report


def test_missing_end_of_turn_is_an_error_naming_file_and_row(
    base_config: dict, tmp_path: Path, capsys
) -> None:
    template = tmp_path / "bad.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' }}"
        "{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    )
    config = {**base_config, "tokenizer": {"chat_template": str(template)}}
    assert main(["preprocess", str(_write(tmp_path, config))]) == 2
    error = capsys.readouterr().err
    assert "chat.jsonl row 1: assistant turn 1 ends with" in error and "Traceback" not in error
    config["data"] = {**config["data"], "check_end_of_turn": False}
    assert main(["preprocess", str(_write(tmp_path, config))]) == 0
    assert "end-of-turn check: OFF" in capsys.readouterr().out


def test_weighted_mix_split_before_oversampling(base_config: dict, tmp_path: Path) -> None:
    big = write_jsonl(tmp_path / "big.jsonl", chat_rows(40, seed=1))
    small = write_jsonl(tmp_path / "small.jsonl", chat_rows(8, seed=2))
    data = {
        **base_config["data"],
        "sources": [{"name_or_path": str(big)}, {"name_or_path": str(small), "sampling_weight": 3}],
        "mix": "weighted",
        "train_eval_split": [0.75, 0.25],
        "max_length": 128,
    }
    flight = preflight(load_config(data={**base_config, "data": data}), world_size=1)
    train = [tuple(s["input_ids"]) for s in flight.data.train]
    held = [tuple(s["input_ids"]) for s in flight.data.eval]
    assert len(held) == 10 + 2  # a quarter of each source
    assert len(train) > len(set(train))  # the small source is oversampled...
    assert not set(train) & set(held)  # ...and still no training row is in the eval set
    assert flight.data.train_report.leaked == 0
    # an eval file that repeats a training row is reported
    leaky = write_jsonl(tmp_path / "leaky.jsonl", chat_rows(40, seed=1)[:3])
    data = {**data, "train_eval_split": [1.0, 0.0], "eval_sources": [str(leaky)], "mix": "concatenate"}
    data["sources"] = [str(big)]
    assert (
        preflight(load_config(data={**base_config, "data": data}), world_size=1).data.train_report.leaked == 3
    )


@pytest.mark.parametrize(
    ("example", "overrides"),
    [
        ("sft-reverse.yaml", {"pack_samples": True, "max_length": 256}),
        ("causal-text.yaml", {"pack_samples": True}),
    ],
)
def test_best_fit_packing_reaches_95_percent_on_the_bundled_examples(
    example: str, overrides: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = yaml.safe_load((EXAMPLES / example).read_text())
    config["model"]["name_or_path"] = str(tiny_model_dir)
    config["logger"] = {"output_dir": str(tmp_path / "run")}
    config["checkpoint"] = []
    config["micro_batch_size"] = 1
    config["data"].update(overrides, use_data_cache=False)
    config["data"]["sources"] = [str(EXAMPLES.parent / s) for s in config["data"]["sources"]]
    config["data"]["eval_sources"] = [
        str(EXAMPLES.parent / s) for s in config["data"].get("eval_sources", [])
    ]
    flight = preflight(load_config(data=config), world_size=1)
    efficiency = packing_efficiency(flight.data.train, flight.max_length)
    assert efficiency >= 0.95, efficiency


def test_plot_lr_writes_a_png(base_config: dict, tmp_path: Path, capsys) -> None:
    config = {
        **base_config,
        "train_iters": 40,
        "scheduler": {"type": "megatron", "lr_decay_style": "cosine", "lr_warmup_iters": 4, "min_lr": 1e-5},
    }
    out = tmp_path / "lr.png"
    assert main(["plot-lr", str(_write(tmp_path, config)), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "40 steps" in capsys.readouterr().out
    assert not list(tmp_path.glob(".lr.tmp-*"))  # atomic_write's temporary file is gone


def test_preset_with_new_tokens_grows_embeddings_and_exports_them(base_config: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.run import run

    export = tmp_path / "export"
    config = {
        **base_config,
        "train_iters": 2,
        "tokenizer": {"chat_template": "llama3"},
        "checkpoint": [{"output_dir": str(export), "save_end_of_training": True}],
    }
    result = run(load_config(data=config))
    tokenizer = AutoTokenizer.from_pretrained(export / "final")
    assert "<|eot_id|>" in tokenizer.get_vocab() and "<|eot_id|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(export / "final")
    assert model.get_input_embeddings().num_embeddings == len(tokenizer) == 1024 + 3
    assert result.model.get_input_embeddings().num_embeddings == len(tokenizer)


def test_the_report_says_what_the_run_will_do(base_config: dict, tmp_path: Path, capsys) -> None:
    """Padding-free batches are not described as padded; truncated answers are not claimed to end well."""
    free = {**base_config, "data": {**base_config["data"], "padding_free": True}}
    assert main(["preprocess", str(_write(tmp_path, free))]) == 0
    report = capsys.readouterr().out
    assert "padding-free: each micro-batch's 4 samples are joined into one row" in report
    assert "padded micro-batches" not in report
    cut = {**base_config, "data": {**base_config["data"], "max_length": 24, "overlong_samples": "truncate"}}
    assert main(["preprocess", str(_write(tmp_path, cut))]) == 0
    report = capsys.readouterr().out
    assert "end-of-turn check: passed before truncation; the last answer of the" in report
    assert "passed (every assistant turn" not in report
