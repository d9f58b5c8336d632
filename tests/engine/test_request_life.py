"""One sharing state per request (``engine.sched.request_life``): the transitions the
diagram allows and no other, in any order the scheduler may meet them."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcompress.engine.sched.request_life import TRANSITIONS, Life, LifeError, RequestLives


def test_a_request_without_a_record_is_free_and_no_segment():
    lives = RequestLives()
    assert lives.state("r") is Life.FREE and not lives.is_segment("r")
    assert lives.served("r") == 0 and not lives.on_own_copy("r") and len(lives) == 0


def test_only_the_diagrams_transitions_are_allowed():
    for source, targets in TRANSITIONS.items():
        for target in Life:
            lives = RequestLives()
            if source in (Life.SEGMENT, Life.FORK, Life.FILED):
                lives.begin("x", ["a"], fork=source is Life.FORK)
                if source is Life.FILED:
                    lives.move("x", Life.FILED)
            elif source is not Life.FREE:
                lives.move("x", source)
            if target in targets:
                lives.move("x", target)
                assert lives.state("x") is target
            else:
                with pytest.raises(LifeError, match="may not go from"):
                    lives.move("x", target)
            lives.check()


def test_a_hold_lasts_one_schedule_and_its_bound_counts_from_the_first():
    lives = RequestLives()
    lives.hold_exactly(["a", "b"], schedule=3)
    assert lives.in_state(Life.HELD) == {"a", "b"}
    lives.hold_exactly(["b", "c"], schedule=4)
    assert lives.in_state(Life.HELD) == {"b", "c"} and lives.state("a") is Life.FREE
    assert lives.waited_since("b") == 3 and lives.waited_since("c") == 4
    lives.hold_exactly(["a"], schedule=9)
    assert lives.waited_since("a") == 3  # released meanwhile, still waiting: one bound
    lives.preempted("a")  # (it ran, and was preempted: a new wait)
    assert lives.waited_since("a") is None


def test_a_segment_is_known_as_made_until_its_entry_is_compacted():
    lives = RequestLives()
    lives.begin("kvcompress-segment-1", ["a", "b"])
    lives.serve(["a", "b"], 64)
    assert lives.is_segment("kvcompress-segment-1") and not lives.is_segment("a")
    with pytest.raises(LifeError, match="exists already"):
        lives.begin("kvcompress-segment-1", ["c"])
    lives.move("kvcompress-segment-1", Life.FILED)
    assert lives.readers_of("kvcompress-segment-1") == ("a", "b")
    lives.end("kvcompress-segment-1")
    assert not lives.is_segment("kvcompress-segment-1") and lives.served("a") == 64
    lives.end("a")
    lives.end("b")
    assert len(lives) == 0


class Lives(RuleBasedStateMachine):
    """What the scheduler does to its requests, in any order: each record stays in exactly
    one state, the state a shadow model says."""

    def __init__(self) -> None:
        super().__init__()
        self.lives = RequestLives()
        self.model: dict[str, Life] = {}
        self.schedule = 0

    ids = st.sampled_from([f"r{i}" for i in range(6)])

    @rule(held=st.sets(ids))
    def hold(self, held: set[str]) -> None:
        self.schedule += 1
        holdable = {r for r in held if self.model.get(r, Life.FREE) in (Life.FREE, Life.HELD)}
        self.lives.hold_exactly(holdable, self.schedule)
        for request_id, state in list(self.model.items()):
            if state is Life.HELD:
                self.model[request_id] = Life.FREE
        self.model.update(dict.fromkeys(holdable, Life.HELD))

    @rule(request_id=ids)
    def defer(self, request_id: str) -> None:
        state = self.model.get(request_id, Life.FREE)
        if state is Life.FREE:
            self.lives.move(request_id, Life.DEFERRED)
            self.model[request_id] = Life.DEFERRED
        elif Life.DEFERRED not in TRANSITIONS[state]:
            with pytest.raises(LifeError):
                self.lives.move(request_id, Life.DEFERRED)

    @rule(request_id=ids)
    def preempt(self, request_id: str) -> None:
        if self.model.get(request_id) is Life.DEFERRED:
            self.model[request_id] = Life.FREE
        self.lives.preempted(request_id)

    @rule(number=st.integers(0, 3), fork=st.booleans(), readers=st.sets(ids, max_size=3))
    def make_segment(self, number: int, fork: bool, readers: set[str]) -> None:
        segment_id = f"s{number}"
        if segment_id in self.model:
            with pytest.raises(LifeError):
                self.lives.begin(segment_id, sorted(readers), fork=fork)
            return
        self.lives.begin(segment_id, sorted(readers), fork=fork)
        self.model[segment_id] = Life.FORK if fork else Life.SEGMENT

    @rule(number=st.integers(0, 3))
    def file(self, number: int) -> None:
        segment_id = f"s{number}"
        if self.model.get(segment_id) in (Life.SEGMENT, Life.FORK):
            self.lives.move(segment_id, Life.FILED)
            self.model[segment_id] = Life.FILED

    @rule(request_id=st.one_of(ids, st.sampled_from(["s0", "s1", "s2", "s3"])))
    def end(self, request_id: str) -> None:
        self.lives.end(request_id)
        self.model.pop(request_id, None)

    @invariant()
    def one_state_each(self) -> None:
        self.lives.check()
        for request_id, state in self.model.items():
            assert self.lives.state(request_id) is state
        for state in Life:
            members = {r for r, s in self.model.items() if s is state}
            if state is not Life.FREE:
                assert self.lives.in_state(state) == members


TestLives = Lives.TestCase
TestLives.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
