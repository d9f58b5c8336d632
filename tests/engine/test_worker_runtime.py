"""The worker's runtime without vLLM: per-request settings are resolved once, and settings
that reach the worker invalid (the front end's validation bypassed) fail their request instead
of being replaced by the engine's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.config import KVCompressionConfig
from kvcompress.engine.worker_runtime import PagedKVRuntime
from kvcompress.paging import PageLayout, PageManager

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_size=32, page_size=16, dtype_bytes=4,
                    total_pages=64)
ENGINE = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 8})


def runtime_with(extra_args: dict[str, dict],
                 max_tokens: dict[str, int] | None = None) -> PagedKVRuntime:
    runtime = PagedKVRuntime(ENGINE, LAYOUT, ["layer0", "layer1"],
                             TritonPagedKernel(LAYOUT, torch.float32), torch.float32,
                             torch.device("cpu"))
    req_ids = list(extra_args)
    runtime.bind_runner(SimpleNamespace(
        requests={rid: SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args=args,
                                            max_tokens=(max_tokens or {}).get(rid, 16)),
            output_token_ids=[]) for rid, args in extra_args.items()},
        input_batch=SimpleNamespace(
            req_ids=req_ids, num_computed_tokens_cpu=np.zeros(len(req_ids), dtype=np.int64),
            num_prompt_tokens=np.full(len(req_ids), 20, dtype=np.int64)),
    ))
    manager = PageManager(LAYOUT)
    for request_id in req_ids:
        manager.allocate(request_id, 20)
    runtime.begin_step(SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(),
                                       kvcompress_page_deltas=[manager.take_deltas()]))
    return runtime


def test_each_request_gets_its_own_settings_once():
    runtime = runtime_with({"a": {}, "b": {"kv_compression": "streamingllm", "kv_budget": 12}})
    assert runtime.request_config("a") is ENGINE
    own = runtime.request_config("b")
    assert (own.method, own.budget) == ("streamingllm", 12)
    assert runtime.request_config("b") is own


def test_invalid_settings_at_the_worker_fail_the_request_not_swap_its_settings():
    runtime = runtime_with({"good": {}, "bad": {"kv_budget": -3}})
    common = SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor([0, 20, 40]))
    metadata = runtime.build_attention_metadata(common)
    assert set(metadata.step.failures) == {"bad"}
    assert "kv_budget" in metadata.step.failures["bad"]
    assert not runtime.request_config("bad").enabled  # not compressed meanwhile
    assert runtime.request_config("good") is ENGINE
    assert [w.batch_index for w in metadata.step.window_queries] == [0]  # only "good" scores


def test_a_request_ending_with_its_prefill_is_not_scored_or_compacted():
    runtime = runtime_with({"one_token": {}, "answer": {}}, max_tokens={"one_token": 1})
    common = SimpleNamespace(num_reqs=2, query_start_loc_cpu=torch.tensor([0, 20, 40]))
    step = runtime.build_attention_metadata(common).step
    assert [w.batch_index for w in step.window_queries] == [1]
    assert list(step.completing_prompt) == [1]
