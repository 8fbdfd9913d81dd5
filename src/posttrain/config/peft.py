"""``model.peft_config``: any PEFT config as a dict (``peft_type`` + its fields), LoRA by default.

``{r: 16, lora_alpha: 32, target_modules: all-linear}`` is a LoRA config; ``use_rslora: true`` gives rsLoRA,
``use_dora: true`` DoRA; ``{peft_type: IA3, ...}`` any other PEFT method. Validation builds the PEFT config
object (pure: no model is touched), so a wrong key is a config error with a suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any


def peft_config_from_dict(values: dict[str, Any]) -> Any:  # -> peft.PeftConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    data = dict(values)
    peft_type = str(data.pop("peft_type", "LORA")).upper()
    known = {getattr(key, "value", str(key)): cls for key, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()}
    if peft_type not in known:
        close = difflib.get_close_matches(peft_type, list(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown peft_type {peft_type!r}{hint} (known: {', '.join(sorted(known))})")
    cls = known[peft_type]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        hints = [
            f"{k!r}"
            + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, fields, n=1)) else "")
            for k in unknown
        ]
        raise ValueError(f"unknown {peft_type} keys: {', '.join(hints)}")
    data.setdefault("task_type", "CAUSAL_LM")
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid {peft_type} config: {exc}") from None
