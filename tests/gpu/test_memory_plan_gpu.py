"""The memory plan on a GPU: the estimate of the device peak within 20% of ``torch.cuda.max_memory_allocated``
for the same configs the CPU test measures (``benchmarks/memory_plan.py --quick``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.memory_helpers import quick_table

pytestmark = pytest.mark.gpu


def test_estimates_within_20_percent_of_max_memory_allocated(tmp_path: Path) -> None:
    rows, printed = quick_table(tmp_path, timeout=1200)
    assert rows, printed
    assert not [row for row in rows if abs(row["error"]) > 0.20], printed
