"""CUDA worker and model runner for kvcompress: vLLM's GPU worker with the paged-KV runner.

Everything but the kernel is shared with the CPU path (PagedKVRunnerMixin, runtime,
scheduler). What is CUDA-specific here:

- the attention backend is selected through the registry's CUSTOM slot: engine/setup.py
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
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from kvcompress.attention.backend import KVCompressAttentionBackend
from kvcompress.engine.model_runner import PagedKVRunnerMixin
from kvcompress.engine.runtime import register_runtime
from kvcompress.log import get_logger
from kvcompress.vllm_hooks import attention_backend_override

logger = get_logger(__name__)

CUDA_BACKEND_PATH = "kvcompress.engine.gpu.KVCompressCudaAttentionBackend"
CUDA_ATTENTION_BACKEND = AttentionBackendEnum.CUSTOM.name  # engine/setup.py selects it


class KVCompressCudaAttentionBackend(KVCompressAttentionBackend):
    """The shared backend under the registry name it is selected by on CUDA."""

    @staticmethod
    def get_name() -> str:
        return CUDA_ATTENTION_BACKEND


class KVCompressGPUModelRunner(PagedKVRunnerMixin, GPUModelRunner):
    def make_kernel(self, layout: Any, dtype: torch.dtype) -> Any:
        from kvcompress.attention.gpu_kernel import TritonPagedKernel
        from kvcompress.kernels.cuda_ext import ENV_SWITCH, jit_unavailable_reason

        kernel = TritonPagedKernel(layout, dtype, self.device)
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
        if self.use_v2_model_runner:
            raise NotImplementedError(
                "kvcompress needs vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        return KVCompressGPUModelRunner(self.vllm_config, self.device)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # Attention layers pick their backend while the model is built.
        with attention_backend_override(CUDA_ATTENTION_BACKEND, CUDA_BACKEND_PATH):
            super().load_model(*args, **kwargs)
