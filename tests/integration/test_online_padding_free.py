"""Online micro-batches joined into one row (``padding_free``, on by default): the forward runs on the rows
without their padding, each attending within itself, and the log-probabilities, entropies and gradients are
the padded batch's; whole GRPO (with a separate reference) and distill runs log the padded runs' records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.data.samples import JOINED
from posttrain.generation.types import Completions
from posttrain.models.sampling_policy import SamplingPolicy
from posttrain.models.token_logps import token_logps
from posttrain.rollout.feed import training_micro_batches
from tests.grpo_helpers import distill_config, grpo_config, write_prompts
from tests.integration.helpers import merge, metrics, train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from posttrain.models.document_attention import use_document_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert use_document_attention(model) == ""
    return model


def test_per_document_attention_keeps_a_left_padded_batchs_padding_out(policy: torch.nn.Module) -> None:
    """Generation's left-padded prompts, in one forward and at every cached decoding step: the padding is
    not attended (it was, before transformers was given per-document attention's mask)."""
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        padded = policy(input_ids=ids, attention_mask=mask).logits[0, 3:]
        alone = policy(input_ids=ids[:1, 3:]).logits[0]
        assert torch.allclose(padded, alone, atol=1e-5, rtol=0)
        grown = policy.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
        single = policy.generate(input_ids=ids[:1, 3:], do_sample=False, max_new_tokens=6)
    assert grown[0, 3:].tolist() == single[0].tolist()


def uneven_batch(join: bool) -> dict[str, Any]:
    """Six completions of a long-tailed spread of lengths behind prompts of 3 to 8 tokens."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=generator).tolist() for n in (3, 8, 5, 4, 7, 6)]
    lengths = (2, 40, 5, 3, 9, 1)
    ids = [torch.randint(5, 500, (n,), generator=generator).tolist() for n in lengths]
    completions = Completions(ids, [False] * 6)
    values = {"advantages": torch.linspace(-1, 1, 6)}
    (batch,) = training_micro_batches(prompts, completions, values, 6, 0, False, join)
    return batch


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("top_k", [0, 20])
def test_a_joined_micro_batch_gives_the_padded_logps_and_gradients(
    policy: torch.nn.Module, tiled: bool, top_k: int
) -> None:
    padded, joined = uneven_batch(False), uneven_batch(True)
    assert JOINED not in padded
    assert joined[JOINED]["input_ids"].shape == (1, int(padded["attention_mask"].sum()))
    sampling = SamplingPolicy(top_k=top_k) if top_k else None
    found = {}
    for name, batch in (("padded", padded), ("joined", joined)):
        policy.zero_grad()
        logps, entropy = token_logps(policy, batch, tiled, 0.9, entropy=True, policy=sampling)
        mask = batch["completion_mask"]
        loss = -(logps * mask * batch["advantages"][:, None]).sum() / mask.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in policy.parameters()])
        found[name] = (logps.detach(), entropy, loss.detach(), grads)
    mask = padded["completion_mask"].bool()
    (logps, entropy, loss, grads), (logps2, entropy2, loss2, grads2) = found["padded"], found["joined"]
    assert torch.allclose(logps[mask], logps2[mask], atol=1e-6, rtol=0)
    assert entropy is not None and entropy2 is not None
    assert torch.allclose(entropy[mask], entropy2[mask], atol=1e-6, rtol=0)
    assert abs(float(loss - loss2)) < 1e-6
    assert torch.allclose(grads, grads2, atol=1e-6, rtol=0), float((grads - grads2).abs().max())


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("joined") / "train.jsonl", 32)


def _same_records(joined: list[dict[str, Any]], padded: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    steps = [[r for r in records if keys[0] in r] for records in (joined, padded)]
    assert len(steps[0]) == len(steps[1]) > 0
    for one, other in zip(*steps, strict=True):
        for key in keys:
            assert one[key] == pytest.approx(other[key], abs=1e-6, rel=0), (one["iter"], key)


def test_grpo_with_a_reference_logs_the_padded_runs_records(
    base_config: dict, tiny_model_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    """A separate reference model (``ref_model``) follows the policy's per-document attention; the losses,
    KL, entropies and rewards of 3 steps (two updates a batch, so the old policy's log-probabilities too)
    equal the padded run's. The joined run also tiles the vocabulary projection (``tiled_loss_compute``:
    the policy's, the old policy's and the reference's log-probabilities a chunk of positions at a time)."""
    from tests.grpo_helpers import DIGITS

    (tmp_path / "digits.py").write_text(DIGITS)
    files = {"train": prompt_file, "reward": tmp_path / "digits.py"}
    found = []
    for join in (True, False):
        config = grpo_config(
            base_config,
            files,
            train_iters=3,
            beta=0.1,
            num_iterations=2,
            padding_free=join,
            tiled_loss_compute=join,
            ref_model={"name_or_path": str(tiny_model_dir), "dtype": "float32"},
            logger={"output_dir": str(tmp_path / f"run-{join}")},
        )
        train(config)
        found.append(metrics(config))
    _same_records(*found, keys=("loss", "kl", "entropy", "reward", "completions/mean_length"))


def test_distill_logs_the_padded_runs_records(prompt_file: Path, tmp_path: Path) -> None:
    """The student's and the teacher's forwards on the joined rows give the padded run's divergences."""
    base = distill_config(tmp_path, prompt_file, train_iters=2, checkpoint=[])
    found = []
    for join in (True, False):
        config = merge(base, padding_free=join, logger={"output_dir": str(tmp_path / f"run-{join}")})
        train(config)
        found.append(metrics(config))
    _same_records(*found, keys=("loss", "entropy", "teacher_entropy"))
