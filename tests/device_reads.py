"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode``: a torch function mode that takes every tensor of a
step as living on the device, except the host tensors a batch brings (``host``) and what is computed from host
tensors alone, and records what would make a GPU run wait or copy:

- ``reads``: values read back to the host (``item``, ``tolist``, ``nonzero``, ``bool``/``int``/``float``/
  ``index`` of a tensor, ``numpy``, ``cpu``, ``masked_select``), a ``.to()`` that moves a device tensor to
  the host (``"cpu"``, or a host tensor's device), and indexing with a boolean mask (its result's size
  depends on the values);
- ``copies``: host-to-device copies (``.to(device)`` of a host tensor, ``torch.tensor``/``as_tensor`` onto a
  device).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(
    {
        "item",
        "tolist",
        "nonzero",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "numpy",
        "cpu",
        "masked_select",
    }
)
#: factory functions that copy Python data into a tensor
FROM_DATA = frozenset({"tensor", "as_tensor"})


def _is_device(value: Any) -> bool:
    return isinstance(value, torch.device | torch.Tensor) or (
        isinstance(value, str) and value.split(":")[0] in ("cpu", "cuda", "xpu", "mps", "meta")
    )


def _moves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.to`` call names a device (``.to(torch.int32)`` only converts)."""
    return kwargs.get("device") is not None or any(_is_device(a) for a in args[1:])


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(_tensors(value))
    return found


class DeviceReads(TorchFunctionMode):
    def __init__(self, host: list[torch.Tensor] = ()) -> None:  # type: ignore[assignment]
        super().__init__()
        self._host: list[torch.Tensor] = list(host)  # kept alive, so that their ids stay theirs
        self._host_ids = {id(t) for t in self._host}
        self.reads: list[str] = []
        self.copies: list[str] = []
        self.where: list[str] = []  # the posttrain line of each read or copy, for failure messages

    def is_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._host_ids

    def _mark_host(self, result: Any) -> None:
        for tensor in _tensors([result]):
            self._host.append(tensor)
            self._host_ids.add(id(tensor))

    def _to_host(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A device tensor's ``.to()`` that goes to the host: named ``"cpu"``, or another (host) tensor's
        device. A ``torch.device`` object is taken as the tensor's own device (``.to(x.device)``: no copy),
        since on the CPU both are the same."""
        targets = [kwargs.get("device"), *args[1:]]
        return any(
            (isinstance(t, str) and t.startswith("cpu")) or (isinstance(t, torch.Tensor) and self.is_host(t))
            for t in targets
        )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(list(args) + list(kwargs.values()))
        on_host = all(self.is_host(t) for t in inputs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        device_first = first is not None and not self.is_host(first)
        to_device = False
        if name in READS and device_first:
            self.reads.append(name)
        elif name == "to" and first is not None and _moves(args, kwargs):
            to_device = True
            if self.is_host(first):
                self.copies.append("to")
            elif self._to_host(args, kwargs):
                self.reads.append("to")
        elif name == "__getitem__" and device_first and _boolean_index(args[1]):
            self.reads.append("boolean mask")
        elif name in FROM_DATA and kwargs.get("device") is not None:
            self.copies.append(name)
        if len(self.reads) + len(self.copies) > len(self.where):
            self.where.append(_caller())
        result = func(*args, **kwargs)
        made_on_host = not inputs and kwargs.get("device") is None  # a factory without a device
        if (inputs and on_host and not to_device) or made_on_host:
            self._mark_host(result)
        return result


def _boolean_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "posttrain" in f.filename or "/tests/" in f.filename]
    frames = [f for f in frames if not f.filename.endswith("device_reads.py")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
