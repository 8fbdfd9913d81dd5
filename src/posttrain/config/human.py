"""Human-friendly numbers in configs: ``50%``, ``3e-5``, ``2^20``, ``1.25K``, ``2.5Mi``, ``1_000``, ``-1K``.

Values are parsed with exact rational arithmetic (``fractions.Fraction``) so that ``1.25K`` is exactly 1250 and
``3e-5`` is the float closest to 3e-05, with no rounding error picked up on the way. Integer fields refuse a
fractional result instead of truncating it.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BeforeValidator

_SUFFIXES: dict[str, int] = {
    "K": 10**3,
    "M": 10**6,
    "B": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_PATTERN = re.compile(
    rf"^(?P<num>{_NUMBER})(?:\^(?P<exp>[+-]?\d+))?(?P<suffix>%|Ki|Mi|Gi|Ti|K|M|B|T)?$",
)

HUMAN_FORMATS = (
    "a number, X%, XeY, X^Y, or X with a suffix K/M/B/T (powers of 10) or Ki/Mi/Gi/Ti (powers of 2)"
)


class HumanNumberError(ValueError):
    """A string that looks numeric but is not a valid human-friendly number."""


def parse_human(value: str) -> Fraction:
    """Parse a human-friendly number string into an exact fraction."""
    text = value.strip().replace("_", "")
    match = _PATTERN.match(text)
    if match is None:
        raise HumanNumberError(f"{value!r} is not {HUMAN_FORMATS}")
    result = Fraction(match["num"])
    if match["exp"] is not None:
        exponent = int(match["exp"])
        if result == 0 and exponent < 0:
            raise HumanNumberError(f"{value!r}: zero cannot be raised to a negative power")
        result = result**exponent
    suffix = match["suffix"]
    if suffix == "%":
        result /= 100
    elif suffix:
        result *= _SUFFIXES[suffix]
    return result


def looks_numeric(value: Any) -> bool:
    """True for strings that start like a number (so a parse failure is a user error, not a non-number)."""
    return isinstance(value, str) and bool(re.match(r"^\s*[+-]?(\d|\.\d)", value))


def to_int(value: Any) -> Any:
    """Validator for integer fields: human strings become exact ints; fractions are refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        number = parse_human(value)
        if number.denominator != 1:
            raise ValueError(
                f"{value!r} is {float(number):g}, not a whole number; this field needs an integer"
            )
        return int(number)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number; this field needs an integer")
        return int(value)
    return value


def to_float(value: Any) -> Any:
    """Validator for float fields: human strings become the float nearest to their exact value."""
    if isinstance(value, str):
        return float(parse_human(value))
    return value


def coerce_tree(value: Any) -> Any:
    """Convert human-friendly number strings anywhere inside a nested dict/list (the ``deepspeed:`` block).

    Strings that are not numbers (``"auto"``, ``"cpu"``) are left alone; a string that starts like a number
    but does not parse is an error rather than being passed through silently.
    """
    if isinstance(value, dict):
        return {key: coerce_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [coerce_tree(item) for item in value]
    if looks_numeric(value):
        number = parse_human(value)
        return int(number) if number.denominator == 1 else float(number)
    return value


def to_interval(value: Any) -> Any:
    """Validator for step intervals: a whole number of steps, or (as in Hugging Face's ``eval_steps``,
    ``save_steps``, ``logging_steps``) a fraction below 1 of the run's total steps, resolved when the step
    count is known."""
    if isinstance(value, str) and looks_numeric(value):
        number = parse_human(value)
        value = int(number) if number.denominator == 1 else float(number)
    if isinstance(value, float) and not value.is_integer():
        if 0 < value < 1:
            return value
        raise ValueError(
            f"{value!r}: a step interval is a whole number of steps, or a fraction below 1 of the run's total "
            "steps (0.2: every 20% of the run)"
        )
    return to_int(value)


HumanInt = Annotated[int, BeforeValidator(to_int)]
#: a whole number of steps, or a fraction in (0, 1) of the run's steps (``plan.resolve_intervals``)
StepInterval = Annotated[int | float, BeforeValidator(to_interval)]
HumanFloat = Annotated[float, BeforeValidator(to_float)]
