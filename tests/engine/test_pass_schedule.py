"""Reconstruction passes as scheduled work: which chunks a step grants, and when a parked
request is released (``engine.pass_schedule``)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from kvcompress.engine.pass_schedule import (
    KEYS_PER_PREFILL_TOKEN,
    MIN_PASS_CHUNK,
    PassSchedule,
    chunk_cost,
    pass_chunk,
)


@dataclass
class FakeRequest:
    finished: bool = False
    num_computed_tokens: int = 0  # the prompt keys a pass attends: 0 costs tokens only

    def is_finished(self) -> bool:
        return self.finished


def test_chunks_are_granted_in_arrival_order_within_the_budget():
    live = {"a": FakeRequest(), "b": FakeRequest()}
    schedule = PassSchedule()
    schedule.add({"a": [300, 300, 100], "b": [200]}, live)
    assert schedule.parked() == {"a", "b"}
    first = schedule.grant(650)
    assert first.grants == {"a": 2} and first.tokens == 600
    # b's chunk would fit the 50 tokens left only after a's: it does not overtake a.
    assert schedule.parked() == {"a", "b"}  # (still parked: their last chunks come next)
    second = schedule.grant(300)
    assert second.grants == {"a": 1, "b": 1} and second.tokens == 300
    assert not schedule.parked()  # released from the next one
    assert schedule.tokens_granted == 900


def test_one_chunk_runs_even_when_decodes_fill_the_budget():
    schedule = PassSchedule()
    schedule.add({"a": [500, 500]}, {"a": FakeRequest()})
    assert schedule.grant(0).grants == {"a": 1}
    assert schedule.grant(-3).grants == {"a": 1}
    assert not schedule.pending


def test_finished_or_unknown_requests_are_not_parked_and_are_forgotten():
    live = {"a": FakeRequest(), "done": FakeRequest(finished=True)}
    schedule = PassSchedule()
    schedule.add({"a": [10], "done": [10], "gone": [10], "empty": []}, live)
    assert schedule.parked() == {"a"}
    live["a"].finished = True  # aborted while parked
    schedule.prune(live)
    assert not schedule.parked()
    assert schedule.grant(100).grants == {}


@given(st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=6), min_size=1,
                max_size=6),
       st.integers(-5, 200))
def test_every_chunk_is_granted_once_in_order_and_steps_stay_in_budget(chunks, budget):
    schedule = PassSchedule()
    live = {f"r{i}": FakeRequest() for i in range(len(chunks))}
    schedule.add({f"r{i}": list(c) for i, c in enumerate(chunks)}, live)
    granted = {request_id: 0 for request_id in live}
    for _ in range(sum(map(len, chunks))):
        passes = schedule.grant(budget)
        if not passes.grants:
            break
        # Over budget only by one chunk, which then runs alone.
        assert passes.tokens <= budget or sum(passes.grants.values()) == 1
        for request_id, count in passes.grants.items():
            granted[request_id] += count
    assert not schedule.parked()
    assert granted == {f"r{i}": len(c) for i, c in enumerate(chunks)}


def test_a_chunk_costs_more_the_more_prompt_keys_it_scores():
    assert chunk_cost(100, 0) == 100
    # The worker's chunks for a long prompt count about the budget; short ones keep theirs.
    assert pass_chunk(512, 2048, 500, 9) == 512
    assert pass_chunk(512, 2048, 4000, 9) == 2048 // 5 - 9
    assert chunk_cost(2048 // 5, 4000) <= 2048
    assert pass_chunk(512, 2048, 200_000, 9) == MIN_PASS_CHUNK
    assert chunk_cost(100, KEYS_PER_PREFILL_TOKEN) == 200
    assert chunk_cost(512, 4 * KEYS_PER_PREFILL_TOKEN) == 2560
    schedule = PassSchedule()
    schedule.add({"a": [100, 100]}, {"a": FakeRequest(num_computed_tokens=3000)})
    assert list(schedule.pending["a"]) == [400, 400]  # 3000 keys: each token counts 4
    assert schedule.grant(850).grants == {"a": 2}
