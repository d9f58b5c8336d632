"""CPU worker and model runner for kvcompress: vLLM's CPU worker with the paged-KV runner.

Everything but the kernel is shared with the CUDA path (``worker.runner``, the runtime,
the scheduler). What is CPU-specific here: the platform kernel (vLLM's own C++ attention
kernel re-indexed per head, ``attention/cpu_kernel.py``) and the registry slot our
attention backend fills while the model is built (CPU_ATTN, the only one vLLM's CPU
platform picks).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from kvcompress.engine.worker.runner import PagedKVRunnerMixin, require_v1_model_runner
from kvcompress.paging import PageLayout
from kvcompress.step import PlatformKernel
from kvcompress.vllm_hooks import attention_backend_override

ATTENTION_BACKEND_NAME = "CPU_ATTN"
ATTENTION_BACKEND_PATH = "kvcompress.attention.backend.KVCompressAttentionBackend"


class KVCompressCPUModelRunner(PagedKVRunnerMixin, CPUModelRunner):
    def make_kernel(self, layout: PageLayout, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> PlatformKernel:
        from kvcompress.attention.cpu_kernel import CpuPagedKernel

        return CpuPagedKernel(layout, dtype, kv_cache_dtype=kv_cache_dtype)


class KVCompressCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        require_v1_model_runner(self.use_v2_model_runner)
        # vLLM's init_device builds the stock runner; replace it before the model loads.
        self.model_runner = KVCompressCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # Attention layers pick their backend while the model is built.
        with attention_backend_override(ATTENTION_BACKEND_NAME, ATTENTION_BACKEND_PATH):
            super().load_model(*args, **kwargs)
