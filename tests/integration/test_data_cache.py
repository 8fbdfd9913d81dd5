"""The processed-data cache: hit on the same inputs, a new key whenever the content would change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.context import RunContext
from posttrain.data.cache import cache_key
from posttrain.dist import DistInfo
from posttrain.testing.data import chat_rows, write_jsonl
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration


def key_of(config: dict, tokenizer, tmp_path: Path, max_length: int = 64) -> str:
    cfg = load_config(data=config, base_dir=tmp_path)
    return cache_key(RunContext(cfg, DistInfo(0, 0, 1, torch.device("cpu"))), tokenizer, max_length)


def test_key_covers_what_changes_the_data(tiny_tokenizer, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", chat_rows(4))
    config = {"model": {"name_or_path": "m"}, "data": {"sources": [str(data)], "max_length": 64}}
    key = key_of(config, tiny_tokenizer, tmp_path)
    assert key == key_of(config, tiny_tokenizer, tmp_path)
    assert key == key_of(merge(config, data={"dl_num_workers": 7, "num_proc": 3}), tiny_tokenizer, tmp_path)
    assert key != key_of(merge(config, data={"pack_samples": True}), tiny_tokenizer, tmp_path)
    assert key != key_of(config, tiny_tokenizer, tmp_path, max_length=32)
    assert key != key_of(
        merge(config, data={"sources": [{"name_or_path": str(data), "sample_count": 2}]}),
        tiny_tokenizer,
        tmp_path,
    )
    from copy import deepcopy

    other = deepcopy(tiny_tokenizer)
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert key != key_of(config, other, tmp_path)
    write_jsonl(data, chat_rows(4, seed=9))  # same file name, new content
    assert key != key_of(config, tiny_tokenizer, tmp_path)


def test_second_run_loads_the_cache(base_config: dict, tmp_path: Path, capsys) -> None:
    config = merge(base_config, train_iters=1, data={"cache_dir": str(tmp_path / "cache")})
    train(config)
    assert "loaded from the cache" not in capsys.readouterr().out
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and (files[0] / "input_ids.bin").is_file() and (files[0] / "meta.json").is_file()
    train(config)
    assert "loaded from the cache" in capsys.readouterr().out
    train(merge(config, data={"use_data_cache": False}))
    assert "loaded from the cache" not in capsys.readouterr().out
