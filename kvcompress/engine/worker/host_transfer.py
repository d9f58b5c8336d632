"""The compression step's one device->host transfer.

The plans and decode-eviction choices are made on the device (where the scores are) and the
moves are planned on the host (next to the page tables). Reading a CUDA tensor on the host
waits for the device, so every tensor the host needs in a step comes over together: each
copied straight into its place in one pinned host buffer, then one wait. Nothing is joined
on the device first: the plans grow with the prompt times the layers, and a device-side
concatenation would hold them twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Offsets of the tensors in the pinned buffer are multiples of this, so that each slice of
# bytes can be viewed as its tensor's dtype (int64 at most).
_ALIGN = 8


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (integer dtypes, any devices) as host tensors of the same shapes and
    dtypes, in order, brought over with one wait per device: one device->host
    synchronisation on a worker's device. Tensors already on the host are returned as they
    are (not copied: the callers only read them)."""
    tensors = list(tensors)
    if any(tensor.is_floating_point() or tensor.is_complex() for tensor in tensors):
        raise TypeError("to_host carries integer tensors (indices, counts) only")
    parts: list[torch.Tensor | None] = [
        None if _on_device(tensor) else tensor for tensor in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for number, tensor in enumerate(tensors):
        if parts[number] is None:
            by_device.setdefault(tensor.device, []).append(number)
    for numbers in by_device.values():
        hosts = _copy_to_host([tensors[number] for number in numbers])
        for number, host in zip(numbers, hosts):
            parts[number] = host
    return parts  # type: ignore[return-value]  # every entry set above


def _on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` needs a transfer to be read on the host."""
    return tensor.device.type != "cpu"


def _copy_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (one device) on the host: non-blocking copies into slices of one pinned
    buffer (PyTorch's caching host allocator reuses pinned buffers from step to step), then
    a wait on an event recorded after them, the step's one synchronisation."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    buffer = _pinned(total)
    hosts = []
    for tensor, offset in zip(tensors, offsets):
        size = tensor.numel() * tensor.element_size()
        host = buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        hosts.append(host)
    _wait(tensors[0].device)
    return hosts


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _wait(device: torch.device) -> None:
    """Until the copies queued so far on ``device``'s current stream are done."""
    if device.type != "cuda":  # another accelerator: a device-wide wait
        torch.accelerator.synchronize(device)
        return
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))
    copied.synchronize()
