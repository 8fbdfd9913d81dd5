"""``validate``, ``init`` and ``schema`` answer without importing the heavy libraries (their CPU time is in
``benchmarks/cli_startup.py``), and the tiny LLaMA they write without torch is the one transformers builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.testing.env import child_env

HEAVY = ("torch", "transformers", "deepspeed", "peft", "datasets")


def test_validate_init_and_schema_import_no_heavy_library(tmp_path: Path) -> None:
    code = f"""
import contextlib, io, json, sys
from posttrain.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    codes = [main(["init", "sft", "-o", {str(tmp_path / "run.yaml")!r}]),
             main(["validate", {str(tmp_path / "run.yaml")!r}]),
             main(["schema"])]
print(json.dumps({{"codes": codes, "loaded": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 0], "loaded": []}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("numpy-llama") / "m", vocab_size=1024, hidden_size=32)


def test_the_tiny_llama_written_without_torch_is_transformers_own(written: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.tiny_model import build_model, build_tokenizer

    model, info = AutoModelForCausalLM.from_pretrained(written, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokenizer, reference_tokenizer = AutoTokenizer.from_pretrained(written), build_tokenizer(1024)
    reference = build_model(
        len(reference_tokenizer),
        hidden_size=32,
        bos_token_id=reference_tokenizer.bos_token_id,
        eos_token_id=reference_tokenizer.eos_token_id,
        pad_token_id=reference_tokenizer.pad_token_id,
    )
    ours, theirs = model.config.to_dict(), reference.config.to_dict()
    assert {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)} <= {
        "_name_or_path",
        "architectures",
    }  # both set when saved
    chat = [{"role": "user", "content": "add 12 and 7"}, {"role": "assistant", "content": "19"}]
    for tok in (tokenizer, reference_tokenizer):
        assert tok.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    assert tokenizer.apply_chat_template(chat) == reference_tokenizer.apply_chat_template(chat)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        reference_tokenizer.bos_token,
        reference_tokenizer.eos_token,
        reference_tokenizer.pad_token,
    )
    # LLaMA's initialisation: N(0, 0.02) matrices, zero padding row, unit norms
    weights = dict(model.named_parameters())
    assert weights["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(weights["model.embed_tokens.weight"][tokenizer.pad_token_id] == 0)
    assert torch.all(weights["model.norm.weight"] == 1)
    assert (
        json.loads((written / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    )
