"""vLLM workers for kvcompress: vLLM's own workers with the paged-KV model runner."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from kvcompress.engine.model_runner import KVCompressCPUModelRunner
from kvcompress.vllm_hooks import attention_backend_override

BACKEND_PATH = "kvcompress.attention.backend.KVCompressAttentionBackend"


class KVCompressCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise NotImplementedError(
                "kvcompress needs vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        # vLLM's init_device builds the stock runner; replace it before the model loads.
        self.model_runner = KVCompressCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # Attention layers pick their backend while the model is built.
        with attention_backend_override("CPU_ATTN", BACKEND_PATH):
            super().load_model(*args, **kwargs)
