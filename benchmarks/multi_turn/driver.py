"""The conversation driver: runs every conversation turn by turn through an in-process
engine and records each request's time to first token, cached tokens and context match."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.multi_turn.workload import (
    Conversation,
    ConversationState,
    PromptBuilder,
    common_prefix,
)

ARRIVALS = ("rounds", "closed")


@dataclass
class TurnRecord:
    """One request: a turn of a conversation (``turn`` is 1-based)."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    context_tokens: int  # previous prompt + answer tokens (0 on turn 1)
    context_match: int  # common token prefix of this prompt with them
    ttft_s: float | None  # add_request -> the step that returned the first token (monotonic)
    ttft_vllm_s: float | None  # vLLM's first_token_latency (wall clock)
    queue_s: float | None
    prefill_s: float | None
    preemptions: int
    text: str | None = None  # the answer, kept for the last turn


# ----------------------------------------------------------------------------- the driver
def drive(
    engine: Any,
    conversations: Sequence[Conversation],
    builder: PromptBuilder,
    params_for: Callable[[Conversation, int], Any],
    arrivals: str = "rounds",
    on_step: Callable[[int], None] | None = None,
) -> tuple[list[TurnRecord], float]:
    """Run every conversation to its end through ``engine`` (an LLMEngine: ``add_request``,
    ``step``, ``has_unfinished_requests``); returns per-request records and the seconds spent.

    ``params_for(conversation, turn)`` gives a turn's SamplingParams (turn 0-based).
    ``on_step(generated_tokens)`` is called after every engine step.
    """
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals {arrivals!r}; allowed: {', '.join(ARRIVALS)}")
    states = [ConversationState(c) for c in conversations]
    pending: dict[str, tuple[ConversationState, list[int], int, int]] = {}
    added: dict[str, float] = {}  # request id -> when it was added
    first_token: dict[str, float] = {}  # request id -> when a step first returned a token
    records: list[TurnRecord] = []
    generated = 0

    def submit(state: ConversationState) -> None:
        ids, text = builder.prompt(state)
        context = state.prompt_ids + state.answer_ids if state.turn else []
        request_id = f"c{state.conversation.index}-t{state.turn + 1}"
        pending[request_id] = (state, ids, len(context), common_prefix(ids, context))
        state.prompt_ids, state.prompt_text = ids, text
        added[request_id] = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": ids},
                           params_for(state.conversation, state.turn))

    started = time.perf_counter()
    while True:
        if not engine.has_unfinished_requests():
            waiting = [s for s in states if not s.done]
            if not waiting:
                break
            for state in waiting:  # a round (or the first turns of a closed loop)
                submit(state)
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id not in first_token and output.outputs and \
                    output.outputs[0].token_ids:
                first_token[output.request_id] = now
            if not output.finished:
                continue
            state, ids, context, match = pending.pop(output.request_id)
            completion = output.outputs[0]
            ttft = first_token.pop(output.request_id, now) - added.pop(output.request_id)
            generated += len(completion.token_ids)
            last = state.turn == len(state.conversation.user) - 1
            records.append(TurnRecord(
                conversation=state.conversation.index, turn=state.turn + 1,
                prompt_tokens=len(ids), cached_tokens=int(output.num_cached_tokens or 0),
                output_tokens=len(completion.token_ids), context_tokens=context,
                context_match=match, ttft_s=ttft,
                **request_times(getattr(output, "metrics", None)),
                text=completion.text if last else None,
            ))
            state.finish_turn(completion.token_ids, completion.text)
            if arrivals == "closed" and not state.done:
                submit(state)
        if on_step is not None:
            on_step(generated)
    elapsed = time.perf_counter() - started
    if pending:
        raise RuntimeError(f"requests {sorted(pending)[:5]} never finished")
    return records, elapsed


def request_times(metrics: Any) -> dict[str, Any]:
    """vLLM's TTFT, queue and prefill seconds and preemptions of a finished request from its
    ``RequestStateStats`` (None without stats)."""
    if metrics is None:
        return {"ttft_vllm_s": None, "queue_s": None, "prefill_s": None, "preemptions": 0}
    scheduled = metrics.scheduled_ts
    return {
        "ttft_vllm_s": metrics.first_token_latency,
        "queue_s": scheduled - metrics.queued_ts if scheduled and metrics.queued_ts else None,
        "prefill_s": (metrics.first_token_ts - scheduled
                      if scheduled and metrics.first_token_ts else None),
        "preemptions": metrics.num_preemptions,
    }

