"""Continued pretraining on raw text: blocks and packed documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.testing.data import text_rows, write_jsonl
from tests.integration.helpers import merge, train

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pack", [False, True], ids=["blocks", "packed"])
def test_causal_loss_falls(base_config: dict, tmp_path: Path, pack: bool, capsys) -> None:
    data = write_jsonl(tmp_path / "text.jsonl", text_rows(200))
    config = merge(
        base_config,
        type="causal",
        data={"sources": [str(data)], "max_length": 64, "pack_samples": pack},
        micro_batch_size=1 if pack else 4,
        epochs=2,
        optimizer={"lr": 3e-3},
    )
    result = train(config)
    history = result.state.history
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    out = capsys.readouterr().out
    assert "train data: 200 rows -> 200 samples" in out
    if not pack:
        # full blocks: every token but the first is a target. Per epoch, only the step holding the stream's
        # short last block and the epoch's last (short) step can differ.
        short = [h["tokens"] for h in history if h["tokens"] != 4 * 63]
        assert len(short) <= 4 and len(history) > 20, short
