"""kvcompress's scheduler without vLLM's ``Scheduler.__init__``: the tests that drive its
steps by hand give it their own page manager, prefix-cache policy and requests, and this
gives it the rest of its state as ``KVCompressScheduler.__init__`` would."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvcompress.engine.pass_schedule import PassSchedule
from kvcompress.engine.sched.prefix_segments import PrefixSegments
from kvcompress.engine.sched.request_life import RequestLives
from kvcompress.engine.sched.scheduler import KVCompressScheduler
from kvcompress.engine.sched.sharing import PrefixSharing
from kvcompress.settings.flags import DEFAULT_SHARING_WAIT


def stand_in_scheduler(**state: Any) -> KVCompressScheduler:
    """``state``: at least ``kv_cache_manager``, ``page_manager``, ``reuse`` and
    ``requests``; anything else overrides the defaults."""
    scheduler = object.__new__(KVCompressScheduler)
    lives = RequestLives()
    segments = PrefixSegments(lives=lives)
    scheduler.__dict__.update(
        log_stats=False, check_pages_every_step=False, num_pages_freed_by_compression=0,
        scoring_gate=SimpleNamespace(prune=lambda requests, held=(): None),
        passes=PassSchedule(), lives=lives, segments=segments, _resting=frozenset())
    scheduler.__dict__.update(state)
    scheduler.sharing = PrefixSharing(scheduler, scheduler.page_manager, scheduler.reuse,
                                      segments, DEFAULT_SHARING_WAIT)
    return scheduler
