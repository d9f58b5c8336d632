"""Per-request compression settings: validated at admission, resolved on the worker.

A request may override the engine's method, budget or ratio, window, beta, pooling and
sinks through ``SamplingParams.extra_args`` (offline) or ``vllm_xargs`` (HTTP), e.g.
``{"kv_compression": "snapkv", "kv_budget": 256}`` or ``{"kv_compression": "none"}``.

vLLM validates requests in the front-end process through the ``validate_params`` hook of
logits processors; this module's processor changes no logits, it only turns a bad setting
into a clear ``VLLMValidationError`` (HTTP 400) before the request reaches the engine.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kvcompress.settings.config import KVCompressionConfig, KVCompressionConfigError

VALIDATOR_PATH = "kvcompress.engine.request_settings:RequestSettingsValidator"

# The engine config of this front-end process, recorded when its engine config was made.
_engine_config: KVCompressionConfig | None = None


def record_engine_config(config: KVCompressionConfig) -> None:
    global _engine_config
    _engine_config = config


def resolve(engine_config: KVCompressionConfig, sampling_params: Any) -> KVCompressionConfig:
    extra_args = getattr(sampling_params, "extra_args", None) if sampling_params else None
    return engine_config.with_request_overrides(extra_args)


class RequestSettingsValidator(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        if _engine_config is None:
            return
        try:
            resolve(_engine_config, sampling_params)
        except KVCompressionConfigError as error:
            raise VLLMValidationError(str(error), parameter="vllm_xargs") from None

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
