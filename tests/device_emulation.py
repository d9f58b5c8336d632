"""A CPU stand-in for tensors on an accelerator, for the host/device rules a GPU enforces.

``DeviceTensor`` behaves like a CUDA tensor seen from host code: it cannot become a numpy
array, it cannot index a host tensor, and reading it on the host (``.cpu()``, ``.item()``,
``.tolist()``, ``int()``, ``bool()``...) is a device->host synchronisation, counted in
``DeviceTensor.syncs``. Everything else computes as on CPU, and results of operations on it
stay DeviceTensors. So host code that would fail or stall on a GPU fails or counts here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_SYNCS = {
    torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
    torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__index__,
}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceTensor(torch.Tensor):
    syncs = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert a device tensor to numpy: copy it to the host first")
        if func in _INDEXING and not isinstance(args[0], cls):
            indices, _ = tree_flatten(args[1])
            if any(isinstance(index, cls) for index in indices):
                raise RuntimeError("indices should be either on cpu or on the same device as "
                                   "the indexed tensor (cpu)")
        to_host = func in _SYNCS or (func is torch.Tensor.to and _targets_cpu(args, kwargs))
        if to_host:
            cls.syncs += 1
        result = super().__torch_function__(func, types, args, kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.to) and to_host:
            return result.as_subclass(torch.Tensor)
        return result


def on_device(tensor: torch.Tensor) -> DeviceTensor:
    return tensor.as_subclass(DeviceTensor)


def is_on_device(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DeviceTensor)


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(target, str) and target.startswith("cpu"))
        or (isinstance(target, torch.device) and target.type == "cpu")
        for target in targets
    )


def emulate_transfers(monkeypatch: Any) -> None:
    """``engine.worker.host_transfer.to_host``'s device path on DeviceTensors: a plain host buffer
    for the pinned one, the wait on the copies counted as the synchronisation it is."""
    from kvcompress.engine.worker import host_transfer

    def wait(device: torch.device) -> None:
        DeviceTensor.syncs += 1

    monkeypatch.setattr(host_transfer, "_on_device", is_on_device)
    monkeypatch.setattr(host_transfer, "_pinned",
                        lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(host_transfer, "_wait", wait)
