"""``posttrain eval``: lm-evaluation-harness tasks on a local model directory give the harness's own numbers
(its command line on the same model, task and settings), on a CPU without naming a device; bad input is one
line each, exit 2, before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.testing.env import child_env

pytestmark = pytest.mark.integration
pytest.importorskip("lm_eval")

#: a local multiple-choice task on the demo's prompts: the log-likelihood of each choice, so even a random
#: model gets an accuracy that is not 0 or 1 (a number both runs must reproduce to the last digit)
TASK = """
task: reverse_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt[0].content}}}} ->"
doc_to_choice: "{{{{[answer, prompt[0].content[8:], answer[1:] + answer[0]]}}}}"
doc_to_target: 0
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata:
  version: 1.0
"""
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "reverse-prompts-eval.jsonl"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("harness-tasks")
    (folder / "reverse_choice.yaml").write_text(TASK.format(data=DATA))
    return folder


def test_the_harness_numbers_on_a_cpu(
    tiny_model_dir: Path, tasks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """posttrain eval --json prints the harness's results dict, with the value lm_eval's own command line
    gives on the same model, task and settings, and --output-path writes the same JSON."""
    out = tmp_path / "posttrain.json"
    options = [
        "--tasks",
        "reverse_choice",
        "--include-path",
        str(tasks),
        "--limit",
        "24",
        "--batch-size",
        "4",
    ]
    assert main(["eval", str(tiny_model_dir), *options, "--json", "--output-path", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    ours = printed["results"]["reverse_choice"]
    assert json.loads(out.read_text())["results"]["reverse_choice"] == ours
    assert 0 < ours["acc,none"] < 1 and ours["acc,none"] * 24 == round(ours["acc,none"] * 24)

    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--device", "cpu"]
    command += ["--model_args", f"pretrained={tiny_model_dir},dtype=auto,tokenizer={tiny_model_dir}"]
    command += [
        "--tasks",
        "reverse_choice",
        "--include_path",
        str(tasks),
        "--limit",
        "24",
        "--batch_size",
        "4",
    ]
    command += ["--output_path", str(tmp_path / "harness")]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = next((tmp_path / "harness").rglob("results_*.json"))
    theirs = json.loads(written.read_text())["results"]["reverse_choice"]
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none"):
        assert ours[metric] == theirs[metric], metric


def test_bad_input_is_a_line_each_before_the_model_loads(
    tiny_model_dir: Path, tasks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.yaml").write_text("task: bad\ndoc_to_text: [unclosed\n")
    assert main(["eval", str(tmp_path / "nowhere"), "--tasks", "x", "--include-path", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "nowhere: no such export directory" in err and "bad.yaml: not a task YAML" in err
    assert "Traceback" not in err

    assert main(["eval", str(tiny_model_dir), "--tasks", "reverse_choise", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert "--tasks reverse_choise: no such harness task (close: reverse_choice" in err

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["eval", str(tiny_model_dir), "--tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err
    assert (
        "arc_easy: its dataset allenai/ai2_arc is on the Hugging Face Hub and this machine is offline" in err
    )
    assert "Traceback" not in err


def test_an_adapter_is_evaluated_on_its_base(tmp_path: Path) -> None:
    from posttrain.inference.harness import Evaluation, model_arguments

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    (adapter / "tokenizer_config.json").write_text("{}")
    assert model_arguments(Evaluation(adapter, ("t",))) == (
        "hf",
        {"pretrained": "/models/base", "dtype": "auto", "tokenizer": str(adapter), "peft": str(adapter)},
    )
    name, arguments = model_arguments(Evaluation(adapter, ("t",), backend="vllm"))
    assert name == "vllm" and arguments["lora_local_path"] == str(adapter) and arguments["enable_lora"]


def test_the_card_shows_each_task_before_and_after_with_the_base_cached(
    tiny_model_dir: Path, tasks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    export = tmp_path / "export"
    shutil.copytree(tiny_model_dir, export)
    (export / "README.md").write_text(
        f"---\nbase_model: {tiny_model_dir}\n---\n\n# fine-tuned\n\n## Use\n\nload it\n"
    )
    options = ["--tasks", "reverse_choice", "--include-path", str(tasks), "--limit", "8", "--card"]
    assert main(["eval", str(export), *options]) == 0
    assert "from the cache" not in capsys.readouterr().err
    assert main(["eval", str(export), *options]) == 0  # the base's scores now come from the cache
    assert "(before: reverse_choice from the cache)" in capsys.readouterr().err
    card = (export / "README.md").read_text()
    assert card.count("## Evaluation (lm-evaluation-harness)") == 1 and "## Use\n\nload it" in card
    assert "lm-evaluation-harness 0.4" in card and "limit 8" in card
    rows = [line for line in card.splitlines() if line.startswith("| reverse_choice | acc |")]
    assert len(rows) == 1 and rows[0].split("|")[3] == rows[0].split("|")[4]  # the same weights: equal

    (export / "README.md").write_text("---\nbase_model: org/not-here\n---\n")
    assert main(["eval", str(export), *options]) == 2
    assert "the base model org/not-here is not a local directory" in capsys.readouterr().err


def test_the_cache_of_a_cards_base_scores_keys_the_tasks_data(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's data changed under the same YAML (a path relative to the working directory, as the harness
    reads it, or absolute) is another cache entry: the card never shows a stale before-score."""
    from posttrain.inference.harness import Evaluation, cache_file, task_data_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    data = tmp_path / "data" / "rows.jsonl"
    data.write_text(DATA.read_text())
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "reverse_choice.yaml").write_text(TASK.format(data="data/rows.jsonl"))
    evaluation = Evaluation(tiny_model_dir, ("reverse_choice",), include_path=folder, limit=8)
    assert task_data_files(folder, "reverse_choice") == [tmp_path / "data" / "rows.jsonl"]
    assert task_data_files(folder, "another_task") == []
    before = cache_file(tiny_model_dir, evaluation, "reverse_choice")
    assert cache_file(tiny_model_dir, evaluation, "reverse_choice") == before  # nothing changed: a hit
    data.write_text("".join(reversed(DATA.read_text().splitlines(keepends=True))))
    assert cache_file(tiny_model_dir, evaluation, "reverse_choice") != before
