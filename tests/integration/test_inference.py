"""After training: ``posttrain chat`` (one shot, a conversation, plain text) and ``posttrain merge``."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.cli import main
from posttrain.inference.chat import Sampling, chat
from posttrain.testing.env import child_env
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration
GREEDY = Sampling(max_new_tokens=6, temperature=0)


def greedy_reply(path: Path, messages: list[dict[str, str]] | str) -> str:
    """What transformers alone generates (greedy) for ``messages`` (a chat) or plain text."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if isinstance(messages, str):
        inputs = tokenizer(messages, return_tensors="pt")
    else:
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_chat_once_from_the_command_line_streams_the_templated_reply(tiny_model_dir: Path) -> None:
    options = ["--prompt", "reverse 123", "--temperature", "0", "--max-new-tokens", "6", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "chat", str(tiny_model_dir), *options],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    expected = greedy_reply(tiny_model_dir, [{"role": "user", "content": "reverse 123"}])
    assert expected.strip() and done.stdout == expected + "\n"


def test_a_conversation_keeps_its_history_and_resets(tiny_model_dir: Path) -> None:
    out = io.StringIO()
    lines = io.StringIO("reverse 12\nagain\n/reset\nagain\n/exit\nnever read\n")
    assert chat(tiny_model_dir, system="Be brief.", sampling=GREEDY, device="cpu", lines=lines, out=out) == 0
    replies = out.getvalue().splitlines()
    first = greedy_reply(
        tiny_model_dir,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse 12"}],
    )
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "reverse 12"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "again"},
    ]
    fresh = [turns[0], {"role": "user", "content": "again"}]
    assert replies == [first, greedy_reply(tiny_model_dir, turns), greedy_reply(tiny_model_dir, fresh)]
    out = io.StringIO()
    chat(tiny_model_dir, prompt="1 2 3", raw=True, sampling=GREEDY, device="cpu", out=out)
    assert out.getvalue() == greedy_reply(tiny_model_dir, "1 2 3") + "\n"


def test_merge_an_adapter_export_into_a_standalone_model(base_config: dict, tmp_path: Path, capsys) -> None:
    config = merge(
        base_config,
        train_iters=2,
        optimizer={"lr": 5e-2},
        model={"peft_config": {"r": 4, "target_modules": "all-linear"}},
        checkpoint=[{"output_dir": str(tmp_path / "out"), "save_end_of_training": True}],
    )
    result = train(config)
    adapter, merged = tmp_path / "out" / "final", tmp_path / "merged"
    assert main(["merge", str(adapter), "-o", str(merged)]) == 0
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        expected = result.model.cpu().eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert "library_name: transformers" in (merged / "README.md").read_text()
    assert AutoTokenizer.from_pretrained(merged).chat_template
    # chatting with the adapter is chatting with the merged model
    with_adapter, standalone = io.StringIO(), io.StringIO()
    chat(adapter, prompt="reverse 42", sampling=GREEDY, device="cpu", out=with_adapter)
    chat(merged, prompt="reverse 42", sampling=GREEDY, device="cpu", out=standalone)
    assert with_adapter.getvalue() == standalone.getvalue()
    capsys.readouterr()
    assert main(["merge", str(adapter), "-o", str(merged)]) == 2  # never overwrites
    assert main(["merge", str(merged), "-o", str(tmp_path / "again")]) == 2  # not an adapter
    assert main(["chat", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "no adapter_config.json" in err and "no such export directory" in err
