"""Engine wiring of the CUDA path, checked without a GPU (the platform is faked)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import vllm.platforms
from vllm.engine.arg_utils import EngineArgs

from kvcompress.engine import engine_args as setup

V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# Engine arguments load vLLM's plugins, and ours imports vLLM modules that read the platform
# when first imported: load them now, under the real platform, before a test fakes it (alone,
# this file failed otherwise).
EngineArgs(model="unused")


def _platform(kind: str) -> SimpleNamespace:
    return SimpleNamespace(
        device_name=kind, is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda"
    )


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm.platforms, "current_platform", _platform("cuda"))
    # Record the variable's state first, so whatever prepare_engine_args sets is undone.
    monkeypatch.setenv(V2_ENV, "0")
    monkeypatch.delenv(V2_ENV)


def _engine_args(**kwargs) -> EngineArgs:
    return EngineArgs(model="unused", additional_config={"kv_compression": "pyramidkv"},
                      **kwargs)


@pytest.mark.parametrize(
    "kind, worker", [("cpu", setup.CPU_WORKER_CLS), ("cuda", setup.GPU_WORKER_CLS)]
)
def test_worker_class_follows_the_platform(monkeypatch, kind, worker):
    monkeypatch.setattr(vllm.platforms, "current_platform", _platform(kind))
    assert setup._worker_cls_for_platform() == worker


def test_other_platforms_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(vllm.platforms, "current_platform", _platform("rocm"))
    with pytest.raises(NotImplementedError, match="rocm platform"):
        setup._worker_cls_for_platform()


def test_cuda_selects_our_backend_and_the_v1_runner(on_cuda):
    engine_args = _engine_args()
    setup.prepare_engine_args(engine_args)
    assert engine_args.worker_cls == setup.GPU_WORKER_CLS
    assert engine_args.attention_backend == "CUSTOM"
    assert os.environ[V2_ENV] == "0"
    assert engine_args.async_scheduling is False
    setup.prepare_engine_args(engine_args)  # idempotent: our own choices are accepted


def test_cpu_settings_are_left_alone(monkeypatch):
    monkeypatch.setattr(vllm.platforms, "current_platform", _platform("cpu"))
    engine_args = _engine_args()
    setup.prepare_engine_args(engine_args)
    assert engine_args.worker_cls == setup.CPU_WORKER_CLS
    assert engine_args.attention_backend is None


def test_cuda_refuses_another_attention_backend(on_cuda):
    with pytest.raises(NotImplementedError, match="--attention-backend FLASH_ATTN"):
        setup.prepare_engine_args(_engine_args(attention_backend="FLASH_ATTN"))


def test_cuda_refuses_model_runner_v2(on_cuda, monkeypatch):
    monkeypatch.setenv(V2_ENV, "1")
    with pytest.raises(NotImplementedError, match=V2_ENV):
        setup.prepare_engine_args(_engine_args())


def test_no_graph_support_degrades_to_piecewise_graphs():
    """What vLLM makes of our builder's AttentionCGSupport.NEVER with its CUDA defaults."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from kvcompress.attention.backend import KVCompressMetadataBuilder

    support = KVCompressMetadataBuilder._cudagraph_support
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config.set_splitting_ops_for_v1("allgather_reducescatter")
    assert config.resolve_cudagraph_mode_and_sizes(support, "CUSTOM") == CUDAGraphMode.PIECEWISE
    eager = CompilationConfig(mode=CompilationMode.NONE,
                              cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    eager.set_splitting_ops_for_v1("allgather_reducescatter")
    assert eager.resolve_cudagraph_mode_and_sizes(support, "CUSTOM") == CUDAGraphMode.NONE


def test_custom_slot_resolves_to_our_backend_only_while_the_model_is_built():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvcompress.attention.backend import KVCompressCudaAttentionBackend
    from kvcompress.engine.worker import gpu
    from kvcompress.vllm_hooks import attention_backend_override

    with attention_backend_override(gpu.ATTENTION_BACKEND_NAME, gpu.ATTENTION_BACKEND_PATH):
        backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend is KVCompressCudaAttentionBackend
    assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    common = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                  use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                  use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
                  attn_type="decoder")
    assert backend.validate_configuration(**common) == []
    # Sliding-window layers are served (their dead pages freed by the page layout).
    assert backend.validate_configuration(**{**common, "has_sliding_window": True}) == []
    assert backend.validate_configuration(**{**common, "use_mla": True})


