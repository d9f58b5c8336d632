"""The plugin is loaded in every vLLM process, and every flag reaches the scheduler (engine
core) and the workers."""

import os

import pytest

from kvcompress.settings.config import KVCompressionConfig

from .harness import EngineHarness, greedy

pytestmark = pytest.mark.slow

SETTINGS = {
    "kv_compression": "adakv", "kv_budget": 96, "kv_window": 16, "kv_pyramid_beta": 5.0,
    "kv_pooling": "avg", "kv_pooling_kernel": 3, "kv_sink_tokens": 2, "kv_page_size": 32,
}


def worker_view(worker):
    """Runs inside the worker process."""
    from vllm.engine.arg_utils import EngineArgs

    runtime = worker.model_runner.paged_runtime
    return {
        "pid": os.getpid(),
        "hooked": getattr(EngineArgs, "_kvcompress_hooked", False),
        "settings": runtime.config.to_mapping(),
        "page_size": runtime.layout.page_size,
        "backend": type(worker.model_runner.attn_groups[0][0].backend).__name__
        if hasattr(worker.model_runner.attn_groups[0][0], "backend") else None,
    }


def started_config(model: str) -> KVCompressionConfig:
    """SETTINGS as the engine resolves them at start (``auto`` scoring: this model has no
    surrogate, so the window's)."""
    from kvcompress.settings.resolution import resolve_auto_scoring

    config = resolve_auto_scoring(KVCompressionConfig.from_mapping(SETTINGS), model)
    assert config.scoring == "window"
    return config


def test_settings_reach_engine_core_and_workers(tiny_llama):
    expected = started_config(tiny_llama)
    harness = EngineHarness(tiny_llama, SETTINGS, dtype="float32", max_model_len=512,
                            kv_cache_memory_bytes=32 << 20)
    try:
        assert harness.scheduler.compression_config == expected
        assert harness.page_manager.layout.page_size == 32
        (view,) = harness.on_workers(worker_view)
        assert KVCompressionConfig.from_mapping(view["settings"]) == expected
        assert harness.generate({"a": list(range(100, 300))}, greedy(3))["a"]
    finally:
        harness.shutdown()


def test_plugin_loads_in_separate_worker_processes(tiny_llama, monkeypatch):
    # The deployment mode: engine core and worker in processes of their own.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # to send worker_view
    from vllm import LLM

    llm = LLM(tiny_llama, dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20, additional_config=dict(SETTINGS))
    try:
        (view,) = llm.collective_rpc(worker_view)
        assert view["pid"] != os.getpid()
        assert view["hooked"], "kvcompress hooks missing in the worker process"
        expected = started_config(tiny_llama)
        assert KVCompressionConfig.from_mapping(view["settings"]) == expected
        outputs = llm.generate([{"prompt_token_ids": list(range(100, 400))}], greedy(4))
        assert len(outputs[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
