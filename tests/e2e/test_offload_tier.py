"""The offload tier (``--kv-offloading-size`` with compression on): a pool too small for every
conversation's compressed cache offloads the entries it evicts, and a later turn loads its
entry back instead of prefilling it again. Its answers are those of a pool that kept every
entry; a failed load ends only the request that needed it."""

from __future__ import annotations

import random

import pytest
import requests

from kvcompress.engine.worker.offload import FAULT_ENV
from tests.e2e.serving import client, long_question, metric, running_server

from .harness import EngineHarness, greedy
from .test_reuse import ENGINE, assert_pages_back, converse, new_tokens

pytestmark = pytest.mark.slow

SETTINGS = {"kv_compression": "snapkv", "kv_budget": 48, "kv_admission_lookahead": 0}
TOKEN_BYTES = 4 * 2 * 2 * 32 * 4  # tiny_llama: layers x (K, V) x KV heads x head dim x fp32
SMALL_POOL = 1250 * TOKEN_BYTES  # the longest prompt and a few compressed entries
LARGE_POOL = 12_000 * TOKEN_BYTES  # every conversation's entry stays
TIER_GIB = 2_000 * TOKEN_BYTES / (1 << 30)
TURNS, CONVERSATIONS = 3, 8


def run_conversations(model: str, pool_bytes: int, tier_gib: float | None) -> tuple:
    engine = {**ENGINE, "max_model_len": 768}
    if tier_gib:
        engine["kv_offloading_size"] = tier_gib
    harness = EngineHarness(model, SETTINGS, kv_cache_memory_bytes=pool_bytes, **engine)
    try:
        history = converse(harness, turns=TURNS, conversations=CONVERSATIONS, user_tokens=120,
                           answer_tokens=24, seed=5)
        assert_pages_back(harness)
        totals = vars(harness.scheduler.reuse.totals)
        tier = harness.page_manager.shards[0].tier
        tier_pages_held = 0 if tier is None else tier.used_pages
        counts = None if tier is None else {**vars(tier.counts), "chunks": len(tier._chunks)}
        held = harness.on_workers(lambda worker: (
            worker.model_runner.paged_runtime.tier.__sizeof__(),
            len(worker.model_runner.paged_runtime.tier)))
    finally:
        harness.shutdown()
    if counts is not None:
        counts["used_pages"] = tier_pages_held
    return history, totals, counts, held


def test_later_turns_load_their_cache_from_the_tier_and_answer_as_with_room_for_all(
        tiny_llama):
    small, small_totals, _, _ = run_conversations(tiny_llama, SMALL_POOL, None)
    tiered, totals, counts, held = run_conversations(tiny_llama, SMALL_POOL, TIER_GIB)
    roomy, roomy_totals, _, _ = run_conversations(tiny_llama, LARGE_POOL, None)
    later = [turn for conversation in tiered for turn in conversation[1:]]
    # Without the tier the small pool loses caches; with it every later turn adopts one.
    assert small_totals["evicted_entries"] > 0
    assert sum(t["cached"] == 0 for c in small for t in c[1:]) > 0
    assert all(turn["cached"] > 0 for turn in later), [t["cached"] for t in later]
    assert 0 < counts["loaded_entries"] <= counts["saved_entries"]
    assert roomy_totals["evicted_entries"] == 0
    # What was loaded is what the entry held: the answers are the roomy pool's.
    for conversation, reference in zip(tiered, roomy):
        assert [t["output"] for t in conversation] == [t["output"] for t in reference]
        assert [t["cached"] for t in conversation] == [t["cached"] for t in reference]
    # The worker holds packed copies (K and V of each page written) of the chunks the
    # scheduler counts live. Each page went to the tier once: a conversation's later
    # entries hold the pages their turns adopted, which the tier had already.
    page_bytes = 2 * 16 * 32 * 4  # (K, V) x page tokens x head dim x fp32
    ((held_bytes, chunks),) = held
    assert chunks == counts["chunks"] and held_bytes == counts["used_pages"] * page_bytes
    assert counts["known_pages"] > 0


def test_a_failed_load_makes_its_request_prefill_again(tiny_llama, monkeypatch):
    """Every load fails: the adopters of a loaded entry are preempted with that step's
    output dropped and prefill again (the entry dropped); no request fails, the engine goes
    on, no page leaks."""
    engine = {**ENGINE, "max_model_len": 768, "kv_offloading_size": TIER_GIB}
    harness = EngineHarness(tiny_llama, SETTINGS, kv_cache_memory_bytes=SMALL_POOL, **engine)
    try:
        (first,) = zip(*converse(harness, turns=1, conversations=CONVERSATIONS,
                                 user_tokens=120, answer_tokens=24, seed=5))
        offloaded = set(harness.page_manager.offloaded_ids())
        assert offloaded, "the pool was meant to offload entries"
        preempted = harness.stats.preemptions
        monkeypatch.setenv(FAULT_ENV, "load")
        rng = random.Random(1)
        prompts = {f"next{c}": turn["prompt"] + turn["output"] + new_tokens(rng, 40)
                   for c, turn in enumerate(first)}
        outputs = harness.generate(prompts, greedy(24))
        assert all(harness.finish_reasons[r] == "length" for r in prompts)
        assert all(len(outputs[r]) == 24 for r in prompts)
        assert harness.stats.preemptions > preempted, "a load was meant to fail"
        assert not offloaded & set(harness.scheduler.reuse.index._filed)
        assert_pages_back(harness)
    finally:
        harness.shutdown()


