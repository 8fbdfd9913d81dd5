"""Every kind of data source, sampling, splits, length policies and bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.context import RunContext
from posttrain.data.cache import load_datasets
from posttrain.dist import DistInfo
from posttrain.errors import DataError
from posttrain.testing.data import chat_rows, write_jsonl

pytestmark = pytest.mark.integration


def build(config: dict, tokenizer, tmp_path: Path):
    """The data as a run builds it (the cache is off, so every call formats the rows again)."""
    config = {**config, "data": {**config["data"], "use_data_cache": False}}
    cfg = load_config(data=config, base_dir=tmp_path)
    import torch

    ctx = RunContext(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    return load_datasets(ctx, tokenizer, cfg.data.max_length)


def items(view) -> list[dict]:
    return [{key: list(value) for key, value in item.items()} for item in view]


def data_config(sources: list, **data) -> dict:
    return {"model": {"name_or_path": "m"}, "data": {"sources": sources, "max_length": 64, **data}}


def test_all_local_formats_and_hf_datasets(tiny_tokenizer, tmp_path: Path) -> None:
    import datasets
    import pandas as pd

    rows = chat_rows(10, seed=1, max_digits=4)
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    frame = pd.DataFrame({"messages": [r["messages"] for r in rows]})
    frame.to_parquet(tmp_path / "c.parquet")
    csv_rows = [{"question": "q", "answer": "a"}]
    pd.DataFrame(csv_rows).to_csv(tmp_path / "d.csv", index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "train.jsonl", rows)

    out = build(data_config([str(jsonl), str(tmp_path / "b.json"), str(tmp_path / "c.parquet"),
                             str(tmp_path / "saved"), str(tmp_path / "dir")]), tiny_tokenizer, tmp_path)  # fmt: skip
    assert len(out.train) == 50 and out.train_report.rows == 50
    samples = items(out.train)
    assert samples[0] == samples[10] == samples[20] == samples[30] == samples[40]

    with pytest.raises(DataError, match=r"d\.csv row 2: no conversation in this row"):
        build(data_config([str(tmp_path / "d.csv")]), tiny_tokenizer, tmp_path)


def test_sampling_and_eval_split(tiny_tokenizer, tmp_path: Path) -> None:
    distinct = list({json.dumps(row): row for row in chat_rows(60, seed=2, max_digits=4)}.values())[:40]
    path = write_jsonl(tmp_path / "a.jsonl", distinct)
    out = build(data_config([{"name_or_path": str(path), "sample_count": 10}]), tiny_tokenizer, tmp_path)
    assert len(out.train) == 10
    out = build(data_config([{"name_or_path": str(path), "sample_ratio": "25%"}]), tiny_tokenizer, tmp_path)
    assert len(out.train) == 10
    config = data_config([str(path)], train_eval_split=[0.75, 0.25])
    config["eval_interval"] = 5
    out = build(config, tiny_tokenizer, tmp_path)
    assert len(out.train) == 30 and len(out.eval) == 10
    train_ids = {tuple(s["input_ids"]) for s in out.train}
    assert not train_ids & {tuple(s["input_ids"]) for s in out.eval}
    assert out.train_report.leaked == 0


def test_overlong_rows_dropped_or_truncated(tiny_tokenizer, tmp_path: Path) -> None:
    long_answer = {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y " * 100}]
    }
    long_prompt = {
        "messages": [{"role": "user", "content": "x " * 100}, {"role": "assistant", "content": "y"}]
    }
    path = write_jsonl(tmp_path / "a.jsonl", [*chat_rows(5, max_digits=3), long_answer, long_prompt])
    out = build(data_config([str(path)]), tiny_tokenizer, tmp_path)
    assert len(out.train) == 5 and out.train_report.dropped == {"longer than max_length=64": 2}
    assert "2 dropped (longer than max_length=64)" in out.train_report.summary("train")
    out = build(data_config([str(path)], overlong_samples="truncate"), tiny_tokenizer, tmp_path)
    # the long answer keeps its first tokens; the long prompt loses its whole answer, so it is dropped
    assert len(out.train) == 6 and out.train_report.truncated == 2
    assert out.train_report.dropped == {"no trained tokens": 1}
    assert max(len(s["input_ids"]) for s in out.train) == 64


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
            "row 3: messages\\[1\\].role 'bot'",
        ),
        ('{"messages": []}', "row 3: 'messages' must be a non-empty list"),
        (
            '{"text": "hi"}',
            "row 3: a plain-text row .keys: text. has no conversation: train text with type: causal",
        ),
        ("{not json", "row 3: invalid JSON"),
    ],
)
def test_bad_row_names_file_and_row(tiny_tokenizer, tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps(chat_rows(1)[0])
    path.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(DataError, match=f"bad.jsonl {message}"):
        build(data_config([str(path)]), tiny_tokenizer, tmp_path)


def test_missing_file(tiny_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        build(data_config([str(tmp_path / "nope.jsonl")]), tiny_tokenizer, tmp_path)


def test_parallel_formatting_matches_and_names_bad_rows(tiny_tokenizer, tmp_path: Path, monkeypatch) -> None:
    import posttrain.data.build as build_module

    path = write_jsonl(tmp_path / "a.jsonl", chat_rows(40, seed=4, max_digits=4))
    config = data_config([str(path)], num_proc=2)
    serial = build(config, tiny_tokenizer, tmp_path)
    monkeypatch.setattr(build_module, "PARALLEL_MIN_ROWS", 10)
    parallel = build(config, tiny_tokenizer, tmp_path)
    assert items(parallel.train) == items(serial.train)
    rows = [*chat_rows(30, seed=4), {"messages": []}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl row 31: 'messages' must be a non-empty list"):
        build(data_config([str(bad)], num_proc=2), tiny_tokenizer, tmp_path)


def test_alpaca_and_mapped_sharegpt_files_train_together(
    base_config: dict, tiny_tokenizer, tmp_path: Path
) -> None:
    """Rows as they are on disk: an Alpaca file and a ShareGPT-like file with its own column and role names,
    mixed in one SFT run."""
    from tests.integration.helpers import merge, train

    chats = chat_rows(24)
    alpaca = write_jsonl(
        tmp_path / "alpaca.jsonl",
        [
            {"instruction": r["messages"][0]["content"], "input": "", "output": r["messages"][1]["content"]}
            for r in chats
        ],
    )
    dialog = [
        {
            "dialog": [
                {"speaker": "customer", "text": r["messages"][0]["content"]},
                {"speaker": "bot", "text": r["messages"][1]["content"]},
            ]
        }
        for r in chats
    ]
    shared = write_jsonl(tmp_path / "dialog.jsonl", dialog)
    sources = [
        str(alpaca),
        {"name_or_path": str(shared), "columns": {"conversations": "dialog", "from": "speaker", "value": "text"},
         "roles": {"customer": "human", "bot": "gpt"}},
    ]  # fmt: skip
    config = merge(base_config, data={"sources": sources}, train_iters=2)
    result = train(config)
    assert result.state.step == 2
    assert build(config, tiny_tokenizer, tmp_path).train_report.rows == 48  # every row of both files


@pytest.mark.parametrize("num_proc", [1, 2])
def test_every_bad_row_is_reported_at_once_up_to_a_cap(
    tiny_tokenizer, tmp_path: Path, monkeypatch, num_proc: int
) -> None:
    import posttrain.data.build as build_module

    monkeypatch.setattr(build_module, "PARALLEL_MIN_ROWS", 10)
    monkeypatch.setattr(build_module, "CHUNK_ROWS", 8)  # the bad rows fall in different chunks
    rows = chat_rows(40, seed=4)
    for number in (5, 17, 33):
        rows[number - 1] = {"messages": []}
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as raised:
        build(data_config([str(bad)], num_proc=num_proc), tiny_tokenizer, tmp_path)
    message = str(raised.value)
    assert message.startswith("3 bad rows:"), message
    assert all(f"bad.jsonl row {n}: 'messages' must be a non-empty list" in message for n in (5, 17, 33))
    monkeypatch.setattr(build_module, "MAX_ROW_ERRORS", 2)
    with pytest.raises(DataError, match=r"2 bad rows \(the build stopped reading there: there may be more\)"):
        build(data_config([str(bad)], num_proc=num_proc), tiny_tokenizer, tmp_path)


def test_unreadable_lines_are_reported_with_the_other_bad_rows(tiny_tokenizer, tmp_path: Path) -> None:
    lines = [json.dumps(row) for row in chat_rows(8, seed=1)]
    lines[1], lines[3], lines[5] = '{"messages": [}', "[1, 2]", '{"messages": []}'
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as raised:
        build(data_config([str(path)]), tiny_tokenizer, tmp_path)
    message = str(raised.value)
    assert message.startswith("3 bad rows:"), message
    for expected in (
        "mixed.jsonl row 2: invalid JSON (Expecting value at column 15)",
        "mixed.jsonl row 4: expected a JSON object, got list",
        "mixed.jsonl row 6: 'messages' must be a non-empty list",
    ):
        assert expected in message, message
