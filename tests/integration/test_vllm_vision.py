"""GRPO of a vision-language model on vLLM's CPU build (``make test-vllm``; skipped where vLLM is not
installed): the colocated engine is given each prompt as vLLM takes it (one image token per image and the
images as ``multi_modal_data``, never the processor's expanded ids with the raw image), its expansion is
checked against the trainer's ids, and after every weight push the engine's log-probabilities of the sampled
tokens are the trainer's. Idefics3 in vLLM's venv; the Qwen-VL family, LLaVA and Gemma 3, whose processors (in
transformers or in vLLM) need torchvision, in the vision tier's venv (``make test-vision``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.testing.data import write_jsonl
from posttrain.testing.vision import colour_prompts
from tests.grpo_helpers import engine_grpo_config
from tests.integration.test_vision import QWEN, hub_layout
from tests.resume_helpers import cli, last_metrics

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

#: a reward that reads the images and the completions' lengths (so the groups' rewards differ)
LENGTH = """
def length(completions, images, **kwargs):
    assert all(len(pictures) == 1 and pictures[0].size == (32, 32) for pictures in images), images
    return [len(c[0]["content"]) / 10 for c in completions]
"""


@pytest.mark.parametrize(
    "arch",
    ["idefics3", *QWEN, *(pytest.param(a, marks=pytest.mark.torchvision) for a in ("llava", "gemma3"))],
)
def test_grpo_on_image_prompts_samples_through_the_engine_as_the_trainer_scores(
    tmp_path: Path, arch: str
) -> None:
    """LLaVA's and Gemma 3's checkpoints are in the hub's layout (vLLM 0.32 does not load transformers 5's
    own), so the weights pushed after each step must be renamed back to it; Gemma 3's prompts join the
    newlines around each image with the text beside them (its vocabulary's "\n\n\n"), which the engine's
    prompt must split again."""
    from posttrain.vision.tiny import write_tiny_vlm

    # heads of 64 dimensions: what vLLM's CPU attention runs
    tied = arch == "gemma3"  # as every Gemma 3 checkpoint (vLLM's Gemma 3 reads no head of its own)
    model = write_tiny_vlm(tmp_path / "model", arch, vocab_size=1024, hidden_size=128, heads=2, tied=tied)
    if arch in ("llava", "gemma3"):
        model = hub_layout(model, tmp_path / "hub")
    data = write_jsonl(tmp_path / "prompts.jsonl", colour_prompts(tmp_path, 16, seed=2))
    (tmp_path / "length.py").write_text(LENGTH)
    config = engine_grpo_config(
        tmp_path,
        model,
        [f"{tmp_path / 'length.py'}:length"],
        data={"sources": [str(data)]},
        num_generations=4,
        max_completion_length=8,
        micro_batch_size=4,
        train_iters=3,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        top_k=20,
        top_p=0.9,
        logger={"output_dir": str(tmp_path / "run")},
    )
    done = cli(config, tmp_path / "grpo.yaml", 1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = last_metrics(tmp_path / "run")
    assert sorted(records) == [1, 2, 3]
    for step, record in records.items():  # steps 2 and 3 sample from weights pushed after an update
        assert record["sampling/sampling_logp_difference/max"] < 1e-4, (step, record)
        assert abs(record["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, (step, record)
    assert records[3]["reward"] != records[1]["reward"]
