"""Admission by future page peak (kvcompress.engine.sched.admission), without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.engine.sched.admission import AdmissionPlanner, Trajectories, Trajectory, peak_pages
from kvcompress.paging import PageLayout, PageManager, ShardedPageManager
from kvcompress.paging.page_table import fill_of_lengths
from kvcompress.policies import layer_budgets, plan_keep, resolve_budget
from kvcompress.policies.decode import DecodeEviction, get_decode_method
from kvcompress.settings.config import KVCompressionConfig

PAGE = 4
PYRAMID = KVCompressionConfig.from_mapping(
    {"kv_compression": "pyramidkv", "kv_budget": 16, "kv_window": 4, "kv_page_size": PAGE})


def simulated_peak(trajectories: list[Trajectory], page_size: int) -> int:
    """The peak, step by step: the definition peak_pages computes in closed form."""
    last = max(t.prefill_steps + t.remaining_steps for t in trajectories)
    peak = 0
    for step in range(last + 1):
        total = 0
        for t in trajectories:
            if step > t.prefill_steps + t.remaining_steps:
                continue  # ended
            if step <= t.prefill_steps:
                total += t.held_pages
                continue
            grown = min(step - t.prefill_steps, t.growth_tokens)
            outcomes = [t.kept_lengths, *([] if t.alternatives is None else t.alternatives)]
            total += max(int((-(-(rows + grown) // page_size)).sum())
                         for rows in outcomes) + t.fixed_pages
        peak = max(peak, total)
    return peak


@st.composite
def trajectories(draw) -> list[Trajectory]:
    rows = draw(st.integers(0, 4))  # 0: every row slides (only fixed pages)
    result = []
    for _ in range(draw(st.integers(1, 5))):
        lengths = np.array(draw(st.lists(st.integers(0, 30), min_size=rows, max_size=rows)))
        pages = int((-(-lengths // PAGE)).sum())
        result.append(Trajectory(
            held_pages=pages + draw(st.integers(0, 20)),
            prefill_steps=draw(st.integers(0, 3)),
            kept_lengths=lengths,
            growth_tokens=draw(st.integers(0, 25)),
            remaining_steps=draw(st.integers(0, 25)),
            fixed_pages=draw(st.integers(0, 6)),
        ))
    return result


@settings(max_examples=300, deadline=None)
@given(trajectories())
def test_peak_matches_a_step_by_step_simulation(cases):
    assert peak_pages(Trajectories.stack(cases, PAGE)) == simulated_peak(cases, PAGE)


def test_fill_of_lengths_counts_rows_by_free_slots_in_their_last_page():
    pages, free_below = fill_of_lengths(np.array([[0, 3, 4, 5], [1, 1, 1, 1]]), PAGE)
    assert pages.tolist() == [0 + 1 + 1 + 2, 4]
    # free slots: 0 (empty row), 1, 0, 3 -> rows with fewer than r free slots
    assert free_below.tolist() == [[0, 2, 3, 3, 4], [0, 0, 0, 0, 4]]


def test_a_request_that_ends_first_makes_room_for_the_growth_of_another():
    row = np.array([8])
    short = Trajectory(2, 0, row, growth_tokens=4, remaining_steps=4)
    long = Trajectory(2, 0, row, growth_tokens=40, remaining_steps=40)
    # together: 2 + 2 -> both grow one page by step 1; short ends at step 4;
    # long reaches 48 tokens = 12 pages
    assert peak_pages(Trajectories.stack([short, long], PAGE)) == 12
    assert peak_pages(Trajectories.stack([short], PAGE)) == 3


def test_headroom_of_a_decode_budget_follows_its_evictions():
    eviction = DecodeEviction(get_decode_method("window"), budget=10, interval=4, recent=4)
    assert eviction.headroom(0) == 14
    assert eviction.headroom(13) == 1
    assert eviction.headroom(14) == 4  # evicted back to 10
    assert eviction.headroom(17) == 1
    assert eviction.headroom(18) == 4
    # elementwise over a batch, as the planner asks for its decoding requests
    generated = np.arange(40)
    assert eviction.headroom(generated).tolist() == [eviction.headroom(g) for g in range(40)]


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    sampling_params: object = field(default_factory=lambda: SimpleNamespace(extra_args=None))

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def planner(total_pages: int, running: list[FakeRequest], lookahead: int = 512,
            config: KVCompressionConfig = PYRAMID) -> AdmissionPlanner:
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=PAGE,
                        dtype_bytes=2, total_pages=total_pages)
    return AdmissionPlanner(PageManager(layout), config, max_model_len=4096,
                            max_num_batched_tokens=64, lookahead=lookahead,
                            running=lambda: running)


def decoding(plan: AdmissionPlanner, name: str, prompt: int, generated: int,
             max_tokens: int) -> FakeRequest:
    """A running request whose prompt was compacted to its layer budgets."""
    request = FakeRequest(name, prompt, max_tokens, num_computed_tokens=prompt + generated,
                          num_output_tokens=generated + 1)
    pages = plan.pages
    assert pages.allocate(name, request.num_computed_tokens)
    kept = plan.trajectory(FakeRequest(name + "?", prompt, max_tokens)).kept_lengths
    pages.release_after_compression(name, request.num_computed_tokens, kept + generated)
    return request


def pool_with(total_pages: int, lookahead: int = 512, **decoding_request: int):
    """A planner over a pool of ``total_pages`` where one request "a" is decoding."""
    running: list[FakeRequest] = []
    plan = planner(total_pages, running, lookahead)
    running.append(decoding(plan, "a", **decoding_request))
    return plan, running[0]


def test_a_prompt_that_fits_now_waits_when_the_running_ones_could_not_grow():
    plan, first = pool_with(1000, prompt=64, generated=0, max_tokens=40)
    new = FakeRequest("b", 64, max_tokens=40)
    held = plan.trajectory(new).held_pages
    assert held == 4 * 64 // PAGE  # 4 rows of the whole prompt, uncompressed
    # a pool with room for b's prefill now, but not for both once a and b have grown 40
    tight = plan.pages.owned_pages("a") + held + 8
    peak = peak_pages(Trajectories.stack([plan.trajectory(first), plan.trajectory(new)], PAGE))
    assert peak > tight
    decode = {"prompt": 64, "generated": 0, "max_tokens": 40}
    assert not pool_with(tight, **decode)[0].admits(new)
    assert pool_with(peak, **decode)[0].admits(new)
    # with no lookahead the planner admits whatever is free now (vLLM's rule)
    assert pool_with(tight, lookahead=0, **decode)[0].admits(new)


def test_admission_counts_growth_only_up_to_the_lookahead_and_max_tokens():
    running: list[FakeRequest] = []
    plan = planner(total_pages=10_000, running=running)
    request = decoding(plan, "a", prompt=64, generated=3, max_tokens=1000)
    assert plan.trajectory(request).growth_tokens == 512
    assert planner(10_000, [], lookahead=7).trajectory(
        FakeRequest("c", 64, max_tokens=1000)).growth_tokens == 7
    assert plan.trajectory(FakeRequest("b", 64, max_tokens=5)).growth_tokens == 5


def test_a_decode_budget_bounds_the_growth_reserved():
    config = PYRAMID.with_request_overrides(
        {"kv_decode_budget": 20, "kv_decode_interval": 10})
    budgeted = FakeRequest("a", 64, max_tokens=1000,
                           sampling_params=SimpleNamespace(extra_args={
                               "kv_decode_budget": 20, "kv_decode_interval": 10}))
    assert config.decode_eviction is not None
    plan = planner(10_000, [])
    assert plan.trajectory(budgeted).growth_tokens == 30


def test_an_uncompressed_request_keeps_its_whole_prompt():
    plan = planner(10_000, [], config=KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_budget": 128, "kv_page_size": PAGE}))
    trajectory = plan.trajectory(FakeRequest("a", 64, max_tokens=8))
    assert trajectory.kept_lengths.tolist() == [64] * 4
    assert trajectory.held_pages == 4 * 16 and trajectory.prefill_steps == 1


@pytest.mark.parametrize("amount", [{}, {"kv_budget": 16}, {"kv_compression_ratio": 0.75}])
@pytest.mark.parametrize("sharing", ["layer", "model"])
def test_a_score_threshold_is_admitted_at_a_bound_and_accounted_at_what_it_kept(amount,
                                                                              sharing):
    """Admission counts a thresholded prompt at its budgets when an amount caps it, whole
    when nothing does; what the plan then keeps (data-dependent) never exceeds that bound
    in total, and the pages follow the rows exactly once the worker reports them."""
    config = KVCompressionConfig.from_mapping({
        "kv_compression": "pyramidkv", "kv_window": 4, "kv_page_size": PAGE,
        "kv_score_threshold": -5.0, "kv_budget_sharing": sharing, "kv_min_prompt": 16,
        **amount})
    prompt, generated = 64, 3
    running: list[FakeRequest] = []
    plan = planner(1000, running, config=config)
    bound = plan.trajectory(FakeRequest("a?", prompt, max_tokens=8)).kept_lengths
    if amount:
        budget = resolve_budget(prompt, config.budget, config.ratio, config.window)
        expected = layer_budgets("pyramidkv", 2, prompt, budget, None, 4, config.beta)
        assert bound.tolist() == [b for b in expected for _ in range(2)]
    else:
        assert bound.tolist() == [prompt] * 4
    for seed in range(5):
        scores = (torch.rand((2, 2, prompt), generator=torch.Generator().manual_seed(seed))
                  ** 8)  # skewed: a data-dependent share passes e**-5
        counts = plan_keep(config.policy, [prompt], [scores], num_layers=2,
                           num_kv_heads=2).counts.reshape(-1).numpy()
        assert counts.sum() <= bound.sum()
        if sharing == "layer":
            assert (counts <= bound).all()
        name = f"r{seed}"
        request = FakeRequest(name, prompt, 8, num_computed_tokens=prompt + generated,
                              num_output_tokens=generated + 1)
        assert plan.pages.allocate(name, request.num_computed_tokens)
        plan.pages.release_after_compression(name, request.num_computed_tokens,
                                             counts + generated)
        running.append(request)
        plan.pages.check_invariants()
        owned = sum(plan.pages.owned_pages(r.request_id) for r in running)
        assert plan.pages.num_free + owned == plan.pages.total_pages
        # A decoding request is planned from the rows it holds, not from the bound.
        trajectory = plan.trajectory(request)
        assert trajectory.kept_lengths.tolist() == (counts + generated).tolist()
        assert trajectory.held_pages == int(((counts + generated + PAGE - 1) // PAGE).sum())
    # Short prompts (up to --kv-min-prompt) are kept whole, capped or not.
    assert plan.trajectory(FakeRequest("s", 16, max_tokens=8)).kept_lengths.tolist() == [16] * 4


def test_the_peak_decides_admission_exactly():
    decode = {"prompt": 64, "generated": 5, "max_tokens": 30}
    plan, first = pool_with(10_000, **decode)
    new = FakeRequest("b", 64, max_tokens=30)
    peak = peak_pages(Trajectories.stack([plan.trajectory(first), plan.trajectory(new)], PAGE))
    assert pool_with(peak, **decode)[0].admits(new)
    assert not pool_with(peak - 1, **decode)[0].admits(new)
    assert not pool_with(peak + 3, **decode)[0].admits(new, reserve_pages=4)


def test_running_requests_are_ordered_so_the_cheapest_to_recompute_is_preempted():
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    from kvcompress.engine.sched.scheduler import KVCompressScheduler

    def request(name, prompt, computed):
        return SimpleNamespace(name=name, request_id=name, num_prompt_tokens=prompt,
                               num_computed_tokens=computed)

    running = [request("old", 100, 180), request("prefill", 900, 512),
               request("young", 100, 110), request("oldest", 100, 200)]
    scheduler = SimpleNamespace(policy=SchedulingPolicy.FCFS, running=running,
                                _resting=frozenset())
    KVCompressScheduler._order_running_by_recompute_cost(scheduler)
    # decoding first, most computed first; the prompt still in prefill last (victim first)
    assert [r.name for r in scheduler.running] == ["oldest", "old", "young", "prefill"]
    # A resting request (parked for passes, deferred) comes first: never vLLM's victim.
    scheduler._resting = frozenset({"young"})
    KVCompressScheduler._order_running_by_recompute_cost(scheduler)
    assert [r.name for r in scheduler.running] == ["young", "oldest", "old", "prefill"]
    scheduler = SimpleNamespace(policy=SchedulingPolicy.PRIORITY, running=list(running),
                                _resting=frozenset())
    KVCompressScheduler._order_running_by_recompute_cost(scheduler)
    assert scheduler.running == running


def test_sliding_rows_count_at_their_window_and_do_not_grow():
    """Layer 0 slides (W = 8), layer 1 is full attention: a decoding request's sliding rows
    are fixed pages (their window bound), only its full rows grow; a waiting prompt's
    sliding rows count their window plus a chunk, not the whole prompt."""
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=PAGE,
                        dtype_bytes=2, total_pages=1000, layer_windows=(8, 0))
    running: list[FakeRequest] = []
    plan = AdmissionPlanner(PageManager(layout), PYRAMID, max_model_len=4096,
                            max_num_batched_tokens=16, lookahead=512, running=lambda: running)
    request = FakeRequest("a", 100, max_tokens=50, num_computed_tokens=100,
                          num_output_tokens=1)
    assert plan.pages.allocate("a", 100)
    plan.pages.take_deltas()  # a later schedule
    plan.pages.drop_outside_window("a", 100)  # sliding rows keep positions 92..99
    decoding_trajectory = plan.trajectory(request)
    assert decoding_trajectory.fixed_pages == 2 * 2  # 2 heads x ceil(8 / 4)
    assert decoding_trajectory.kept_lengths.tolist() == [100, 100]  # the full rows only
    waiting = plan.trajectory(FakeRequest("b", 200, max_tokens=10))
    # Full rows: 2 x 50 pages of the prompt; sliding rows: 2 x ceil((7 + 3 + 16) / 4) = 2 x 7.
    assert waiting.held_pages == 2 * 50 + 2 * 7
    assert waiting.fixed_pages == 2 * 3 and len(waiting.kept_lengths) == 2


# ----------------------------------------- the batched path against the one-by-one reference
def random_running_set(rng: np.random.Generator, pages: PageManager | ShardedPageManager,
                       ranks: int) -> list[FakeRequest]:
    """Requests in every state ``trajectory`` tells apart, with pages as the scheduler left
    them: decoding (compacted, decode-evicted, window-dropped), prefilling, resumed after
    preemption, waiting, and started from a cached context; some with their own decode
    budget or compression off."""
    rows = pages.layout.num_rows * ranks  # a compaction report covers every rank's rows
    overrides = [None, {"kv_decode_budget": 6, "kv_decode_interval": 3},
                 {"kv_decode_budget": 20, "kv_decode_interval": 7}, {"kv_compression": "none"}]
    requests = []
    for index in range(int(rng.integers(1, 14))):
        name = f"r{index}"
        extra_args = overrides[int(rng.integers(len(overrides)))]
        kind = rng.choice(["decoding", "prefilling", "resumed", "waiting", "adopted"])
        prompt = int(rng.integers(1, 120))
        output = computed = 0
        if kind == "decoding":
            generated = int(rng.integers(0, 40))
            computed, output = prompt + generated, generated + int(rng.integers(0, 2))
            assert pages.allocate(name, computed)
            for report in ("prompt", "decode"):
                if rng.random() < 0.4:
                    pages.release_after_compression(
                        name, computed, rng.integers(0, computed + 1, size=rows), report)
            pages.take_deltas()  # a later schedule: its window drop comes first
            pages.drop_outside_window(name, computed)
            assert pages.allocate(name, computed + int(rng.integers(0, 2)))
        elif kind == "prefilling":
            computed = int(rng.integers(0, prompt))
            output = int(rng.integers(0, 3))  # resumed ones recompute their outputs too
            assert pages.allocate(name, computed + 1)
        elif kind == "resumed":
            output = int(rng.integers(1, 30))
        elif kind == "adopted":
            context = int(rng.integers(1, 60))
            assert pages.allocate(name + "-earlier", context)
            assert pages.retire(name + "-earlier", index, context, prompt_len=context)
            hit = int(rng.integers(1, context + 1))
            assert pages.adopt(name, index, hit, share=bool(rng.integers(2)))
            # A prompt of just the cached context is decoding already.
            prompt, computed = hit + int(rng.integers(0, 2)) * prompt, hit
        requests.append(FakeRequest(
            name, prompt, max_tokens=output + int(rng.integers(0, 300)),
            num_computed_tokens=computed, num_output_tokens=output,
            sampling_params=SimpleNamespace(extra_args=extra_args)))
    return requests


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sliding=st.booleans(), ranks=st.sampled_from([0, 1, 2]),
       lookahead=st.sampled_from([1, 7, 40, 512]))
def test_batched_trajectories_and_admission_match_the_reference(seed, sliding, ranks,
                                                                lookahead):
    """``trajectories`` (decoding requests read in one batch from the page manager) equals
    ``trajectory`` request by request, and ``admits`` decides by the reference peak and the
    pages adopters read in shared runs. ``ranks``
    0: a plain PageManager; 2: ranks whose compactions differ."""
    rng = np.random.default_rng(seed)
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=PAGE,
                        dtype_bytes=2, total_pages=50_000,
                        layer_windows=(8, 0) if sliding else ())
    pages = ShardedPageManager(layout, ranks) if ranks else PageManager(layout)
    running: list[FakeRequest] = []
    plan = AdmissionPlanner(pages, PYRAMID, max_model_len=160, max_num_batched_tokens=16,
                            lookahead=lookahead, running=lambda: running)
    requests = random_running_set(rng, pages, max(ranks, 1))

    reference = [plan.trajectory(r) for r in requests]
    batched = plan.trajectories(requests)
    expected = Trajectories.stack(reference, PAGE)
    for name in [f.name for f in fields(Trajectories)]:
        assert np.array_equal(getattr(batched, name), getattr(expected, name)), name
    peak = peak_pages(expected)
    assert peak == simulated_peak(reference, PAGE)
    pages.check_invariants()  # the summaries page_fill keeps are up to date

    *running[:], new = requests
    if running:
        # The decision flips exactly where the reserve leaves the reference peak no room
        # beside the pages adopters read (counted once, not in their trajectories).
        room = layout.total_pages - peak - pages.num_read
        assert plan.admits(new, reserve_pages=room)
        assert not plan.admits(new, reserve_pages=room + 1)


# --------------------------------- budgets spread over rows: model-wide sharing, Ada-KV, ranks
def rank_simulated_peak(trajectories: list[Trajectory], outcomes: list[list[np.ndarray]],
                        page_size: int) -> int:
    """The peak the fullest rank reaches, step by step, when request ``i``'s rows end its
    prompt at ``outcomes[i][rank]`` (what the policy kept on that rank) instead of the
    planner's ``kept_lengths``."""
    ranks = len(outcomes[0])
    return max(simulated_peak([replace(t, kept_lengths=rows[rank], alternatives=None)
                               for t, rows in zip(trajectories, outcomes)], page_size)
               for rank in range(ranks))


