"""The converters carry ERNIEKit's and SiloGen's preference keys, SiloGen's poro template and FlashAttention
choices over (issue #34): each converted file validates and trains the source's objective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posttrain.cli import main
from posttrain.config import load_config
from posttrain.convert.base import APPROX, SAME, convert
from posttrain.convert.run import SYSTEMS


def erniekit(**keys: Any) -> dict[str, Any]:
    return {"stage": "DPO", "model_name_or_path": "m", "train_dataset_path": "p.jsonl", **keys}


def silogen(training_args: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "method": "dpo",
        "data_conf": {
            "training_data": {"type": "CONCATENATION", "datasets": [{"path": "p.jsonl"}]},
            "validation_data": {"type": "NONE"},
            **more.pop("data_conf", {}),
        },
        "training_args": {"learning_rate": 1e-6, **training_args},
        "batchsize_conf": {"total_train_batch_size": 8, "max_per_device_train_batch_size": 2},
        "run_conf": {"model": "m", **more.pop("run_conf", {})},
        **more,
    }


def verdicts(conv) -> dict[str, str]:
    return {key: verdict for key, verdict, _ in conv.lines}


@pytest.mark.parametrize(
    "loss", ["sigmoid", "hinge", "ipo", "dpop", "kto_pair", "sppo_hard", "nca_pair", "or"]
)
def test_every_erniekit_loss_type_carries_over(loss: str) -> None:
    conv = convert(SYSTEMS["erniekit"], erniekit(loss_type=loss, beta=0.2, dpop_lambda=10, offset_alpha=0.0))
    assert verdicts(conv)["loss_type"] == SAME and verdicts(conv)["dpop_lambda"] == SAME
    config = load_config(data=conv.config)
    assert config.loss_types == (loss,) and config.beta == 0.2


def test_erniekit_orpo_becomes_or_with_the_nll_at_weight_one() -> None:
    # ERNIEKit: orpo -> reference_free, sft_loss_ratio 1, loss_type or; beta is not read, and the odds-ratio
    # term is weighted by pref_loss_ratio
    conv = convert(
        SYSTEMS["erniekit"], erniekit(loss_type="orpo", beta=0.1, pref_loss_ratio=0.5, sft_loss_ratio=0.3)
    )
    config = load_config(data=conv.config)
    assert config.loss_types == ("or",) and config.sft_loss_ratio == 1.0 and config.pref_loss_ratio == 0.5
    assert not config.needs_reference
    assert verdicts(conv)["sft_loss_ratio"] == APPROX  # the file's 0.3 is overridden, as ERNIEKit does


def test_erniekit_offset_alpha_asks_for_scores() -> None:
    conv = convert(SYSTEMS["erniekit"], erniekit(offset_alpha=0.5))
    assert verdicts(conv)["offset_alpha"] == SAME
    config = load_config(data=conv.config)
    assert config.offset_alpha == 0.5 and config.data.require_scores


def test_silogen_dpo_training_args_carry_over() -> None:
    conv = convert(
        SYSTEMS["silogen"],
        silogen(
            {
                "beta": 0.05,
                "loss_type": ["sigmoid", "sft"],
                "loss_weights": [1.0, 0.1],
                "label_smoothing": 0.1,
                "max_prompt_length": 256,
                "precompute_ref_log_probs": True,
                "rpo_alpha": 0.5,
            }
        ),
    )
    config = load_config(data=conv.config)
    assert config.loss_types == ("sigmoid", "sft") and config.weights == (1.0, 0.1)
    assert config.beta == 0.05 and config.label_smoothing == 0.1 and config.sft_loss_ratio == 0.5
    assert config.data.max_prompt_length == 256
    conv = convert(SYSTEMS["silogen"], silogen({"loss_type": "aot_unpaired"}))
    assert load_config(data=conv.config).loss_types == ("aot_pair",)


def test_silogen_poro_template_carries_over() -> None:
    conv = convert(SYSTEMS["silogen"], silogen({}, data_conf={"chat_template_name": "poro"}))
    assert load_config(data=conv.config).tokenizer.chat_template == "poro"


@pytest.mark.parametrize("system", ["silogen", "erniekit"])
def test_flash_attention_becomes_sdpa_unless_kept(system: str, tmp_path: Path) -> None:
    import yaml

    data = (
        silogen({}, run_conf={"model_args": {"attn_implementation": "flash_attention_2"}})
        if system == "silogen"
        else erniekit(use_flash_attention=True)
    )
    conv = convert(SYSTEMS[system], data)
    assert conv.config["model"]["attn_implementation"] == "sdpa"
    line = next(detail for _, _, detail in conv.lines if "attn_implementation: sdpa" in detail)
    assert "varlen" in line and "--keep-attention" in line
    kept = convert(SYSTEMS[system], data, keep_attention=True)
    assert kept.config["model"]["attn_implementation"] == "flash_attention_2"
    source = tmp_path / "source.yaml"
    source.write_text(yaml.safe_dump(data))
    assert main(["convert", str(source), "-o", str(tmp_path / "kept.yaml"), "--keep-attention"]) == 0
    assert (
        yaml.safe_load((tmp_path / "kept.yaml").read_text())["model"]["attn_implementation"]
        == "flash_attention_2"
    )


def test_vision_freezes_carry_over_from_erniekit_and_megatron_bridge() -> None:
    """ERNIEKit VL's ``freeze_config`` and Megatron-Bridge's VLM ``model.freeze_*`` set all three of
    posttrain's keys: what the source does not freeze trains there, so it trains here too."""
    conv = convert(SYSTEMS["erniekit"], erniekit(stage="SFT", freeze_config="freeze_vision | freeze_aligner"))
    model = load_config(data=conv.config).model
    assert (model.freeze_vision_tower, model.freeze_multi_modal_projector, model.freeze_language_model) == (
        True,
        True,
        False,
    )
    conv = convert(SYSTEMS["erniekit"], erniekit(stage="SFT", freeze_config="freeze_vision freeze_mtp"))
    assert verdicts(conv)["freeze_config"] == "not supported"
    source = {"model": {"freeze_language_model": True}, "train": {"train_iters": 5}}
    conv = convert(SYSTEMS["megatron-bridge"], source)
    assert verdicts(conv)["model.freeze_language_model"] == SAME
    assert conv.config["model"]["freeze_language_model"] is True
    assert conv.config["model"]["freeze_vision_tower"] is False  # Megatron-Bridge trains the tower by default
    assert conv.config["model"]["freeze_multi_modal_projector"] is False