def test_gpu_runner_builds_the_triton_kernel_and_hides_its_runtime_from_dummy_runs():
    from kvcompress.attention.gpu_kernel import TritonPagedKernel
    from kvcompress.engine.worker import gpu
    from kvcompress.paging import PageLayout
    from kvcompress.step import register_runtime, runtime_for

    layout = PageLayout(2, 2, 32, 16, 4, 64)
    runner = SimpleNamespace(device=torch.device("cpu"))
    kernel = gpu.KVCompressGPUModelRunner.make_kernel(runner, layout, torch.float32)
    assert isinstance(kernel, TritonPagedKernel) and kernel.native_move is None
    # fp8 pages: the kernel writes and reads them (its page format says which fp8)
    fp8_kernel = gpu.KVCompressGPUModelRunner.make_kernel(runner, layout, torch.float32,
                                                          "fp8_e5m2")
    assert fp8_kernel.page_format.fp8_dtype == torch.float8_e5m2

    from kvcompress.engine.worker.runner import PagedKVRunnerMixin

    seen = []

    class Base:
        def _dummy_run(self, *args, **kwargs):
            seen.append(runtime_for(self.vllm_config))
            return "ran"

    class Runner(PagedKVRunnerMixin, Base):
        pass

    fake = Runner()
    fake.vllm_config, fake.paged_runtime = object(), object()
    register_runtime(fake.vllm_config, fake.paged_runtime)
    try:
        assert fake._dummy_run(8) == "ran"
        assert seen == [None]  # hidden during the dummy run
        assert runtime_for(fake.vllm_config) is fake.paged_runtime  # and back afterwards
    finally:
        register_runtime(fake.vllm_config, None)


@pytest.mark.parametrize("prefix_caching, explicit, expected", [
    (None, None, "on"), (True, None, "on"), (False, None, "off"), (False, "on", "on"),
    (None, "off", "off"),
])
def test_reuse_follows_vllms_prefix_caching_switch_unless_given(monkeypatch, prefix_caching,
                                                                 explicit, expected):
    monkeypatch.setattr(vllm.platforms, "current_platform", _platform("cpu"))
    config = {"kv_compression": "pyramidkv"}
    if explicit:
        config["kv_reuse"] = explicit
    engine_args = EngineArgs(model="unused", additional_config=config,
                             enable_prefix_caching=prefix_caching)
    assert setup.prepare_engine_args(engine_args).reuse == expected
    # vLLM's block-level cache stays off; kvcompress answers its lookups.
    assert engine_args.enable_prefix_caching is False
    assert engine_args.additional_config["kv_reuse"] == expected
    assert setup.prepare_engine_args(engine_args).reuse == expected  # idempotent


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_are_taken_on_a_cpu_with_avx512_or_amx(monkeypatch, cache_dtype):
    from kvcompress.attention import cpu_kernel

    monkeypatch.setattr(vllm.platforms, "current_platform", _platform("cpu"))
    monkeypatch.setattr(cpu_kernel, "cpu_supports_fp8_pages", lambda: True)
    engine_args = _engine_args(kv_cache_dtype=cache_dtype)
    setup.prepare_engine_args(engine_args)
    assert engine_args.worker_cls == setup.CPU_WORKER_CLS
    assert engine_args.kv_cache_dtype == cache_dtype


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_are_taken_on_cuda_at_any_page_size(monkeypatch, on_cuda, cache_dtype):
    """kvcompress's Triton kernels read and write fp8 pages of any page size (no AVX check)."""
    from kvcompress.attention import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "cpu_supports_fp8_pages", lambda: False)
    engine_args = EngineArgs(model="unused", kv_cache_dtype=cache_dtype,
                             additional_config={"kv_compression": "pyramidkv",
                                                "kv_page_size": 16})
    setup.prepare_engine_args(engine_args)
    assert engine_args.worker_cls == setup.GPU_WORKER_CLS
    assert engine_args.kv_cache_dtype == cache_dtype


@pytest.mark.parametrize("platform, avx512, cache_dtype, page_size, reason", [
    ("cpu", False, "fp8", None, "fp8 on this CPU.*AVX-512 or AMX"),
    ("cpu", True, "fp8_e4m3", 16, "fp8_e4m3 with --kv-page-size 16.*multiple of 32"),
    ("cpu", True, "int8_per_token_head", None,
     r"int8_per_token_head \(allowed: auto, fp8, fp8_e4m3, fp8_e5m2\)"),
    ("rocm", True, "fp8", None, "fp8 on rocm.*CUDA and CPU only"),
])
def test_fp8_pages_are_refused_at_start_with_the_reason(monkeypatch, platform, avx512,
                                                         cache_dtype, page_size, reason):
    from kvcompress.attention import cpu_kernel

    monkeypatch.setattr(vllm.platforms, "current_platform", _platform(platform))
    monkeypatch.setattr(cpu_kernel, "cpu_supports_fp8_pages", lambda: avx512)
    settings = {"kv_compression": "pyramidkv"} | ({"kv_page_size": page_size} if page_size
                                                  else {})
    engine_args = EngineArgs(model="unused", additional_config=settings,
                             kv_cache_dtype=cache_dtype)
    with pytest.raises(NotImplementedError, match=f"--kv-cache-dtype {reason}"):
        setup.prepare_engine_args(engine_args)
