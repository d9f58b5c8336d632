"""Compression end to end: exact per-head budgets, pages freed and reused, more requests
at once than vanilla vLLM on the same memory."""

import math

import numpy as np
import pytest
from vllm.exceptions import VLLMValidationError

from kvcompress.policies import layer_budgets
from kvcompress.settings.config import KVCompressionConfig

from .harness import EngineHarness, assert_default_scoring, greedy, random_prompts

pytestmark = pytest.mark.slow

# tiny_llama: 4 layers x 2 KV heads, head dim 32, fp32 -> 2048 bytes per token (all rows)
TINY = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=16)
# Tests under memory pressure run the default scoring (auto: the surrogate on
# surrogate_tiny_llama, tiny_llama's weights with a surrogate beside them): the configuration
# users get is the one stressed. Its second score accumulator comes out of these small pools.
BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4


def step_until_first_token(harness, request_ids):
    """Step until every request has exactly its first output token (prefill done)."""
    for _ in range(200):
        if all(len(harness.outputs.get(rid, [])) >= 1 for rid in request_ids):
            return
        harness.step()
    raise AssertionError("prefill did not complete")


# Per-request settings (SamplingParams.extra_args) over an engine set to pyramidkv/48:
# every method in one batch, plus a ratio and a request that keeps its whole cache.
MIXED_REQUESTS = {
    "pyramid": ({}, 300),
    "snap": ({"kv_compression": "snapkv"}, 517),
    "stream": ({"kv_compression": "streamingllm", "kv_budget": 40}, 333),
    "ada": ({"kv_compression": "adakv"}, 410),
    # Ada-KV sharing uniform totals above a floor of half the average; max over query heads
    "ada_uniform": ({"kv_compression": "adakv", "kv_adakv_totals": "uniform",
                     "kv_adakv_floor": 0.5, "kv_gqa_reduce": "max"}, 390),
    "snap_max": ({"kv_compression": "snapkv", "kv_gqa_reduce": "max"}, 450),
    "ratio": ({"kv_compression_ratio": 0.75}, 256),
    "full": ({"kv_compression": "none"}, 280),
}


def expected_layer_budgets(overrides, prompt_len, layers, window):
    method = overrides.get("kv_compression", "pyramidkv")
    if method == "none":
        return [prompt_len] * layers
    budget = overrides.get("kv_budget", None if "kv_compression_ratio" in overrides else 48)
    if overrides.get("kv_adakv_totals") == "uniform":
        method = "snapkv"  # the same totals in every layer
    return layer_budgets(method, layers, prompt_len, budget=budget,
                         ratio=overrides.get("kv_compression_ratio"), window=window)


def resolved_sharing(engine, overrides):
    """Where the request's budget goes (--kv-budget-sharing resolved; reuse on)."""
    config = KVCompressionConfig.from_mapping(engine).with_request_overrides(overrides)
    return config.resolved_budget_sharing if config.enabled else "layer"


