"""CUDA worker and model runner for kvcompress: vLLM's GPU worker with the paged-KV runner.

Everything but the kernel is shared with the CPU path (``worker.runner``, the runtime,
the scheduler). What is CUDA-specific here:

- the platform kernel: kvcompress's Triton kernels (``attention/gpu_kernel.py``);
- the attention backend is selected through the registry's CUSTOM slot: engine_args.py
  sets ``--attention-backend CUSTOM`` and this worker resolves CUSTOM to ours while it
  builds the model (the same scoped override the CPU worker uses for CPU_ATTN);
- the metadata builder declares no CUDA-graph support, so vLLM compiles attention as a
  piecewise split and runs it eagerly between captured pieces (or runs fully eager);
- the small KV cache vLLM builds to profile graph memory is dropped with its runtime
  (dummy runs own no pages: the shared mixin hides the runtime from them).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from kvcompress.engine.engine_args import CUDA_ATTENTION_BACKEND
from kvcompress.engine.worker.runner import PagedKVRunnerMixin, require_v1_model_runner
from kvcompress.log import get_logger
from kvcompress.paging import PageLayout
from kvcompress.step import PlatformKernel, register_runtime
from kvcompress.vllm_hooks import attention_backend_override

logger = get_logger(__name__)

ATTENTION_BACKEND_NAME = CUDA_ATTENTION_BACKEND
ATTENTION_BACKEND_PATH = "kvcompress.attention.backend.KVCompressCudaAttentionBackend"


class KVCompressGPUModelRunner(PagedKVRunnerMixin, GPUModelRunner):
    def make_kernel(self, layout: PageLayout, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> PlatformKernel:
        from kvcompress.attention.gpu_kernel import TritonPagedKernel
        from kvcompress.kernels.cuda_ext import ENV_SWITCH, jit_unavailable_reason

        kernel = TritonPagedKernel(layout, dtype, self.device, kv_cache_dtype=kv_cache_dtype)
        if kernel.native_move is not None:
            logger.info("kvcompress: compaction moves K/V with the native CUDA kernel")
        else:
            logger.info(
                "kvcompress: compaction moves K/V with the Triton kernel (native CUDA move "
                "unavailable: %s)",
                jit_unavailable_reason() or f"disabled by {ENV_SWITCH} or its build failed",
            )
        return kernel

    def _cleanup_profiling_kv_cache(self) -> None:
        super()._cleanup_profiling_kv_cache()
        # vLLM profiles CUDA-graph memory over a minimal KV cache it then discards; our
        # runtime over it goes too (initialize_kv_cache builds the real one next).
        if self.paged_runtime is not None:
            register_runtime(self.vllm_config, None)
            self.paged_runtime = None


class KVCompressGPUWorker(Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        require_v1_model_runner(self.use_v2_model_runner)
        return KVCompressGPUModelRunner(self.vllm_config, self.device)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # Attention layers pick their backend while the model is built.
        with attention_backend_override(ATTENTION_BACKEND_NAME, ATTENTION_BACKEND_PATH):
            super().load_model(*args, **kwargs)
