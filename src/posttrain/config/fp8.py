"""Every check of FP8 training (``model.fp8``) that needs no model: the recipes torchao offers and what FP8
cannot be combined with. The layers it converts and the device it runs on are the model's business
(``models/fp8.py``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from posttrain.config.base import Problem

if TYPE_CHECKING:
    from posttrain.config.model import ModelConfig

#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``), in torchao's own names
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: the ``fp8_filter_fqns`` entry that also leaves out the layers too small to gain (torchao's size rule, as
#: torchtitan's ``filter_fqns`` spells it)
AUTO_FILTER = "auto_filter_small_kn"
#: the package and the extra that brings it
TORCHAO_INSTALL = "pip install 'posttrain[fp8]'"


def recipe_value(value: Any) -> Any:
    """``model.fp8``'s value checked: a recipe name or null (``true`` names no recipe: say which to use)."""
    if value is None or value in FP8_RECIPES:
        return value
    allowed = ", ".join(FP8_RECIPES)
    if value is True or (isinstance(value, str) and value.lower() in ("true", "on", "yes")):
        raise ValueError(
            f"names no recipe; use one of {allowed} (tensorwise: one scale per tensor, the fastest; "
            "rowwise: one per row, closer to bf16), or null for no FP8"
        )
    import difflib

    close = difflib.get_close_matches(str(value), FP8_RECIPES, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ValueError(f"not an FP8 recipe; {hint}allowed: {allowed}, or null (off)")


def fp8_problems(model: ModelConfig) -> Iterator[Problem]:
    """What ``model.fp8`` cannot run with, before anything loads: a 4-bit base (its layers hold no
    high-precision weight to cast), and torchao missing."""
    if model.fp8 is None:
        return
    if model.quantization_config is not None:
        yield Problem(
            "fp8",
            "cannot run on a quantised base (model.quantization_config: its linear layers hold 4- or 8-bit "
            "weights, not the high-precision ones FP8 casts); remove one of the two",
        )
    if importlib.util.find_spec("torchao") is None:
        yield Problem("fp8", f"{model.fp8} needs torchao (PyTorch's float8 training): {TORCHAO_INSTALL}")


def frozen_model_problems(model: Any, key: str) -> Iterator[Problem]:
    """A frozen model another method holds (a reference, a teacher) runs in its own precision: FP8 trains."""
    if model is not None and model.fp8 is not None:
        yield Problem(
            f"{key}.fp8",
            "FP8 speeds up training; a frozen model is never trained, so it is not converted; remove the key",
        )
