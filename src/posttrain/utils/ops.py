"""Building DeepSpeed's compiled ops (``fused_adam``, ``cpu_adam``) on the machines users have.

DeepSpeed's op builder reads ``TORCH_CUDA_ARCH_LIST`` and parses each entry as ``major.minor[+PTX]``; the
arch-specific suffixes that CUDA images commonly set (``9.0a`` for H100, ``10.0a``, ``12.0f``) make it fail with
``ValueError: invalid literal for int() with base 10: '0a'``. For the build only, the list is rewritten to
what DeepSpeed parses (the suffix dropped: the Adam kernels use no arch-specific instruction) and restored
afterwards; a build that still fails is one clear line, never a traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from posttrain.errors import UserError

ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
_ENTRY = re.compile(r"^(\d+)\.(\d+)[a-z]*(\+PTX)?$", re.IGNORECASE)


def buildable_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's builder parses it: ``9.0a`` -> ``9.0``, ``9.0a+PTX`` ->
    ``9.0+PTX``, entries it cannot read dropped; None when nothing usable is left (DeepSpeed then asks the
    device)."""
    if value is None:
        return None
    kept = []
    for entry in re.split(r"[;\s]+", value.strip()):
        match = _ENTRY.match(entry)
        if match:
            major, minor, ptx = match.groups()
            token = f"{major}.{minor}{'+PTX' if ptx else ''}"
            if token not in kept:
                kept.append(token)
    return ";".join(kept) or None


@contextmanager
def deepspeed_op_build(op: str) -> Iterator[None]:
    """Around the construction of a DeepSpeed op (which builds it the first time): a parseable arch list,
    and a build failure turned into one line that says what to set."""
    original = os.environ.get(ARCH_LIST)
    usable = buildable_arch_list(original)
    _set(usable)
    try:
        yield
    except (RuntimeError, ValueError, OSError, ImportError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"optimizer.type={op}: DeepSpeed could not build its {op} op ({reason}); "
            f"{ARCH_LIST}={original!r} was used as {usable!r}. Set {ARCH_LIST} to your GPU's compute "
            "capability (e.g. 9.0 for H100, 8.0 for A100) or unset it, make sure nvcc and a C++ compiler are "
            "installed, or use optimizer.type: adamw (no build)"
        ) from None
    finally:
        _set(original)


def _set(value: str | None) -> None:
    if value is None:
        os.environ.pop(ARCH_LIST, None)
    else:
        os.environ[ARCH_LIST] = value
