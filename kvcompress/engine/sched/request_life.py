"""One sharing state per request, as vLLM keeps one ``RequestStatus``: what kvcompress does
with a request beyond vLLM's scheduling, with every transition in this module and checked.

```
                 hold: a segment or fork it would adopt is being made,
                 or a segment it shares waits for compaction
   (new) ──▶ FREE ─────────────────────────────────────▶ HELD
              ▲ ▲ ◀──────────── release (each schedule) ──┘  waited --kv-sharing-wait
              │ │                                            schedules, or its segment
              │ └─ its step ran, or preempted ── DEFERRED    failed: own_copy (never held
              └──── defer (a lone prompt) ─────▶              again, no segment for it)
   (made) ──▶ SEGMENT ──┐ prompt computed    a segment request of ours (its outputs never
                        ├──▶ FILED ──▶ gone  leave the engine); filed pending, compacted
   (made) ──▶ FORK ─────┘ planned            once its readers are past their prefill
   every state ──▶ gone: the request finished, was aborted or failed (``end``)
```

vLLM schedules a FREE request as usual; it skips a HELD one in its waiting loop
(``Scheduler._handle_blocked_waiting_request``) and gives a DEFERRED one no tokens
(``_reserve_prefill_lookahead``), keeping it in ``running``. Parking for reconstruction
passes is not a sharing state (a segment request may be parked too): the pass schedule
holds those requests' chunks (``engine.pass_schedule``), and they get no tokens the same
way. A fork is no vLLM request: its pages are copied off a deferred request in the step
after its deferral. A record also carries what the grouping of shared prefixes needs while
the request lives: the schedule that first held it (the bound of ``--kv-sharing-wait``), the
length of the segment or fork made for it (one is made again only if longer), whether it is
on its own copy, and for a segment or fork the readers it was made for. Requests kvcompress
never treated specially have no record.

No vLLM imports.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class Life(enum.Enum):
    FREE = "free"  # scheduled by vLLM as usual
    HELD = "held"  # waiting for a shared prefix being made (skipped while vLLM schedules)
    DEFERRED = "deferred"  # a lone prompt compacted a step late (no tokens meanwhile)
    SEGMENT = "segment"  # a segment request of ours, computing its prompt
    FORK = "fork"  # a fork's pages, copied off a deferred request in this step
    FILED = "filed"  # a segment's or fork's pages filed pending, compacted once read


# The transitions a request may make; ``end`` (gone) is allowed from every state.
TRANSITIONS: dict[Life, frozenset[Life]] = {
    Life.FREE: frozenset({Life.HELD, Life.DEFERRED}),
    Life.HELD: frozenset({Life.FREE}),
    Life.DEFERRED: frozenset({Life.FREE}),
    Life.SEGMENT: frozenset({Life.FILED}),
    Life.FORK: frozenset({Life.FILED}),
    Life.FILED: frozenset(),
}


class LifeError(RuntimeError):
    """A transition the state diagram does not allow: a bug in kvcompress's scheduler."""


@dataclass
class RequestLife:
    state: Life = Life.FREE
    held_since: int | None = None  # the schedule that first held it while it waits
    served: int = 0  # tokens of the segment or fork last made for it
    own_copy: bool = False  # held no more and no segment made for it
    readers: tuple[str, ...] = ()  # a segment's or fork's readers


@dataclass
class RequestLives:
    """Every record, by request id; the scheduler's one account of its requests' sharing."""

    _lives: dict[str, RequestLife] = field(default_factory=dict)
    _in_state: dict[Life, set[str]] = field(
        default_factory=lambda: {state: set() for state in Life})

    def state(self, request_id: str) -> Life:
        life = self._lives.get(request_id)
        return Life.FREE if life is None else life.state

    def get(self, request_id: str) -> RequestLife | None:
        return self._lives.get(request_id)

    def in_state(self, state: Life) -> frozenset[str]:
        """The requests in ``state`` (FREE: those with a record)."""
        return frozenset(self._in_state[state])

    def is_segment(self, request_id: str) -> bool:
        """Whether the request is a segment request or fork of ours (known as made, never by
        how its id looks: a client's own id may look like ours)."""
        return self.state(request_id) in (Life.SEGMENT, Life.FORK, Life.FILED)

    def begin(self, segment_id: str, readers: Sequence[str], *, fork: bool = False) -> None:
        """A segment request (or fork) was made for ``readers``."""
        if segment_id in self._lives:
            raise LifeError(f"{segment_id} exists already as {self.state(segment_id).value}")
        state = Life.FORK if fork else Life.SEGMENT
        self._lives[segment_id] = RequestLife(state, readers=tuple(readers))
        self._in_state[state].add(segment_id)

    def move(self, request_id: str, to: Life) -> None:
        """A checked transition (``TRANSITIONS``)."""
        life = self._record(request_id)
        if to not in TRANSITIONS[life.state]:
            raise LifeError(f"request {request_id} may not go from {life.state.value} to "
                            f"{to.value}")
        self._in_state[life.state].discard(request_id)
        life.state = to
        self._in_state[to].add(request_id)

    def hold_exactly(self, request_ids: Iterable[str], schedule: int) -> None:
        """Hold these waiting requests in this schedule, and release the others held in the
        last one (a hold lasts one schedule: each is decided again in the next)."""
        now = set(request_ids)
        for request_id in self._in_state[Life.HELD] - now:
            self.move(request_id, Life.FREE)
        for request_id in now - self._in_state[Life.HELD]:
            self.move(request_id, Life.HELD)
            life = self._lives[request_id]
            if life.held_since is None:
                life.held_since = schedule

    def waited_since(self, request_id: str) -> int | None:
        life = self._lives.get(request_id)
        return None if life is None else life.held_since

    def own_copy(self, request_ids: Iterable[str]) -> None:
        """These requests compress their own copies from now on: waited enough, or a segment
        made for them failed (made again, it could fail again and hold them forever)."""
        for request_id in request_ids:
            self._record(request_id).own_copy = True

    def on_own_copy(self, request_id: str) -> bool:
        life = self._lives.get(request_id)
        return life is not None and life.own_copy

    def serve(self, readers: Iterable[str], length: int) -> None:
        """A segment or fork of ``length`` tokens was made for ``readers``."""
        for request_id in readers:
            self._record(request_id).served = length

    def served(self, request_id: str) -> int:
        life = self._lives.get(request_id)
        return 0 if life is None else life.served

    def readers_of(self, segment_id: str) -> tuple[str, ...]:
        life = self._lives.get(segment_id)
        return () if life is None else life.readers

    def preempted(self, request_id: str) -> None:
        """A running request was preempted: it is deferred no more, and a wait for a shared
        prefix in the queue again is bounded afresh."""
        if self.state(request_id) is Life.DEFERRED:
            self.move(request_id, Life.FREE)
        life = self._lives.get(request_id)
        if life is not None:
            life.held_since = None

    def end(self, request_id: str) -> None:
        """The request is gone (finished, aborted, failed; a fork filed or freed)."""
        life = self._lives.pop(request_id, None)
        if life is not None:
            self._in_state[life.state].discard(request_id)

    def __len__(self) -> int:
        return len(self._lives)

    def check(self) -> None:
        """Each record in exactly the state set it names."""
        for state, members in self._in_state.items():
            for request_id in members:
                assert self._lives[request_id].state is state, (request_id, state)
        assert sum(map(len, self._in_state.values())) == len(self._lives)

    def _record(self, request_id: str) -> RequestLife:
        life = self._lives.get(request_id)
        if life is None:
            life = self._lives[request_id] = RequestLife()
            self._in_state[Life.FREE].add(request_id)
        return life