@st.composite
def row_scores(draw, prompt: int, rows: int) -> torch.Tensor:
    """Window scores of one rank's rows: a level per row (drawn: the rows a model-wide
    budget favours) plus a little noise, so shared budgets land anywhere between whole rows
    and page-sized slivers."""
    levels = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows)),
                          dtype=torch.float32)
    noise = torch.rand((rows, prompt),
                       generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    return (levels[:, None] + 0.1 * noise).view(2, rows // 2, prompt)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), ranks=st.sampled_from([1, 2, 4]),
       sharing=st.sampled_from(["model", "layer"]),
       method=st.sampled_from(["pyramidkv", "adakv", "snapkv"]), page=st.sampled_from([4, 8]))
def test_admission_bounds_every_rank_and_spread_of_the_budget(data, ranks, sharing, method,
                                                              page):
    """Whatever the policy keeps on each rank (model-wide sharing and Ada-KV spread a total
    over rows, each row at least its window and rounded up to whole pages; ranks spread it
    by their own scores), no rank's pages ever exceed the peak admission planned with."""
    config = KVCompressionConfig.from_mapping({
        "kv_compression": method, "kv_budget": 16, "kv_window": 4, "kv_page_size": page,
        "kv_budget_sharing": sharing})
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_size=8, page_size=page,
                        dtype_bytes=2, total_pages=50_000)
    pages = ShardedPageManager(layout, ranks) if ranks > 1 else PageManager(layout)
    plan = AdmissionPlanner(pages, config, max_model_len=400, max_num_batched_tokens=16,
                            lookahead=data.draw(st.sampled_from([3, 40, 512])),
                            running=lambda: [])
    requests, outcomes = [], []
    for index in range(data.draw(st.integers(1, 4))):
        prompt = data.draw(st.integers(1, 90))
        output = data.draw(st.integers(0, 20))  # > 0: resumed after preemption
        requests.append(FakeRequest(f"r{index}", prompt, output + data.draw(st.integers(0, 60)),
                                    num_output_tokens=output))
        kept = []
        for _ in range(ranks):
            scores = data.draw(row_scores(prompt, layout.num_rows))
            counts = plan_keep(config.policy, [prompt], [scores], num_layers=2,
                               num_kv_heads=2).counts.reshape(-1).numpy()
            kept.append(counts + output)  # a resumed request's outputs are kept whole
        outcomes.append(kept)
    planned = [plan.trajectory(r) for r in requests]
    peak = peak_pages(Trajectories.stack(planned, page))
    assert peak >= rank_simulated_peak(planned, outcomes, page)
    assert peak == peak_pages(plan.trajectories(requests))
    if sharing == "layer" and method != "adakv":
        # Every row keeps its layer's budget: the bound is the simulation itself.
        assert peak == rank_simulated_peak(planned, outcomes, page)


