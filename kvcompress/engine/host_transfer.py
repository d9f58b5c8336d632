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
    dtypes, in order, brought over in at most one device->host copy. Host tensors come back
    as they are; without any device tensor nothing is copied."""
    tensors = list(tensors)
    if not tensors:
        return []
    if any(tensor.is_floating_point() or tensor.is_complex() for tensor in tensors):
        raise TypeError("to_host carries integer tensors (indices, counts) only")
    device = next((tensor.device for tensor in tensors if tensor.device.type != "cpu"), None)
    if device is not None:
        # Host tensors join the device ones (a small host->device copy, no wait) so that one
        # copy brings everything back.
        tensors = [tensor if tensor.device == device else tensor.to(device)
                   for tensor in tensors]
    # One flat int64 tensor (.to(dtype) alone: no device argument, no copy when it already is).
    flat = torch.cat([tensor.reshape(-1).to(torch.int64) for tensor in tensors])
    host = _copy_to_host(flat)
    parts, offset = [], 0
    for tensor in tensors:
        count = tensor.numel()
        parts.append(host[offset:offset + count].view(tensor.shape).to(tensor.dtype))
        offset += count
    return parts


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
