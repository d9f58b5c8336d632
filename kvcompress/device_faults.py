"""When the worker may retry after an exception (docs/design.md, "Compaction").

The compression step contains its failures: a batched stage that raises is retried request
by request, and a request that fails again is ended alone. That is honest for errors raised
on the host when the work is submitted (a shape, an index, a validation error, Triton
refusing a launch, CUDA running out of memory): nothing ran, the device is fine. It is not
honest on CUDA for a device fault (an illegal address, a device-side assert): kernels run
asynchronously, so the fault surfaces at some later call, not necessarily in the stage or
request that caused it, and it is sticky: the CUDA context is unusable and every later call
fails. Retrying would blame an arbitrary request and go on with a dead device. So on CUDA a
fault that is, or left, a broken context is raised again: the worker fails loudly and vLLM
fails the engine. On CPU every error is synchronous and the retries stay as they are.
"""

from __future__ import annotations

import torch

from kvcompress.log import get_logger

logger = get_logger(__name__)

# Messages of CUDA's errors as torch raises them (RuntimeError before torch 2.8's
# AcceleratorError, and still from some extensions and Triton's launcher).
_CUDA_FAULT_MARKERS = ("CUDA error", "CUDA driver error", "device-side assert",
                       "illegal memory access", "CUBLAS_STATUS", "CUDNN_STATUS")


def is_device_fault(error: BaseException) -> bool:
    """Whether ``error`` is the accelerator reporting a fault (not an out-of-memory: an
    allocation that failed left the device as it was)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return any(marker in str(error) for marker in _CUDA_FAULT_MARKERS)


def may_retry(error: BaseException, device: torch.device) -> bool:
    """Whether the work that raised ``error`` on ``device`` may be retried request by
    request. Off CUDA: always. On CUDA: not after a device fault, nor when the context is
    broken by an earlier one (a synchronisation fails: it reports the sticky error), which
    the host-side error seen here may be a consequence of."""
    if device.type != "cuda":
        return True
    if is_device_fault(error):
        return False
    try:
        # Only on this error path: waits for the work submitted so far, which surfaces a
        # pending asynchronous fault.
        torch.cuda.synchronize(device)
    except Exception:  # any failure here means the context is gone
        logger.exception("kvcompress: the CUDA context is broken")
        return False
    return True


def raise_if_fatal(error: Exception, device: torch.device, stage: str) -> None:
    """Raise ``error`` again when it may not be contained (``may_retry``), after saying so;
    return otherwise, for the caller to retry or fail the request."""
    if may_retry(error, device):
        return
    logger.critical("kvcompress: %s failed with a CUDA device fault; faults are asynchronous "
                    "and leave the CUDA context unusable, so no request is retried or failed "
                    "alone: the worker stops", stage)
    raise error