def test_pages_adopters_read_are_counted_once():
    """Three decoding adopters read one entry's whole pages: their trajectories count their
    own pages, the read ones are counted once beside them, so what admission plans for now
    is exactly what the pool holds for them, and a fourth adopter that would fit is admitted
    where counting a copy per reader would refuse it."""
    running: list[FakeRequest] = []
    plan = planner(total_pages=80, running=running, lookahead=4,
                   config=KVCompressionConfig.from_mapping({"kv_page_size": PAGE}))
    pages = plan.pages
    assert pages.allocate("system", 40) and pages.retire("system", 1, 40, prompt_len=40)
    for name in ("a", "b", "c"):  # 9 whole pages a row read, a partial one copied
        assert pages.adopt(name, 1, 38, share=True) and pages.allocate(name, 41)
        running.append(FakeRequest(name, 40, max_tokens=8, num_computed_tokens=40,
                                   num_output_tokens=1))
    now = plan.trajectories(running).held_pages
    assert pages.num_read == 4 * 9 and now.tolist() == [4 * 2] * 3
    assert int(now.sum()) + pages.num_read == pages.owned_pages()  # 60 of 80 held
    new = FakeRequest("d", 40, max_tokens=2)
    adoption = (38, pages.entry(1).lengths_at(38), pages.pages_read_already(1, 38))
    assert adoption[2] == 4 * 9
    assert plan.admits(new, adoption=adoption)  # its own 8-12 pages fit beside 60
    assert not plan.admits(new, adoption=(*adoption[:2], 0))  # as if it read a copy
