"""Imports that cost start-up time unless done with care."""

from __future__ import annotations

import importlib.abc
import os
import sys
from types import ModuleType


def accelerator() -> str:
    """The one place the accelerator is chosen: ``DS_ACCELERATOR`` when set, else ``cuda`` when PyTorch
    sees a CUDA device, else ``cpu``; written back to ``DS_ACCELERATOR`` so DeepSpeed picks the same one
    (and stays quiet about guessing). The process group's backend and device follow it."""
    name = os.environ.get("DS_ACCELERATOR")
    if not name:
        import torch

        name = "cuda" if torch.cuda.is_available() else "cpu"
        os.environ["DS_ACCELERATOR"] = name
    return name


class _AcceleratorBeforeDeepSpeed(importlib.abc.MetaPathFinder):
    """Chooses the accelerator just before DeepSpeed's first import, whoever imports it (posttrain or
    transformers' integrations), and removes itself: a command that never needs DeepSpeed never pays for
    importing torch to ask for a GPU."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "deepspeed":
            sys.meta_path.remove(self)
            accelerator()
        return None  # the normal finders do the import


def choose_accelerator_on_demand() -> None:
    """Set ``DS_ACCELERATOR`` when DeepSpeed is first imported rather than now (see ``accelerator``)."""
    if "deepspeed" in sys.modules:
        accelerator()
    elif not any(isinstance(finder, _AcceleratorBeforeDeepSpeed) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AcceleratorBeforeDeepSpeed())


def import_deepspeed() -> ModuleType:
    """``import deepspeed`` without the 1.5 s it would spend importing mlflow.

    DeepSpeed's autotuner, loaded with the package, imports mlflow whenever it is installed (it is, for
    posttrain's ``mlflow`` tracker) to log autotuning experiments, which posttrain never runs. For the
    first import only, mlflow is marked unimportable, so the autotuner records that it has none; posttrain's
    own mlflow tracker imports it normally later."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    accelerator()
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    return deepspeed


class _TorchaoImportNoise:
    """Drops the lines torchao's import prints on machines where its compiled kernels cannot load (a CPU
    build of torch, or another torch than the wheel was built for: ``Failed to load .../torchao/_C_*.so``)
    and torch's note about the enums torchao registers for ``torch.compile``. Nothing else is dropped: the
    float8 training posttrain uses is written in PyTorch and needs none of those kernels."""

    def filter(self, record: object) -> bool:
        message = record.getMessage()  # type: ignore[attr-defined]
        if message.startswith("Failed to load ") and "torchao" in message:
            return False
        return "is an Enum subclass and is now natively supported by torch.compile" not in message


def quiet_torchao_import() -> None:
    """Install :class:`_TorchaoImportNoise` on the two loggers that print it, before anything imports torchao
    (transformers imports it while loading model classes when it is installed). Costs no import."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoImportNoise) for f in logger.filters):
            logger.addFilter(_TorchaoImportNoise())