def assert_holds_policy_budget(manager, internal, name, overrides, prompt_len, since, window,
                               page, layers, heads, engine):
    """The request's rows in ``manager`` (one rank's ``PageManager``) hold exactly its
    policy's layer budgets (shared model-wide: their total) plus the ``since`` generated
    tokens already cached, in whole pages; returns the prompt part per [layer, head].
    ``engine``: the engine's settings; ``name`` labels failures."""
    lengths = manager.physical_lengths(internal).reshape(layers, heads) - since
    expected = expected_layer_budgets(overrides, prompt_len, layers, window)
    if resolved_sharing(engine, overrides) == "model" and min(expected) < prompt_len:
        # Every row competes for the request's total; each keeps at least its window.
        assert lengths.sum() == heads * sum(expected), name
        assert (lengths >= window).all() and (lengths <= prompt_len).all(), name
    elif overrides.get("kv_compression") == "adakv":
        # Heads of a layer share its total; every head keeps at least its window.
        assert lengths.sum(axis=1).tolist() == [heads * b for b in expected], name
        floor = overrides.get("kv_adakv_floor", 0.2)
        head_floor = [math.ceil(floor * (b - window)) + window for b in expected]
        assert (lengths >= np.array(head_floor)[:, None]).all(), name
    else:
        assert lengths.tolist() == [[b] * heads for b in expected], name
    if "kv_compression_ratio" not in overrides and overrides.get("kv_compression") != "none":
        amount = overrides.get("kv_budget", 48)
        assert lengths.sum() == layers * heads * amount, name  # exact total, no slack
    pages = manager._requests[internal].table.num_pages.reshape(layers, heads)
    assert (pages == (lengths + since + page - 1) // page).all(), name
    return lengths


def assert_heads_grow_by_their_new_tokens(harness, manager, names):
    """Two more decode steps: every head of each request grows by exactly the tokens it
    generated since."""
    before = {name: manager.physical_lengths(harness.internal_id(name)).copy()
              for name in names}
    generated = {name: len(harness.outputs[name]) for name in names}
    harness.step()
    harness.step()
    for name in names:
        grown = len(harness.outputs[name]) - generated[name]
        after = manager.physical_lengths(harness.internal_id(name))
        assert (after - before[name] == grown).all(), name


@pytest.mark.parametrize("scoring", ["window", "surrogate", "auto", "reconstruct", "hybrid",
                                     "expected"])
def test_each_head_holds_exactly_its_policy_budget_with_mixed_methods(tiny_llama, scoring,
                                                                       request):
    """Whichever scoring picks the tokens, every head keeps exactly its budget. ``auto`` on
    a model with a surrogate (reuse on, the default) is the surrogate's."""
    window, page, layers, heads = 8, 16, 4, 2
    model = tiny_llama
    if scoring == "expected":
        request.getfixturevalue("profiled_tiny_llama")  # its profile beside it
    if scoring in ("surrogate", "auto"):
        model = request.getfixturevalue("surrogate_tiny_llama")
    engine = {"kv_compression": "pyramidkv", "kv_budget": 48, "kv_window": window,
              "kv_scoring": scoring}
    harness = EngineHarness(model, engine, kv_cache_memory_bytes=8192 * BYTES_PER_TOKEN,
                            **TINY)
    try:
        if scoring == "expected":  # scored by the profile, not by a window fallback
            assert harness.on_workers(
                lambda worker: worker.model_runner.paged_runtime.expected_scorer is not None)[0]
        if scoring in ("surrogate", "auto"):  # scored inside the prefill, no pass
            runtime = harness.on_workers(lambda worker: (
                worker.model_runner.paged_runtime.surrogate is not None,
                worker.model_runner.paged_runtime.reconstructor is None))[0]
            assert runtime == (True, True)
            if scoring == "auto":  # as resolved at start: reuse on, a surrogate
                engine = {**engine, "kv_scoring": "surrogate"}
        prompts = {}
        for offset, (name, (overrides, length)) in enumerate(MIXED_REQUESTS.items()):
            prompts[name] = random_prompts([length], seed=30 + offset)["p0"]
            harness.add(name, prompts[name], greedy(40, extra_args=dict(overrides)))
        step_until_first_token(harness, prompts)
        manager = harness.rank_pages()
        for name, (overrides, length) in MIXED_REQUESTS.items():
            internal = harness.internal_id(name)
            # The newest sampled token is not in the cache yet; earlier ones are.
            since = len(harness.outputs[name]) - 1
            lengths = assert_holds_policy_budget(manager, internal, name, overrides, length,
                                                 since, window, page, layers, heads, engine)
            if resolved_sharing(engine, overrides) == "model" and name != "full":
                assert lengths.max() > lengths.min(), f"{name}: shared model-wide"
            elif overrides.get("kv_compression") == "adakv":
                assert (lengths[:, 0] != lengths[:, 1]).any(), "adakv should differ per head"
            # The worker's mirror agrees (uniproc executor: same process).
            worker_lengths = harness.on_workers(
                lambda worker, rid=internal: worker.model_runner.paged_runtime.state.requests[
                    rid].lengths.tolist()
            )[0]
            assert worker_lengths == (lengths + since).reshape(-1).tolist(), name
        assert_heads_grow_by_their_new_tokens(harness, manager, prompts)
        harness.run_until_done()
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


def test_bad_per_request_settings_are_rejected_before_the_engine(tiny_llama):
    harness = EngineHarness(tiny_llama, {"kv_compression": "snapkv", "kv_budget": 64},
                            kv_cache_memory_bytes=4096 * BYTES_PER_TOKEN, **TINY)
    try:
        bad = [
            ({"kv_budget": 0}, "'kv_budget'.*>= 1"),
            ({"kv_compression": "magic"}, "'kv_compression'.*pyramidkv"),
            ({"kv_page_size": 32}, "kv_page_size"),
            ({"kv_budget": 64, "kv_compression_ratio": 0.5}, "exclusive"),
            ({"kv_windw": 4}, "kv_windw"),
            ({"kv_adakv_floor": 2}, r"'kv_adakv_floor'.*\[0, 1\]"),
            ({"kv_adakv_totals": "flat"}, "'kv_adakv_totals'.*pyramid, uniform"),
            ({"kv_gqa_reduce": "sum"}, "'kv_gqa_reduce'.*mean, max"),
            ({"kv_score_threshold": 1.5}, "'kv_score_threshold'.*finite number < 0"),
        ]
        for number, (extra_args, named) in enumerate(bad):
            with pytest.raises(VLLMValidationError, match=named):
                harness.add(f"bad{number}", [5, 6, 7], greedy(2, extra_args=extra_args))
        # The engine is unharmed: a good request still runs to the end.
        assert harness.generate({"ok": [5, 6, 7] * 50}, greedy(4))["ok"]
        assert harness.page_manager.num_available == harness.page_manager.total_pages
    finally:
        harness.shutdown()


def test_evicted_pages_are_freed_and_reused_by_other_requests(tiny_llama):
    harness = EngineHarness(
        tiny_llama, {"kv_compression": "pyramidkv", "kv_budget": 32},
        kv_cache_memory_bytes=4096 * BYTES_PER_TOKEN, **TINY,
    )
    try:
        manager = harness.rank_pages()
        first = random_prompts([800], seed=4)
        harness.add("p0", first["p0"], greedy(4))
        free_before = manager.num_free
        step_until_first_token(harness, ["p0"])
        internal = harness.internal_id("p0")
        held = manager.owned_pages(internal)
        # After compaction each row holds ceil(kept / 16) pages instead of ceil(800 / 16): the
        # budget's total (shared model-wide by default: a reconstruction scored the prompt).
        lengths = manager.physical_lengths(internal)
        since = len(harness.outputs["p0"]) - 1  # generated tokens already in the cache
        assert lengths.sum() - 8 * since == 4 * 2 * 32
        assert held == sum(-(-int(length) // 16) for length in lengths) < 8 * 50
        assert manager.num_free == free_before - held
        assert harness.scheduler.kv_cache_manager.usage == pytest.approx(
            held / manager.total_pages)
        freed_by_compaction = set(range(manager.total_pages)) - set(
            manager._requests[internal].table.all_pages().tolist()) - set(
            manager.pool._stack[: manager.num_free].tolist())
        assert not freed_by_compaction  # every page is free or owned
        recently_freed = set(manager.pool._stack[manager.num_free - 8 * 48 : manager.num_free]
                             .tolist())
        second = random_prompts([200], seed=5)["p0"]
        harness.add("p1", second, greedy(2))
        harness.step()
        pages_of_second = set(manager._requests[harness.internal_id("p1")].table.all_pages()
                              .tolist())
        assert pages_of_second & recently_freed, "pages freed by compaction were not reused"
        harness.run_until_done()
        assert manager.num_available == manager.total_pages
    finally:
        harness.shutdown()


def test_memory_bound_run_holds_more_requests_at_once_than_vanilla(surrogate_tiny_llama):
    # 12 prompts of 600 tokens, a pool of ~1800 tokens: vanilla fits 2-3 at a time.
    prompts = random_prompts([600] * 12, seed=6)
    memory = 14 * 128 * BYTES_PER_TOKEN
    peaks = {}
    for name, compression in (("vanilla", None),
                              ("pyramidkv", {"kv_compression": "pyramidkv", "kv_budget": 64})):
        harness = EngineHarness(surrogate_tiny_llama, compression, kv_cache_memory_bytes=memory,
                                **TINY)
        try:
            if compression:
                assert_default_scoring(harness)
            outputs = harness.generate(prompts, greedy(48))
            assert all(len(tokens) == 48 for tokens in outputs.values())
            peaks[name] = max(sample.running for sample in harness.stats.samples)
        finally:
            harness.shutdown()
    assert peaks["pyramidkv"] > peaks["vanilla"], peaks


def test_admission_reserving_growth_runs_without_preemptions(surrogate_tiny_llama):
    """Compressed prompts whose pages are free when they arrive, but not once the running
    requests have grown: vLLM's rule (lookahead 0) admits them and preempts, the default
    waits until their growth fits and preempts nothing, with as many requests at once."""
    prompts = random_prompts([600] * 12, seed=9)
    memory = 14 * 128 * BYTES_PER_TOKEN
    figures = {}
    for lookahead in (0, None):
        compression = {"kv_compression": "pyramidkv", "kv_budget": 64}
        if lookahead is not None:
            compression["kv_admission_lookahead"] = lookahead
        harness = EngineHarness(surrogate_tiny_llama, compression, kv_cache_memory_bytes=memory,
                                **TINY)
        try:
            assert_default_scoring(harness)
            outputs = harness.generate(prompts, greedy(200))
            assert all(len(tokens) == 200 for tokens in outputs.values())
            assert harness.page_manager.num_available == harness.page_manager.total_pages
            figures[lookahead] = (harness.stats.preemptions,
                                  max(sample.running for sample in harness.stats.samples))
        finally:
            harness.shutdown()
    assert figures[0][0] > 0, figures  # the pool is tight indeed
    assert figures[None][0] == 0, figures
    assert figures[None][1] >= 3, figures


# Decode eviction for some of the soak's requests (3 and 5 are coprime: every method meets
# every decode policy).
# The engine's decode budget (a scoring policy: window reserves none) sizes the decode-score
# reserve; ``None`` turns a request's decode eviction off.
DECODE_MIX = [
    {"kv_decode_policy": "h2o", "kv_decode_budget": 48, "kv_decode_interval": 16},
    {"kv_decode_budget": None},
    {"kv_decode_policy": "snapkv", "kv_decode_budget": 48, "kv_decode_interval": 16},
]


def test_aborts_preemption_of_compressed_requests_and_finish_leak_nothing(
        surrogate_tiny_llama):
    """Soak: staggered arrivals with mixed methods and decode policies, aborts mid-prefill and
    mid-decode, a pool small enough that compressed requests get preempted and recomputed
    (admitted as vLLM does, without reserving their growth). Page invariants are checked by
    the scheduler after every step (KVCOMPRESS_CHECK_PAGES=1)."""
    rng = np.random.default_rng(7)
    harness = EngineHarness(
        surrogate_tiny_llama, {"kv_compression": "snapkv", "kv_budget": 96,
                               "kv_admission_lookahead": 0, "kv_decode_budget": 48,
                               "kv_decode_interval": 16, "kv_decode_policy": "snapkv"},
        # 13 x 128 tokens: one request of max_model_len still fits beside the score and
        # decode-score reserves (the assertions below check the pool stays tight)
        kv_cache_memory_bytes=13 * 128 * BYTES_PER_TOKEN, **TINY,
    )
    try:
        assert_default_scoring(harness)
        lengths = rng.integers(20, 700, size=40).tolist()
        prompts = random_prompts(lengths, seed=8)
        pending = list(prompts)
        aborted = set()
        for step in range(5000):
            if pending:
                request_id = pending.pop(0)
                method = ["snapkv", "pyramidkv", "streamingllm", "adakv", "none"][step % 5]
                decode = DECODE_MIX[step % len(DECODE_MIX)]
                harness.add(request_id, prompts[request_id],
                            greedy(int(rng.integers(100, 400)),
                                   extra_args={"kv_compression": method, **decode}))
            if step % 13 == 5:
                live = [rid for rid in prompts if rid not in pending
                        and rid not in harness.finished and rid not in aborted]
                if live:
                    victim = live[int(rng.integers(len(live)))]
                    harness.abort([victim])
                    aborted.add(victim)
            if not pending and not harness.engine.has_unfinished_requests():
                break
            harness.step()
        manager = harness.rank_pages()
        assert not harness.engine.has_unfinished_requests()
        assert manager.num_available == manager.total_pages
        assert harness.stats.preemptions > 0, "the pool was meant to force preemptions"
        assert harness.scheduler.num_pages_freed_by_compression > 0
        assert aborted
    finally:
        harness.shutdown()


def worker_decode_state(harness, name):
    """The worker's view of a live request: per-row lengths, prompt part, decode scores."""
    internal = harness.internal_id(name)

    def read(worker):
        request = worker.model_runner.paged_runtime.state.requests[internal]
        scores = request.decode_scores
        return (request.lengths.copy(), request.prompt_kept,
                None if scores is None else tuple(scores.shape))

    return harness.on_workers(read)[0]


def run_checking_generated_parts(harness, names, num_tokens):
    """Step to the end; after every step each live request's rows agree between scheduler and
    worker (page invariants are checked by the scheduler, KVCOMPRESS_CHECK_PAGES=1). Returns,
    per request and step since its prefill: (generated tokens each head holds, generated
    tokens in the cache without eviction, shape of its decode scores or None)."""
    history = {name: [] for name in names}
    manager = harness.rank_pages()
    while harness.engine.has_unfinished_requests():
        harness.step()
        for name in names:
            if name in harness.finished or not harness.outputs.get(name):
                continue
            lengths, prompt_kept, scores = worker_decode_state(harness, name)
            assert (manager.physical_lengths(harness.internal_id(name)) == lengths).all(), name
            part = lengths - prompt_kept
            assert part.min() == part.max(), name  # every head holds the same generated part
            # the newest sampled token is not in the cache yet
            history[name].append((int(part.max()), len(harness.outputs[name]) - 1, scores))
    assert all(len(harness.outputs[name]) == num_tokens for name in names)
    assert manager.num_available == manager.total_pages
    return history


def held_under_decode_budget(in_cache: int, budget: int, interval: int) -> int:
    """Generated tokens a head holds with ``in_cache`` of them generated so far: up to
    budget + interval - 1; the step that brings a head to budget + interval cuts it back to
    the budget."""
    return in_cache if in_cache < budget + interval else budget + (in_cache - budget) % interval


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv", "rkv", "anchors"])
def test_decode_budget_bounds_the_cache_of_long_generations(tiny_llama, policy):
    budget, interval, window, tokens = 24, 8, 8, 120
    harness = EngineHarness(
        tiny_llama,
        {"kv_compression": "snapkv", "kv_budget": 48, "kv_window": window,
         "kv_decode_policy": policy, "kv_decode_budget": budget,
         "kv_decode_interval": interval},
        kv_cache_memory_bytes=4096 * BYTES_PER_TOKEN, **TINY,
    )
    try:
        # a compressed prompt (200 -> 48 per head) and one kept whole (30 < 48)
        harness.add("long", random_prompts([200], seed=9)["p0"], greedy(tokens))
        harness.add("short", random_prompts([30], seed=10)["p0"], greedy(tokens))
        history = run_checking_generated_parts(harness, ["long", "short"], tokens)
        for name, steps in history.items():
            for held, in_cache, scores in steps:
                want = held_under_decode_budget(in_cache, budget, interval)
                assert held == want, (name, held, in_cache)
                if policy in ("h2o", "anchors"):  # scored from the first decode step on,
                    # carried over
                    assert scores == (None if in_cache == 0 else (4, 2, budget + interval))
                elif policy in ("snapkv", "rkv"):  # scored by the newest `window`, then reset
                    scoring = held > budget + interval - window
                    assert scores == ((4, 2, budget + interval) if scoring else None), held
                else:
                    assert scores is None
            assert steps[-1][1] == tokens - 2
            assert max(held for held, _, _ in steps) == budget + interval - 1
    finally:
        harness.shutdown()


def test_per_request_decode_policies_share_a_batch(tiny_llama):
    tokens = 100
    harness = EngineHarness(
        # the engine's decode budget sizes the decode-score reserve the h2o request uses
        tiny_llama, {"kv_compression": "snapkv", "kv_budget": 48, "kv_decode_budget": 24,
                     "kv_decode_interval": 8, "kv_decode_policy": "h2o"},
        kv_cache_memory_bytes=4096 * BYTES_PER_TOKEN, **TINY,
    )
    requests = {
        "h2o": {"kv_decode_policy": "h2o", "kv_decode_budget": 24, "kv_decode_interval": 8},
        "window": {"kv_decode_policy": "window", "kv_decode_budget": 16,
                   "kv_decode_interval": 4},
        "full": {"kv_decode_budget": None},  # no decode budget: keeps every generated token
    }
    try:
        for offset, (name, overrides) in enumerate(requests.items()):
            harness.add(name, random_prompts([150], seed=20 + offset)["p0"],
                        greedy(tokens, extra_args=dict(overrides)))
        history = run_checking_generated_parts(harness, list(requests), tokens)
        held = {name: [step[0] for step in steps] for name, steps in history.items()}
        scored = {name: [step[2] is not None for step in steps]
                  for name, steps in history.items()}
        assert max(held["h2o"]) == 24 + 8 - 1 and any(scored["h2o"])
        assert max(held["window"]) == 16 + 4 - 1 and not any(scored["window"])
        assert all(step[0] == step[1] for step in history["full"]) and not any(scored["full"])
        assert held["full"][-1] == tokens - 2
    finally:
        harness.shutdown()


def generated_part(worker, request_id):
    """Generated tokens each head of a request holds on the worker; None before its prompt
    is complete or while it waits to resume."""
    request = worker.model_runner.paged_runtime.state.requests.get(request_id)
    if request is None or request.prompt_kept is None:
        return None
    return request.lengths - request.prompt_kept


def test_a_preempted_request_resumes_within_its_decode_budget(surrogate_tiny_llama):
    """Chats that fit when admitted but not once grown (admitted without reserving their
    growth): the last admitted are preempted and recomputed. A decode-budgeted one comes back
    with its whole generated tail (never scored), which the step that recomputes it cuts to
    the newest budget."""
    budget, interval, tokens = 16, 8, 150
    harness = EngineHarness(
        surrogate_tiny_llama, {"kv_compression": "snapkv", "kv_budget": 100_000,
                               "kv_admission_lookahead": 0, "kv_decode_budget": budget,
                               "kv_decode_interval": interval, "kv_decode_policy": "h2o"},
        kv_cache_memory_bytes=14 * 128 * BYTES_PER_TOKEN, **TINY,
    )
    decode = {"kv_decode_policy": "h2o", "kv_decode_budget": budget,
              "kv_decode_interval": interval}
    prompts = random_prompts([250] * 6, seed=11)
    budgeted = list(prompts)[3:]  # admitted last: preempted first
    try:
        assert_default_scoring(harness)
        for name, prompt in prompts.items():
            harness.add(name, prompt,
                        greedy(tokens, extra_args=decode if name in budgeted
                               else {"kv_decode_budget": None}))
        outputs_when_preempted = {}
        while harness.engine.has_unfinished_requests():
            harness.step()
            for name in budgeted:
                if name in harness.finished:
                    continue
                request = harness.scheduler.requests[harness.internal_id(name)]
                if request.num_preemptions and name not in outputs_when_preempted:
                    outputs_when_preempted[name] = len(harness.outputs[name])
                held = harness.on_workers(
                    lambda worker, rid=request.request_id: generated_part(worker, rid))[0]
                if held is not None:  # None: waiting to resume, or not prefilled yet
                    assert held.max() < budget + interval, (name, held.max())
        # some request was preempted with more generated tokens than it may hold
        assert max(outputs_when_preempted.values(), default=0) > budget + interval, (
            "the pool was meant to preempt a budgeted request late in its generation")
        assert all(len(harness.outputs[name]) == tokens for name in prompts)
        assert harness.page_manager.num_available == harness.page_manager.total_pages
    finally:
        harness.shutdown()


@pytest.mark.slow
def test_engine_refuses_a_page_size_that_strands_a_max_model_len_request(tiny_llama):
    # Bytes for 1100 tokens (vLLM's own check, in 16-token blocks, passes for 1030), but at
    # 256 tokens a page each of the 8 rows of a 1030-token request takes 5 pages: 40 > 34.
    # Kept on window scoring: a refusal at start, not a stress test, and the 34 pages above
    # are this pool less window scoring's reserve (the default's differs).
    settings = {**TINY, "max_model_len": 1030, "max_num_batched_tokens": 1030,
                "block_size": 16}
    with pytest.raises(Exception, match=r"--max-model-len 1030 needs 40.*--kv-page-size"):
        EngineHarness(tiny_llama, {"kv_compression": "pyramidkv", "kv_page_size": 256,
                                   "kv_scoring": "window"},
                      kv_cache_memory_bytes=1100 * BYTES_PER_TOKEN, **settings)