def test_chats_evicted_from_a_small_pool_come_back_from_the_tier_over_http(
        embedded_model, tmp_path):
    """`vllm serve` with a pool that holds about three chats' caches and a tier: every
    chat's second turn adopts its first turn's cache, most of them loaded from the tier, as
    /metrics shows."""
    flags = ("--kv-compression", "pyramidkv", "--kv-budget", "512", "--max-model-len", "1536",
             "--kv-cache-memory-bytes", "120M", "--kv-offloading-size", "0.25",
             "--enable-prompt-tokens-details")
    with running_server(embedded_model, tmp_path, *flags) as (base, log_path):
        chats = [[{"role": "user", "content": f"Chat {number}. " + long_question(600)}]
                 for number in range(8)]
        firsts = []
        for messages in chats:
            reply = client(base).chat.completions.create(
                model=embedded_model, messages=messages, max_tokens=8, temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": "And the grass? One word."})
            firsts.append(reply.usage.prompt_tokens)
        text = requests.get(f"{base}/metrics", timeout=10).text
        assert metric(text, "kvcompress:offload_entries_total", event="saved") > 0
        for messages, first in zip(chats, firsts):
            reply = client(base).chat.completions.create(
                model=embedded_model, messages=messages, max_tokens=8, temperature=0)
            assert reply.usage.prompt_tokens_details.cached_tokens >= first
            assert reply.choices[0].message.content.strip()
        text = requests.get(f"{base}/metrics", timeout=10).text
        assert "offload tier of" in log_path.read_text()
    assert metric(text, "kvcompress:offload_entries_total", event="loaded") > 0
    assert metric(text, "kvcompress:offload_bytes_total", direction="loaded") > 0
    assert metric(text, "kvcompress:failed_requests_total") == 0


def test_failed_saves_lose_only_the_tier_copies(tiny_llama, monkeypatch):
    """Every save fails: the entries go as without a tier (their next turns prefill again),
    no request fails, and the tier ends empty."""
    monkeypatch.setenv(FAULT_ENV, "save")
    history, _, counts, held = run_conversations(tiny_llama, SMALL_POOL, TIER_GIB)
    later = [turn for conversation in history for turn in conversation[1:]]
    assert counts["saved_entries"] > 0 and counts["loaded_entries"] == 0
    assert all(len(turn["output"]) == 24 for conversation in history for turn in conversation)
    assert sum(turn["cached"] == 0 for turn in later) > 0
    assert held == [(0, 0)] and counts["chunks"] == 0


def test_tp2_ranks_offload_and_load_together(tiny_llama_kv4, monkeypatch):
    """Tensor parallel 2 (each rank its KV heads, its pool, its tier): the small pool
    offloads on both ranks at once and loads back on both, and the answers are those of a
    pool with room for every conversation at the same tensor parallelism."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # (one NUMA node here)
    tp2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp", dtype="float32")
    results = {}
    for name, pool, tier in (("tiered", SMALL_POOL, 2 * TIER_GIB), ("roomy", LARGE_POOL, None)):
        engine = {**ENGINE, **tp2, "max_model_len": 768}
        if tier:
            engine["kv_offloading_size"] = tier  # (the ranks' total)
        harness = EngineHarness(tiny_llama_kv4, SETTINGS, kv_cache_memory_bytes=pool, **engine)
        try:
            history = converse(harness, turns=TURNS, conversations=CONVERSATIONS,
                               user_tokens=120, answer_tokens=24, seed=5)
            assert_pages_back(harness)
            tiers = [shard.tier for shard in harness.page_manager.shards]
            loaded = [None if t is None else t.counts.loaded_entries for t in tiers]
            chunks = harness.on_workers(
                lambda worker: len(worker.model_runner.paged_runtime.tier))
        finally:
            harness.shutdown()
        results[name] = history, loaded, chunks, [len(t._chunks) if t else 0 for t in tiers]
    (tiered, loaded, chunks, counted), (roomy, *_) = results["tiered"], results["roomy"]
    assert loaded[0] > 0 and loaded[0] == loaded[1]
    assert chunks == counted  # each rank's worker holds what its scheduler counts
    for conversation, reference in zip(tiered, roomy):
        assert [t["output"] for t in conversation] == [t["output"] for t in reference]
        assert [t["cached"] for t in conversation] == [t["cached"] for t in reference]
