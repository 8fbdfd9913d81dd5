"""DeepSpeed op builds survive the arch lists of real GPU images, or fail in one clear line."""

from __future__ import annotations

import os

import pytest

from posttrain.errors import UserError
from posttrain.utils.ops import ARCH_LIST, buildable_arch_list, deepspeed_op_build


@pytest.mark.parametrize(
    ("given", "built"),
    [
        ("9.0a", "9.0"),
        ("9.0+PTX", "9.0+PTX"),
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a+PTX", "9.0+PTX"),
        ("7.5 8.6 12.0f", "7.5;8.6;12.0"),
        ("9.0;9.0a", "9.0"),
        ("sm_90", None),
        (None, None),
    ],
)
def test_arch_lists_become_what_deepspeeds_builder_parses(given: str | None, built: str | None) -> None:
    assert buildable_arch_list(given) == built
    if built is not None:  # DeepSpeed's own parse: int() of every part of every entry
        assert all(int(part.split("+")[0]) >= 0 for entry in built.split(";") for part in entry.split("."))


def test_the_build_sees_the_clean_list_and_the_user_keeps_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARCH_LIST, "8.0;9.0a")
    with deepspeed_op_build("fused_adam"):
        assert os.environ[ARCH_LIST] == "8.0;9.0"
    assert os.environ[ARCH_LIST] == "8.0;9.0a"


def test_a_failed_build_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARCH_LIST, "9.0a")
    with pytest.raises(UserError) as info, deepspeed_op_build("fused_adam"):
        raise RuntimeError("Error building extension 'fused_adam'\nlong compiler output")
    message = str(info.value)
    assert "\n" not in message and "Error building extension 'fused_adam'" in message
    assert "TORCH_CUDA_ARCH_LIST='9.0a' was used as '9.0'" in message and "optimizer.type: adamw" in message
    assert os.environ[ARCH_LIST] == "9.0a"
