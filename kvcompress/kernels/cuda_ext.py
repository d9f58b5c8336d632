"""The native CUDA cache move (``csrc/``): prebuilt as ``kvcompress._C`` or JIT-compiled.

``native_move_kv()`` returns ``torch.ops.kvcompress.move_kv`` (same contract as
:func:`kvcompress.kernels.move_kv`: ``(pool, src_slots, dst_slots)``, CUDA tensors, negative
slots skip, destinations distinct and never a pending source) or None when it cannot be had:

1. ``import kvcompress._C`` (built by ``setup.py`` when a CUDA torch and nvcc were present);
2. else a JIT build of the ``csrc/`` sources with ``torch.utils.cpp_extension.load`` (needs a
   source checkout, nvcc, ninja and a CUDA build of torch; cached under
   ``TORCH_EXTENSIONS_DIR``, so only the first use compiles);
3. else None: callers fall back to the Triton kernel or the torch reference.

``KVCOMPRESS_CUDA_EXT=0`` disables both (Triton / torch only); ``KVCOMPRESS_CUDA_EXT=prebuilt``
allows only the prebuilt module (no compiler run). No vLLM imports.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "KVCOMPRESS_CUDA_EXT"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
# The op's translation units; module.cpp only matters to the prebuilt Python module.
JIT_SOURCES = ("move_kv_binding.cpp", "move_kv_kernel.cu")
JIT_NAME = "kvcompress_move_kv"

MoveFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def registered_move_kv() -> MoveFn | None:
    """``torch.ops.kvcompress.move_kv`` when some loaded library registered it."""
    try:
        return torch.ops.kvcompress.move_kv
    except (AttributeError, RuntimeError):
        return None


def jit_unavailable_reason() -> str | None:
    """Why a JIT build cannot run here (None when it can be attempted)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    missing = [name for name in JIT_SOURCES if not (CSRC_DIR / name).is_file()]
    if missing:
        return f"csrc/ sources not found next to the package ({', '.join(missing)})"
    return None


def build_jit(verbose: bool = False) -> None:
    """Compile and load the op from ``csrc/`` (raises on failure)."""
    from torch.utils.cpp_extension import load

    load(
        name=JIT_NAME,
        sources=[str(CSRC_DIR / name) for name in JIT_SOURCES],
        extra_include_paths=[str(CSRC_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        is_python_module=False,  # a plain library: loading it registers the op
        verbose=verbose,
    )


@functools.lru_cache(maxsize=1)
def native_move_kv() -> MoveFn | None:
    """The native move, loading (or, once, building) it on first call; None if unavailable."""
    mode = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return None
    move = registered_move_kv()
    if move is not None:
        return move
    try:
        import kvcompress._C  # noqa: F401  (registers the op)
    except ImportError:
        pass
    else:
        return registered_move_kv()
    if mode == "prebuilt":
        return None
    reason = jit_unavailable_reason()
    if reason is not None:
        logger.debug("kvcompress: no native cache move (%s)", reason)
        return None
    logger.info("kvcompress: building the CUDA cache-move extension (first use only)")
    try:
        build_jit()
    except Exception as error:  # a missing ninja or compiler must not stop the engine
        logger.warning(
            "kvcompress: could not build the CUDA cache-move extension (%s); compaction "
            "uses the Triton move instead. Set %s=0 to skip the attempt.", error, ENV_SWITCH,
        )
        return None
    return registered_move_kv()
