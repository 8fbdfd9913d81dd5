"""The converters' tables: every row names a real posttrain key, every source key gets one line, the docs
pages are generated from the tables, and the command line reports what it cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.config.base import nested_model
from posttrain.config.deepspeed_block import TOP_LEVEL_KEYS
from posttrain.convert import SYSTEM_NAMES
from posttrain.convert.base import NOT_NEEDED, SAME, UNKNOWN, UNSUPPORTED, convert
from posttrain.convert.run import SYSTEMS, detect, docs_page
from posttrain.registry import SLOT_REGISTRIES, TRAINERS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def known_keys() -> set[str]:
    keys: set[str] = set()

    def walk(cls, prefix: str) -> None:
        for name, info in cls.model_fields.items():
            keys.add(prefix + name)
            nested = nested_model(info.annotation)
            if nested is not None:
                walk(nested, f"{prefix}{name}.")

    for trainer in TRAINERS.names():
        walk(TRAINERS.get(trainer).config, "")
    for slot, registry in SLOT_REGISTRIES.items():
        for name in registry.names():
            walk(registry.get(name).config, f"{slot}.")
    return keys


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_every_plain_row_names_a_posttrain_key(name: str) -> None:
    keys = known_keys()
    for rule in SYSTEMS[name].rules:
        if rule.apply is None and rule.verdict == SAME:
            head, _, rest = rule.target.partition(".")
            if head == "deepspeed":  # the deepspeed: block is checked against DeepSpeed's own keys
                assert rest.split(".")[0] in TOP_LEVEL_KEYS, (rule.source, rule.target)
            else:
                assert rule.target in keys, (rule.source, rule.target)


def test_the_command_line_names_every_system() -> None:
    assert tuple(SYSTEMS) == SYSTEM_NAMES


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_docs_pages_are_generated_from_the_tables(name: str) -> None:
    page = DOCS / f"from-{name}.md"
    assert page.read_text() == docs_page(name), f"run `posttrain convert --from {name} --docs > {page}`"


def test_unknown_and_unsupported_keys_each_get_a_line() -> None:
    data = {
        "stage": "SFT",
        "model_name_or_path": "m",
        "tensor_parallel_degree": 4,
        "ref_model_update_steps": 10,
        "mystery_knob": 3,
        "model_args": {"lora_rank": 8},
    }
    conv = convert(SYSTEMS["erniekit"], data)
    verdicts = {key: verdict for key, verdict, _ in conv.lines}
    assert verdicts["tensor_parallel_degree"] == UNSUPPORTED
    assert verdicts["ref_model_update_steps"] == UNSUPPORTED
    assert verdicts["mystery_knob"] == UNKNOWN
    assert (
        verdicts["model_args.lora_rank"] == SAME
    )  # the nested form is read like the flat one, named in full
    detail = dict((k, d) for k, _, d in conv.lines)["tensor_parallel_degree"]
    assert "ZeRO" in detail and "sequence_parallel_size" in detail


def test_silogen_helm_values_file() -> None:
    values = {
        "finetuningGpus": 4,
        "distributedType": "auto-deepspeed-stage3",
        "basemodel": "hf://org/model",
        "mergeAdapter": True,
        "storage": {"size": "100Gi"},
        "finetuning_config": {
            "method": "sft",
            "data_conf": {
                "training_data": {"type": "CONCATENATION", "datasets": [{"path": "a.jsonl"}]},
                "validation_data": {"type": "NONE"},
            },
            "training_args": {"learning_rate": 1e-5},
            "batchsize_conf": {"total_train_batch_size": 32, "max_per_device_train_batch_size": 2},
            "peft_conf": {"peft_type": "LORA", "peft_kwargs": {"r": 8}},
            "run_conf": {"model": "/local_resources/basemodel"},
            "sft_args": {"max_seq_length": 512},
            "quant_conf": {
                "quantization_type": "bits-and-bytes",
                "load_in_4bit": True,
                "bnb_4bit_quant_type": "nf4",
            },
        },
    }
    assert detect(values) == "silogen"
    conv = convert(SYSTEMS["silogen"], values)
    config = conv.config
    assert config["model"]["name_or_path"] == "org/model"  # hf:// is the chart's way to name a hub model
    assert config["deepspeed"]["zero_optimization"]["stage"] == 3
    assert config["checkpoint"][0]["save_merged"] is True
    assert config["data"]["mask_inputs"] is False  # SiloGen's default, stated
    assert config["model"]["quantization_config"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    plain = {
        **values["finetuning_config"],
        "quant_conf": {"quantization_type": "no-quantization", "load_in_4bit": False},
    }
    assert "quantization_config" not in convert(SYSTEMS["silogen"], plain).config["model"]
    verdicts = {key: verdict for key, verdict, _ in conv.lines}
    assert verdicts["storage"] == NOT_NEEDED and verdicts["finetuningGpus"] == SAME


def test_cli_convert_writes_the_config_and_refuses_what_it_cannot_read(tmp_path: Path, capsys) -> None:
    source = tmp_path / "ernie.yaml"
    source.write_text(
        yaml.safe_dump(
            {"stage": "DPO", "model_name_or_path": "m", "train_dataset_path": "d.jsonl", "beta": 0.2}
        )
    )
    out = tmp_path / "run.yaml"
    assert main(["convert", str(source), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "converted from ERNIEKit: 4 source keys" in printed and "beta" in printed
    written = yaml.safe_load(out.read_text())
    assert written["type"] == "dpo" and written["beta"] == 0.2
    assert written["optimizer"]["weight_decay"] == 0.0  # ERNIEKit's default, stated
    (tmp_path / "other.yaml").write_text("foo: 1\n")
    assert main(["convert", str(tmp_path / "other.yaml")]) == 2
    assert "--from silogen|erniekit|megatron-bridge|trl|axolotl|llama-factory" in capsys.readouterr().err


def test_megatron_checkpoint_load_is_checked_whatever_the_key_order() -> None:
    for checkpoint, verdict in (
        ({"load": "/a", "save": "/a"}, "approximated"),
        ({"load": "/b", "save": "/a"}, UNSUPPORTED),
    ):
        conv = convert(SYSTEMS["megatron-bridge"], {"checkpoint": checkpoint, "train": {"train_iters": 1}})
        assert {key: v for key, v, _ in conv.lines}["checkpoint.load"] == verdict
