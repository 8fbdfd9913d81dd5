"""Each preference loss against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.methods.preference_losses import PreferenceParams, preference_loss


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# policy chosen/rejected, reference chosen/rejected summed log-probs; answer lengths
PC, PR, RC, RR, NC, NR = -10.0, -14.0, -11.0, -12.0, 4.0, 5.0
H = (PC - RC) - (PR - RR)  # = 1 - (-2) = 3


def run(loss_type: str, **kw: float) -> tuple[float, float, float]:
    params = PreferenceParams(loss_type=loss_type, **kw)
    loss, chosen, rejected = preference_loss(params, t(PC), t(PR), t(RC), t(RR), t(NC), t(NR))
    return float(loss), float(chosen), float(rejected)


def test_sigmoid() -> None:
    loss, chosen, rejected = run("sigmoid", beta=0.1)
    assert loss == pytest.approx(-log_sigmoid(0.3))  # -log sigmoid(beta * h) = 0.5544
    assert loss == pytest.approx(0.554355, abs=1e-6)
    assert chosen == pytest.approx(0.1) and rejected == pytest.approx(-0.2)


def test_sigmoid_with_label_smoothing() -> None:
    loss, _, _ = run("sigmoid", beta=0.1, label_smoothing=0.2)
    assert loss == pytest.approx(-0.8 * log_sigmoid(0.3) - 0.2 * log_sigmoid(-0.3))
    assert loss == pytest.approx(0.614355, abs=1e-6)


def test_ipo() -> None:
    loss, _, _ = run("ipo", beta=0.1)
    assert loss == pytest.approx((3 - 5) ** 2)  # (h - 1/(2 beta))^2 = (3 - 5)^2 = 4


def test_hinge() -> None:
    assert run("hinge", beta=0.1)[0] == pytest.approx(0.7)  # relu(1 - 0.3)
    assert run("hinge", beta=1.0)[0] == pytest.approx(0.0)  # relu(1 - 3)


def test_simpo_is_length_normalised_and_reference_free() -> None:
    loss, chosen, rejected = run("simpo", beta=2.0, simpo_gamma=0.5)
    logits = 2.0 * (PC / NC - PR / NR) - 0.5  # 2 * (-2.5 + 2.8) - 0.5 = 0.1
    assert logits == pytest.approx(0.1)
    assert loss == pytest.approx(-log_sigmoid(0.1))
    assert chosen == pytest.approx(2.0 * -2.5) and rejected == pytest.approx(2.0 * -2.8)


def test_orpo() -> None:
    loss, _, _ = run("orpo", beta=0.1)
    lc, lr = PC / NC, PR / NR  # mean token log-probs -2.5 and -2.8
    log_odds = (lc - lr) - (math.log1p(-math.exp(lc)) - math.log1p(-math.exp(lr)))
    assert loss == pytest.approx(2.5 - 0.1 * log_sigmoid(log_odds))  # NLL of chosen + beta * OR loss


def test_unknown_loss_type_is_a_config_error(tmp_path) -> None:
    from posttrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss_type") as info:
        load_config(
            data={
                "type": "dpo",
                "model": {"name_or_path": "m"},
                "data": {"sources": ["p.jsonl"]},
                "loss_type": "sigmod",
            },
            base_dir=tmp_path,
        )
    assert "'sigmoid'" in info.value.render()
