from __future__ import annotations

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.config.human import coerce_tree, parse_human, to_float, to_int


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("50%", 0.5),
        ("3e-5", 3e-05),
        ("1e-6", 0.000001),
        ("2^20", 1048576),
        ("1K", 1000),
        ("1.25K", 1250),
        ("2M", 2_000_000),
        ("3B", 3_000_000_000),
        ("1T", 10**12),
        ("1Ki", 1024),
        ("2.5Mi", 2621440),
        ("1Gi", 2**30),
        ("1Ti", 2**40),
        ("1_000", 1000),
        ("-1K", -1000),
        ("-2^3", -8),
        ("0.5", 0.5),
    ],
)
def test_formats(text: str, expected: float) -> None:
    assert float(parse_human(text)) == expected


def test_exact_values() -> None:
    assert to_int("1.25K") == 1250 and isinstance(to_int("1.25K"), int)
    assert to_float("3e-5") == 3e-05
    assert repr(to_float("3e-5")) == "3e-05"
    assert to_int("2.5Mi") == 2621440
    assert to_float("10%") == 0.1


@pytest.mark.parametrize("text", ["1.5", "10%", "1.0001K", "2^-1"])
def test_integer_fields_refuse_fractions(text: str) -> None:
    with pytest.raises(ValueError, match="not a whole number"):
        to_int(text)


def test_integer_field_refuses_float() -> None:
    with pytest.raises(ValueError, match="not a whole number"):
        to_int(1.5)


@pytest.mark.parametrize("text", ["abc", "1KK", "1e", "%5", "1.2.3"])
def test_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_human(text)


def test_deepspeed_tree() -> None:
    tree = {
        "zero_optimization": {"reduce_bucket_size": "5e8", "stage": "2", "offload": {"device": "cpu"}},
        "x": ["1Ki"],
    }
    assert coerce_tree(tree) == {
        "zero_optimization": {"reduce_bucket_size": 500_000_000, "stage": 2, "offload": {"device": "cpu"}},
        "x": [1024],
    }


def test_human_values_in_a_config(tmp_path) -> None:
    config = load_config(
        data={
            "model": {"name_or_path": "m"},
            "data": {"sources": ["d.jsonl"], "max_length": "2Ki"},
            "optimizer": {"lr": "3e-5", "weight_decay": "1%"},
            "train_iters": "1.25K",
            "deepspeed": {"zero_optimization": {"reduce_bucket_size": "2^20"}},
        },
        base_dir=tmp_path,
    )
    assert config.data.max_length == 2048
    assert config.optimizer.lr == 3e-05
    assert config.optimizer.weight_decay == 0.01
    assert config.train_iters == 1250
    assert config.deepspeed["zero_optimization"]["reduce_bucket_size"] == 2**20


def test_fractional_integer_in_config_is_reported(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            data={
                "model": {"name_or_path": "m"},
                "data": {"sources": ["d.jsonl"]},
                "train_iters": "10%",
                "epochs": 1.5,
            },
            base_dir=tmp_path,
        )
    paths = {issue.path for issue in info.value.issues}
    assert paths == {"train_iters", "epochs"}
    assert "not a whole number" in info.value.render()
