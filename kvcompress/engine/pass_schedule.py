"""Reconstruction passes as scheduled work: their tokens count in the step's token budget.

A prompt scored by reconstruction passes (``--kv-scoring reconstruct`` / ``hybrid``)
completes its prefill and samples its first token as any prompt does; the worker then
reports the pass chunks it needs (``WorkerReport.passes_pending``: the tokens of each).
Until its last chunk has run the request is *parked*: vLLM does not schedule its decode
(its prompt is not compacted yet), and each step grants chunks of the parked requests,
first come first served, out of the step's token budget after the decoding requests' one
token each, as a prefill chunk takes it. A pass token costs more than a prefill token: its
query is also scored against every key of the prompt, outside the attention kernel
(``attention.reconstruction_scores``), so a chunk of ``T`` tokens over ``S`` prompt keys
counts ``T * (1 + S / KEYS_PER_PREFILL_TOKEN)`` tokens (``chunk_cost``), and the worker cuts
a long prompt's passes into chunks that count no more than the budget (``pass_chunk``).
Measured on a 2-core AMD EPYC with the embedded model (fp32, 2,048-token budget): a pass
token cost about 3 prefill tokens at 1,500 prompt keys and 5.4 at 4,000. The constant
depends on the model's shape and the platform; it has not been measured on a GPU.
While any chunk waits at least one runs per step, so passes always progress; a chunk is
never larger than vLLM's batch (``scoring_memory.reconstruction_chunk``). The worker runs
exactly the granted chunks after the step's forward and compacts the prompt in the step
its last chunk ran; the request decodes from the next step on.

Before, every pass ran inside the step in which its prompt completed: every decoding
request of that step waited for the whole prompt once more through the model.

No vLLM imports: requests are read through the attributes used here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class StepPasses:
    """One step's share: the chunks granted (request id -> how many of its next ones) and
    their cost in budget tokens (``chunk_cost``)."""

    grants: dict[str, int]
    tokens: int


# Prompt keys whose scoring costs one pass token as much as a prefill token's forward.
KEYS_PER_PREFILL_TOKEN = 1000
# Fewest prompt tokens per pass: below it the instruction and the per-pass work dominate.
MIN_PASS_CHUNK = 64


def chunk_cost(tokens: int, keys: int) -> int:
    """Budget tokens a pass chunk of ``tokens`` counts, its queries scored against ``keys``
    prompt keys."""
    return math.ceil(tokens * (1 + keys / KEYS_PER_PREFILL_TOKEN))


def pass_chunk(configured: int, budget: int, keys: int, instruction: int) -> int:
    """Prompt tokens per pass for a prompt of ``keys`` tokens: ``configured``
    (--kv-reconstruct-chunk), or fewer so that a pass (its ``instruction`` tokens included)
    counts no more than the step's ``budget``; never under ``MIN_PASS_CHUNK``."""
    fits = int(budget / (1 + keys / KEYS_PER_PREFILL_TOKEN)) - instruction
    return max(1, min(configured, max(MIN_PASS_CHUNK, fits)))


class PassSchedule:
    def __init__(self) -> None:
        # Parked requests in arrival order, each with its chunks' costs still to grant.
        self.pending: dict[str, deque[int]] = {}
        self.tokens_granted = 0  # budget tokens over the engine's life (tests, logs)

    def add(self, reported: Mapping[str, list[int]], live: Mapping[str, Any]) -> None:
        """Park the requests a worker reported waiting for passes (those still running);
        each chunk costs ``chunk_cost`` against the prompt the request computed."""
        for request_id, chunks in reported.items():
            request = live.get(request_id)
            if request is not None and not request.is_finished() and chunks:
                keys = request.num_computed_tokens
                self.pending[request_id] = deque(chunk_cost(tokens, keys)
                                                 for tokens in chunks)

    def prune(self, live: Mapping[str, Any]) -> None:
        """Forget requests that finished or were aborted (their passes never run)."""
        for request_id in list(self.pending):
            request = live.get(request_id)
            if request is None or request.is_finished():
                del self.pending[request_id]

    def parked(self) -> frozenset[str]:
        return frozenset(self.pending)

    def grant(self, budget: int) -> StepPasses:
        """This step's chunks within ``budget`` tokens, in arrival order (a request's chunk
        that does not fit stops the grant: later requests do not overtake it), at least one
        chunk when any waits. A request whose last chunk is granted stays parked in this
        step and is released from the next (the scheduler reads ``parked`` before)."""
        grants: dict[str, int] = {}
        spent = 0
        for request_id, chunks in list(self.pending.items()):
            count = 0
            while chunks and (spent + chunks[0] <= budget or spent == 0):
                spent += chunks.popleft()
                count += 1
            if count:
                grants[request_id] = count
            if chunks:
                break
            del self.pending[request_id]
        self.tokens_granted += spent
        return StepPasses(grants, spent)
