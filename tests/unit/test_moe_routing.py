"""The router's load-balancing loss and the expert-load summary: pure functions on router logits."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.moe import RoutingRecorder, load_summary, moe_facts_from_hf_config, routing_statistics
from posttrain.tiny_model import build_model


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_router_loss_is_the_models_own_with_padding_left_out(arch: str) -> None:
    import importlib

    model = build_model(300, arch=arch, hidden_size=32, heads=4, seed=1).train()
    facts = moe_facts_from_hf_config(model.config)
    assert facts is not None and facts.num_experts == 8 and facts.top_k == 2
    recorder = RoutingRecorder(model, facts, facts.aux_loss_coef)
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with recorder.recording():
        out = model(input_ids=tokens, attention_mask=mask, output_router_logits=True)
    ours = recorder.take_loss({"attention_mask": mask})
    modeling = importlib.import_module(type(model).__module__)
    theirs = modeling.load_balancing_loss_func(out.router_logits, facts.num_experts, facts.top_k, mask)
    assert ours is not None and torch.allclose(ours, theirs, atol=1e-6)
    counts = recorder.take_counts()
    assert counts.shape == (2, 8) and counts.sum() == 2 * 19 * 2  # layers x unpadded tokens x top-k
    with torch.no_grad(), recorder.recording():  # not a training forward: nothing recorded
        model(input_ids=tokens)
    assert recorder.take_loss({}) is None
    recorder.close()


def test_router_loss_of_perfectly_even_routing_is_one() -> None:
    logits = torch.zeros(16, 4)  # uniform probabilities
    logits[torch.arange(16), torch.arange(16) % 4] = 1e-4  # ties broken evenly
    loss, counts = routing_statistics([logits], top_k=1)
    assert float(loss) == pytest.approx(1.0, abs=1e-3)
    assert counts.tolist() == [[4.0, 4.0, 4.0, 4.0]]


def test_load_summary_shares_and_imbalance() -> None:
    counts = torch.tensor([[5.0, 5.0, 5.0, 5.0], [20.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    summary = load_summary(counts)
    assert summary["expert_load"] == [[0.25] * 4, [1.0, 0.0, 0.0, 0.0]]
    assert summary["expert_imbalance_per_layer"] == [1.0, 4.0]
    assert summary["expert_imbalance"] == 4.0
