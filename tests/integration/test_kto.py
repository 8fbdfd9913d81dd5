"""KTO on the tiny model: unpaired rows (TRL's layout) and preference pairs learn, the KL baseline is
computed per step from mismatched sequences, the class balance is checked, bad rows are named, and a run
killed mid-training resumes exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from posttrain.errors import UserError
from tests.integration.helpers import merge, train
from tests.resume_helpers import assert_same_continuation, kill_and_resume

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT / "examples" / "data" / "prefs-train.jsonl"


def unpaired(path: Path, count: int, desirable_share: float = 0.5) -> Path:
    """TRL's unpaired layout from the bundled prompts: the reversed digits desirable, a refusal undesirable."""
    rows = [json.loads(line) for line in PAIRS.open()][:count]
    rng = random.Random(0)
    out = []
    for row in rows:
        good = rng.random() < desirable_share
        completion = row["chosen"] if good else "I cannot reverse numbers."
        out.append({"prompt": row["prompt"], "completion": completion, "label": good})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def kto_config(base_config: dict, source: Path, **changes) -> dict:
    return merge(
        base_config,
        type="kto",
        data={"sources": [{"name_or_path": str(source)}], "max_length": 64},
        optimizer={"lr": 2e-3},
        **changes,
    )


def test_unpaired_rows_learn_and_log_trl_metrics(base_config: dict, tmp_path: Path, capsys) -> None:
    rows = unpaired(tmp_path / "kto.jsonl", 256)
    config = kto_config(base_config, rows, epochs=1, micro_batch_size=8, eval_interval=16)
    config["data"]["eval_sources"] = [str(unpaired(tmp_path / "eval.jsonl", 64))]
    history = train(config).state.history
    out = capsys.readouterr().out
    assert "reference log-probabilities computed once for" in out
    steps = [h for h in history if "loss" in h]
    # before the first update the policy is the reference: every log-ratio and the KL baseline are 0
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-9) and steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    evals = [h for h in history if "eval_loss" in h]
    assert evals[-1]["eval_rewards/chosen"] - evals[-1]["eval_rewards/rejected"] > 1.0, evals[-1]
    assert evals[-1]["eval_loss"] < 0.4 < 0.5  # 0.5 before the first update


def test_preference_pairs_give_one_desirable_and_one_undesirable(base_config: dict) -> None:
    config = kto_config(base_config, PAIRS, train_iters=3, micro_batch_size=4)
    config["data"]["sources"][0]["sample_count"] = 32
    history = train(config).state.history
    assert [h["iter"] for h in history if "loss" in h] == [1, 2, 3]
    assert all("rewards/chosen" in h and "rewards/rejected" in h for h in history if "loss" in h)


def test_class_balance_warning_and_apo_zero_unpaired(base_config: dict, tmp_path: Path, capsys) -> None:
    rows = unpaired(tmp_path / "skewed.jsonl", 64, desirable_share=0.9)
    history = train(kto_config(base_config, rows, train_iters=2, loss_type="apo_zero_unpaired")).state.history
    out = capsys.readouterr().out
    assert "KTO class balance: 55 desirable and 9 undesirable" in out and "outside the [1, 1.33]" in out
    assert "desirable_weight in [0.16, 0.22]" in out  # 9 / 55 and 4/3 of it
    assert history[0]["kl"] == 0.0  # no KL baseline for APO


def test_bad_kto_rows_are_named(base_config: dict, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "reverse 12", "completion": "21", "label": True}
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in (good, {"prompt": "reverse 3", "completion": "3"}, {**good, "label": "yes"}, good)
        )
        + "\n"
    )
    with pytest.raises(UserError) as info:
        train(kto_config(base_config, path, train_iters=1))
    text = str(info.value)
    assert "bad.jsonl" in text and "row 2" in text and "needs its 'label'" in text
    assert "row 3" in text and "'label' must be true" in text


@pytest.mark.slow  # make test-slow (CI runs it)
def test_sigkill_then_resume_is_exact(base_config: dict, tmp_path: Path) -> None:
    rows = unpaired(tmp_path / "kto.jsonl", 64)
    base = kto_config(base_config, rows, epochs=3, micro_batch_size=4, gradient_accumulation_steps=2)
    kill_at, total = 3, 6
    results = kill_and_resume(base, tmp_path, nproc=1, kill_at=kill_at, total=total)
    assert_same_continuation(results, kill_at, total)
    for step in range(kill_at + 1, total + 1):
        assert results["reference_metrics"][step]["kl"] == pytest.approx(
            results["resumed_metrics"][step]["kl"], abs=1e-9
        )
