"""Fault injection, for the tests that prove one request's failure stays its own.

``KVCOMPRESS_FAULT_INJECTION="STAGE[:PROMPT_LEN]"`` makes compression stage STAGE (``score``,
``reconstruct``, ``plan`` or ``moves``) raise ``InjectedFault`` for requests of that prompt
length (for every request when no length is given). Read from the environment each time,
so worker processes started by the tests inherit it; unset, it costs one dictionary lookup
per stage and step.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

ENV = "KVCOMPRESS_FAULT_INJECTION"
STAGES = ("score", "reconstruct", "plan", "moves")


class InjectedFault(RuntimeError):
    pass


def maybe_fail(stage: str, prompt_lens: Iterable[int]) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    wanted_stage, _, length = spec.partition(":")
    if wanted_stage not in STAGES:
        raise ValueError(f"{ENV}={spec!r}: the stage must be one of {', '.join(STAGES)}")
    if wanted_stage == stage and (not length or int(length) in set(prompt_lens)):
        raise InjectedFault(f"injected {stage} fault ({ENV}={spec})")
