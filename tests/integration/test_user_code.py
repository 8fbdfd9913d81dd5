"""A user file registers a data source and a model factory; a real run uses both."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.config import load_config
from posttrain.run import run

pytestmark = pytest.mark.integration

USER_CODE = '''
from transformers import AutoModelForCausalLM

from posttrain.config.data import DataSourceConfig
from posttrain.config.model import ModelConfig
from posttrain.data.sources import Row
from posttrain.registry import DATA_SOURCES, MODEL_FACTORIES

CALLS = []


class CountingSourceConfig(DataSourceConfig):
    rows: int = 8
    """How many rows to generate."""


@DATA_SOURCES.register("counting", config=CountingSourceConfig)
def counting(config, ctx):
    CALLS.append("source")
    return [
        Row({"messages": [{"role": "user", "content": f"count {i}"}, {"role": "assistant", "content": str(i + 1)}]},
            f"counting row {i}")
        for i in range(config.rows)
    ]


class FrozenEmbeddingsConfig(ModelConfig):
    freeze_embeddings: bool = True
    """Freeze the input embeddings."""


@MODEL_FACTORIES.register("frozen-embeddings", config=FrozenEmbeddingsConfig)
def frozen(config, ctx):
    CALLS.append("model")
    model = AutoModelForCausalLM.from_pretrained(config.name_or_path, dtype="float32")
    model.get_input_embeddings().weight.requires_grad_(not config.freeze_embeddings)
    return model
'''


def test_user_components_in_a_real_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(USER_CODE)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "type": "frozen-embeddings",
                    "name_or_path": str(tiny_model_dir),
                    "dtype": "float32",
                },
                "data": {
                    "sources": [{"type": "counting", "name_or_path": "-", "rows": 12}],
                    "max_length": 64,
                    "dl_num_workers": 0,
                },
                "skip_validation": True,
                "micro_batch_size": 4,
                "logger": {"output_dir": str(tmp_path / "run")},
                "loss_log_interval": 0,
            }
        )
    )
    config = load_config(config_path)
    assert config.model.freeze_embeddings is True and config.data.sources[0].rows == 12
    result = run(config)
    assert result.state.step == 3
    embeddings = result.model.get_input_embeddings().weight
    assert not embeddings.requires_grad
    import sys

    module = next(m for name, m in sys.modules.items() if name.startswith("posttrain_user_train_"))
    assert module.CALLS == ["model", "source"]


def test_custom_type_not_accepted_without_skip_validation(tiny_model_dir: Path, tmp_path: Path) -> None:
    from posttrain.config import ConfigError

    (tmp_path / "train.py").write_text(
        USER_CODE.replace('"counting"', '"counting2"').replace('"frozen-embeddings"', '"frozen2"')
    )
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model:\n  type: frozen2\n  name_or_path: {tiny_model_dir}\ndata:\n  sources: [a.jsonl]\n"
    )
    with pytest.raises(ConfigError, match="not accepted by the 'sft' trainer"):
        load_config(path)


def test_error_in_user_code_is_a_config_error(tmp_path: Path) -> None:
    from posttrain.config import ConfigError

    (tmp_path / "train.py").write_text("x = 1\nraise RuntimeError('boom')\n")
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name_or_path: m\ndata:\n  sources: [a.jsonl]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.issues[0].path == "code"
    assert (
        "RuntimeError: boom" in info.value.issues[0].message and "train.py:2" in info.value.issues[0].message
    )
