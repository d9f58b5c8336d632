"""The compression step's one device->host transfer.

The plans and decode-eviction choices are made on the device (where the scores are) and the
moves are planned on the host (next to the page tables). Reading a CUDA tensor on the host
waits for the device, so every tensor the host needs in a step comes over together: one
concatenation on the device, one copy into pinned host memory, one wait.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (integer dtypes, any devices) as host tensors of the same shapes and
    dtypes, in order, brought over in one copy per device: one device->host transfer on a
    worker's device, none for tensors already on the host."""
    tensors = list(tensors)
    if any(tensor.is_floating_point() or tensor.is_complex() for tensor in tensors):
        raise TypeError("to_host carries integer tensors (indices, counts) only")
    parts: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for number, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(number)
    # Host tensors are concatenated too (free): joining them to the device's would be a
    # host->device copy from pageable memory, itself a synchronisation.
    for numbers in by_device.values():
        # One flat int64 tensor (.to(dtype) alone: no copy when it already is one).
        flat = torch.cat([tensors[number].reshape(-1).to(torch.int64) for number in numbers])
        host, offset = _copy_to_host(flat), 0
        for number in numbers:
            tensor = tensors[number]
            count = tensor.numel()
            parts[number] = host[offset:offset + count].view(tensor.shape).to(tensor.dtype)
            offset += count
    return parts  # type: ignore[return-value]  # every entry set above


def _copy_to_host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` on the host. From CUDA: a non-blocking copy into pinned memory (PyTorch's
    caching host allocator reuses the pinned buffers from step to step) and a wait on an
    event recorded after it, the step's one synchronisation. Elsewhere a plain copy (free on
    CPU)."""
    if flat.device.type != "cuda":
        return flat.to("cpu")
    pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    pinned.copy_(flat, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(flat.device))
    copied.synchronize()
    return pinned
