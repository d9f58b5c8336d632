"""Multi-turn conversations: time to first token and reused prompt tokens per turn, vanilla
vLLM with prefix caching vs kvcompress without and with multi-turn reuse (``kv_reuse``).

Each conversation has ``--turns`` turns. A turn adds a user message of about
``--user-tokens`` tokens (filler text, as the quality tasks' haystacks) and the model's answer
(greedy, exactly ``--answer-tokens`` tokens: ``min_tokens`` = ``max_tokens`` masks the stop
tokens, so every configuration does the same work without ``ignore_eos`` writing past an
end-of-turn token). The next turn's prompt is the conversation so far through the model's chat
template, the previous answer as the assistant message, tokenized as vLLM's chat endpoint does
(``add_special_tokens=False``):

    python -m benchmarks.multi_turn                             # defaults, 3 configurations
    python -m benchmarks.multi_turn --conversations 16 --turns 6 --user-tokens 300 \\
        --answer-tokens 64 --configs vanilla,pyramidkv:256+reuse=off,pyramidkv:256+reuse=on
    python -m benchmarks.multi_turn --recall                    # pass key in turn 1, asked last

Configurations: ``vanilla`` (vLLM with its prefix cache on), ``vanilla-noprefix`` (prefix
cache off), and kvcompress as in the other benchmarks (``METHOD:BUDGET``, ``METHOD:r=RATIO``)
with ``+reuse=on`` / ``+reuse=off`` (``kv_reuse``; on when left out). Every configuration runs
in its own worker process with the same engine settings and the same KV-cache bytes; the
engine is built with ``enable_prefix_caching=True`` (kvcompress turns its own reuse off when
prefix caching is off), so only ``additional_config`` differs.

Memory-bound by default: the KV cache holds ``--kv-cache-conversations`` (3) conversations at
their longest, uncompressed, while there are many more conversations. ``--arrivals rounds``
(default) submits turn k of every conversation, waits for all of them, then turn k + 1;
``closed`` submits a conversation's next turn as soon as its answer is finished.

Time to first token: measured by the driver (the in-process engine is stepped here), from
just before ``add_request`` to the return of the engine step whose output first holds a token
of the request, on the monotonic clock. That is what vLLM's ``RequestOutput.metrics``
(``RequestStateStats.first_token_latency``, present offline when stats are on, and kept as
``ttft_vllm_s``) measures too, but vLLM takes it on the wall clock, which this VM steps (a
29 s jump inside one round was seen). It includes waiting for memory and for other requests
(in a memory-bound round most of it), so the table also splits it, from the engine core's
monotonic timestamps, into queue (queued -> first scheduled) and prefill (first scheduled ->
first token, which includes every step shared with other requests and any preemption).
Cached tokens: ``RequestOutput.num_cached_tokens`` (vLLM's prefix-cache hit for vanilla, the
adopted tokens of a finished request's compressed cache for kvcompress with reuse), and the
scheduler's prefix-cache queries / hits summed over steps. Context match: the longest common
token prefix of a turn's prompt with the previous turn's prompt + answer tokens, the most any
cache of the previous request can serve (the chat template re-tokenizes the answer text).

``--recall``: turn 1's user message hides a pass key in filler (``quality/tasks.py``), turns
2..N-1 add filler, turn N asks for it (the answer starts "The pass key is", greedy, short):
accuracy with its 95% Wilson interval, and the paired difference to vanilla and to kvcompress
without reuse over the same conversations. The KV cache then holds every conversation, so
reuse is limited by the compressed cache it adopts, not by evictions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.jobs import Reporter, make_workdir, run_jobs, worker_env, worker_main
from benchmarks.quality.tasks import fill_haystack
from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from benchmarks.specs import (
    CompressionSpec,
    EngineSettings,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_kv_options,
    resolve_dtype,
)

WORKER_MODULE = "benchmarks.multi_turn"  # workers: python -m WORKER_MODULE --worker ...
DEFAULT_CONFIGS = "vanilla,pyramidkv:r=0.75+reuse=off,pyramidkv:r=0.75+reuse=on"
NO_PREFIX_CACHING = "vanilla-noprefix"
REUSE_KEY = "kv_reuse"
ARRIVALS = ("rounds", "closed")
PROMPT_BUILDS = ("template", "tokens")
# --recall: its own defaults (flags given still win)
RECALL_DEFAULTS = {
    "conversations": 20, "turns": 4, "user_tokens": 200, "answer_tokens": 24,
    "output_json": RESULTS_DIR / "multi_turn_recall.json",
}
RECALL_ANSWER_TOKENS = 10  # the last turn's answer: the pass key and a little more
RECALL_PREFIX = "The pass key is"
BLOCK_SLACK = 128  # vLLM's KV block on CPU, in tokens
RATIO_KEYS = ("output_tok_s", "ttft_mean", "ttft_last_turn", "prefill_mean",
              "computed_prompt_tokens", "elapsed_s")

CHAT_LEADS = (
    "Here are my notes from today, part {turn}. Read them and tell me what you think.",
    "I wrote down some more things that happened, part {turn}. What do you make of them?",
    "Part {turn} of my notes follows. Please comment on it.",
)
RECALL_FIRST = ("I am giving you a pass key now. Remember it: I will ask you for it at the end "
                "of our conversation. Here are my notes, the pass key is among them.")
RECALL_QUESTION = "What is the pass key I gave you in my first message?"


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class RunConfig:
    """One configuration: a CompressionSpec and whether vLLM's prefix cache is on (vanilla;
    kvcompress engines get it on too, and ``kv_reuse`` decides)."""

    spec: CompressionSpec
    prefix_caching: bool = True

    @property
    def label(self) -> str:
        if self.spec.is_vanilla and not self.prefix_caching:
            return NO_PREFIX_CACHING
        return self.spec.label

    @property
    def reuse(self) -> str | None:
        """kvcompress's ``kv_reuse`` ("on" when not given); None for vanilla."""
        if self.spec.is_vanilla:
            return None
        return str(dict(self.spec.options).get(REUSE_KEY, "on"))

    @property
    def base_label(self) -> str:
        """The label without the reuse setting: configurations that differ only in reuse
        share it."""
        options = tuple((k, v) for k, v in self.spec.options if k != REUSE_KEY)
        spec = CompressionSpec(self.spec.method, self.spec.budget, self.spec.ratio,
                               self.spec.decode_policy, self.spec.decode_budget, options)
        return RunConfig(spec, self.prefix_caching).label

    def to_json(self) -> dict[str, Any]:
        return {"spec": vars(self.spec), "prefix_caching": self.prefix_caching}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunConfig:
        return cls(CompressionSpec(**data["spec"]), bool(data["prefix_caching"]))


def parse_configs(text: str) -> list[RunConfig]:
    """``vanilla`` (prefix caching on), ``vanilla-noprefix``, or a kvcompress configuration
    (``pyramidkv:r=0.75+reuse=off``), comma-separated."""
    configs = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        if part == NO_PREFIX_CACHING:
            configs.append(RunConfig(CompressionSpec(), prefix_caching=False))
            continue
        config = RunConfig(CompressionSpec.parse(part))
        if config.reuse not in (None, "on", "off"):
            raise ValueError(f"{part!r}: reuse must be on or off, got {config.reuse!r}")
        configs.append(config)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate configurations in {text!r}")
    if not configs:
        raise ValueError("no configurations")
    return configs


# ----------------------------------------------------------------------------- conversations
@dataclass
class Conversation:
    """One scripted conversation: a user message per turn (the answers come from the model).
    ``answer_prefix`` starts the last turn's assistant message (recall); ``references`` are
    what that answer must contain."""

    index: int
    user: list[str]
    answer_prefix: str = ""
    references: list[str] = field(default_factory=list)


TokenCounter = Callable[[str], int]


def filler(rng: random.Random, tokens: int, count: TokenCounter, needles: Sequence[str] = (),
           depths: Sequence[float] = ()) -> str:
    return " ".join(fill_haystack(rng, tokens, count, needles, depths))


def chat_conversations(num: int, turns: int, user_tokens: int, seed: int,
                       count: TokenCounter) -> list[Conversation]:
    """Each turn: a lead line and filler of about ``user_tokens`` tokens in all."""
    conversations = []
    for index in range(num):
        rng = random.Random(f"{seed}/chat/{index}")
        messages = []
        for turn in range(1, turns + 1):
            lead = rng.choice(CHAT_LEADS).format(turn=turn)
            body = filler(rng, max(0, user_tokens - count(lead) - 1), count)
            messages.append(f"{lead}\n{body}")
        conversations.append(Conversation(index, messages))
    return conversations


def recall_conversations(num: int, turns: int, user_tokens: int, seed: int,
                         count: TokenCounter) -> list[Conversation]:
    """Turn 1 hides a five-digit pass key in filler, turns 2..N-1 are filler, turn N asks."""
    if turns < 2:
        raise ValueError("--recall needs at least 2 turns (the fact, then the question)")
    conversations = []
    for index in range(num):
        rng = random.Random(f"{seed}/recall/{index}")
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        first = filler(rng, max(0, user_tokens - count(RECALL_FIRST) - 1), count, [needle],
                       [rng.uniform(0.1, 0.9)])
        messages = [f"{RECALL_FIRST}\n{first}"]
        for turn in range(2, turns):
            lead = rng.choice(CHAT_LEADS).format(turn=turn)
            messages.append(f"{lead}\n{filler(rng, max(0, user_tokens - count(lead) - 1), count)}")
        messages.append(RECALL_QUESTION)
        conversations.append(Conversation(index, messages, RECALL_PREFIX, [key]))
    return conversations


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same


class PromptBuilder:
    """Turn prompts of a conversation. ``template``: the whole conversation through the chat
    template, tokenized (what a chat client and vLLM's chat endpoint do). ``tokens``: the
    previous prompt's and answer's token ids, then the template's text after the answer
    tokenized on its own: an exact extension by construction."""

    def __init__(self, tokenizer: Any, mode: str = "template") -> None:
        if mode not in PROMPT_BUILDS:
            raise ValueError(f"prompt build {mode!r}; allowed: {', '.join(PROMPT_BUILDS)}")
        self.tokenizer = tokenizer
        self.mode = mode

    def render(self, messages: Sequence[Mapping[str, str]], answer_prefix: str = "") -> str:
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=True)
        return text + answer_prefix

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, state: ConversationState) -> tuple[list[int], str]:
        """The next turn's (token ids, text) for ``state``."""
        conversation, turn = state.conversation, state.turn
        messages = [*state.messages, {"role": "user", "content": conversation.user[turn]}]
        last = turn == len(conversation.user) - 1
        text = self.render(messages, conversation.answer_prefix if last else "")
        if self.mode == "template" or turn == 0:
            return self.encode(text), text
        head = state.prompt_text + state.answer_text
        if not text.startswith(head):
            raise ValueError("the chat template renders earlier turns differently in a longer "
                             "conversation: use --prompt-build template")
        return state.prompt_ids + state.answer_ids + self.encode(text[len(head):]), text


@dataclass
class ConversationState:
    conversation: Conversation
    turn: int = 0  # the next turn to submit, 0-based
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # the last submitted prompt
    prompt_text: str = ""
    answer_ids: list[int] = field(default_factory=list)  # the last answer
    answer_text: str = ""

    @property
    def done(self) -> bool:
        return self.turn >= len(self.conversation.user)

    def finish_turn(self, answer_ids: Sequence[int], answer_text: str) -> None:
        self.messages += [{"role": "user", "content": self.conversation.user[self.turn]},
                          {"role": "assistant", "content": answer_text}]
        self.answer_ids, self.answer_text = list(answer_ids), answer_text
        self.turn += 1


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


# ----------------------------------------------------------------------------- summaries
def _mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def per_turn(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Figures of each turn number over the conversations."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        mine = [r for r in records if r["turn"] == turn]
        prompt = sum(r["prompt_tokens"] for r in mine)
        cached = sum(r["cached_tokens"] for r in mine)
        context = sum(r["context_tokens"] for r in mine)
        ttfts = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        rows.append({
            "turn": turn,
            "requests": len(mine),
            "ttft_mean": _mean(ttfts),
            "ttft_p50": statistics.median(ttfts) if ttfts else None,
            "ttft_max": max(ttfts) if ttfts else None,
            "ttft_vllm_mean": _mean([r.get("ttft_vllm_s") for r in mine]),
            "queue_mean": _mean([r["queue_s"] for r in mine]),
            "prefill_mean": _mean([r["prefill_s"] for r in mine]),
            "prompt_tokens_mean": prompt / len(mine),
            "cached_tokens_mean": cached / len(mine),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": prompt - cached,
            "cached_share": cached / prompt if prompt else 0.0,
            "context_match_share": (sum(r["context_match"] for r in mine) / context
                                    if context else None),
            "context_exact": (sum(r["context_match"] == r["context_tokens"] for r in mine)
                              / len(mine) if context else None),
            "preemptions": sum(r["preemptions"] for r in mine),
        })
    return rows


def summarize(records: Sequence[Mapping[str, Any]], elapsed: float) -> dict[str, Any]:
    """A configuration's totals and per-turn figures from its request records."""
    turns = per_turn(records)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    output = sum(r["output_tokens"] for r in records)
    context = sum(r["context_tokens"] for r in records)
    return {
        "elapsed_s": elapsed,
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "output_tokens": output,
        "output_tok_s": output / elapsed if elapsed > 0 else 0.0,
        "total_tok_s": (prompt + output) / elapsed if elapsed > 0 else 0.0,
        "ttft_mean": _mean([r["ttft_s"] for r in records]),
        "ttft_last_turn": turns[-1]["ttft_mean"] if turns else None,
        "queue_mean": _mean([r["queue_s"] for r in records]),
        "prefill_mean": _mean([r["prefill_s"] for r in records]),
        "context_match_share": sum(r["context_match"] for r in records) / context
        if context else None,
        "request_preemptions": sum(r["preemptions"] for r in records),
        "per_turn": turns,
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


def ratios(row: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Each of RATIO_KEYS and the TTFT of every turn, over ``base``'s (None without it)."""
    if base is None or not row.get("ok") or not base.get("ok"):
        return None
    out: dict[str, Any] = {key: ratio(row.get(key), base.get(key)) for key in RATIO_KEYS}
    theirs = {t["turn"]: t for t in base["per_turn"]}
    out["ttft_per_turn"] = [ratio(t["ttft_mean"], theirs.get(t["turn"], {}).get("ttft_mean"))
                            for t in row["per_turn"]]
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_vanilla``: over ``vanilla`` (prefix caching on). ``vs_no_reuse``: a kvcompress
    configuration with reuse on over the same one with reuse off (None for the others)."""
    vanilla = next((r for r in rows if r["label"] == "vanilla"), None)
    for row in rows:
        row["vs_vanilla"] = ratios(row, vanilla)
        twin = None
        if row.get("reuse") == "on":
            twin = next((r for r in rows if r.get("reuse") == "off"
                         and r["base_label"] == row["base_label"]), None)
        row["vs_no_reuse"] = ratios(row, twin)


def recall_scores(records: Sequence[Mapping[str, Any]],
                  conversations: Sequence[Conversation]) -> list[float]:
    """Per conversation (in order): 1 if its last answer holds every reference."""
    from benchmarks.quality.scoring import score

    last = {r["conversation"]: r for r in records if r.get("text") is not None}
    return [score(last[c.index]["text"], c.references, "all") if c.index in last else 0.0
            for c in conversations]


def add_recall(rows: list[dict[str, Any]], conversations: Sequence[Conversation]) -> None:
    """Accuracy, its Wilson interval, and paired differences to vanilla and to no reuse."""
    from benchmarks.quality.scoring import paired_difference, wilson_interval

    for row in rows:
        if row.get("ok"):
            scores = recall_scores(row["records"], conversations)
            row["recall"] = {"accuracy": _mean(scores), "interval": wilson_interval(scores),
                             "scores": scores}
    vanilla = next((r for r in rows if r["label"] == "vanilla" and r.get("recall")), None)
    for row in rows:
        if not row.get("recall"):
            continue
        scores = row["recall"]["scores"]
        row["recall"]["vs_vanilla"] = (paired_difference(scores, vanilla["recall"]["scores"])
                                       if vanilla else None)
        twin = next((r for r in rows if r.get("recall") and r.get("reuse") == "off"
                     and row.get("reuse") == "on" and r["base_label"] == row["base_label"]),
                    None)
        row["recall"]["vs_no_reuse"] = (paired_difference(scores, twin["recall"]["scores"])
                                        if twin else None)


# ----------------------------------------------------------------------------- worker side
def prefix_cache_logger(sink: dict[str, int]) -> Callable[..., Any]:
    """A vLLM stat logger factory summing the scheduler's prefix-cache queries and hits."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixCacheRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            stats = getattr(scheduler_stats, "prefix_cache_stats", None)
            if stats is not None:
                sink["requests"] += stats.requests
                sink["queries"] += stats.queries
                sink["hits"] += stats.hits

        def log_engine_initialized(self) -> None:
            pass

    return PrefixCacheRecorder


def sampling_params(conversation: Conversation, turn: int, answer_tokens: int,
                    special_ids: Sequence[int]) -> Any:
    """Greedy. Every answer but a recall question's: exactly ``answer_tokens`` tokens, the
    special tokens masked (min_tokens masks stop tokens until it is reached)."""
    from vllm import SamplingParams

    if conversation.answer_prefix and turn == len(conversation.user) - 1:
        return SamplingParams(max_tokens=RECALL_ANSWER_TOKENS, temperature=0.0)
    return SamplingParams(max_tokens=answer_tokens, min_tokens=answer_tokens, temperature=0.0,
                          stop_token_ids=list(special_ids))


def special_token_ids(tokenizer: Any) -> list[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(token, "special", False))
    return sorted(ids)


def warm_up(engine: Any) -> None:
    """One short request whose tokens share no prefix with a chat-templated prompt (a cached
    copy of it must not serve the conversations' system prompt)."""
    from vllm import SamplingParams

    engine.add_request("warmup", {"prompt_token_ids": list(range(1000, 1064))},
                       SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from benchmarks.engine import build_engine
    from kvcompress.engine.stats import EngineStats, StepStatsRecorder

    settings = EngineSettings(**job["settings"])
    config = RunConfig.from_json(job["config"])
    workload = json.loads(Path(job["workload_path"]).read_text())
    conversations = [Conversation(**c) for c in workload["conversations"]]
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    builder = PromptBuilder(tokenizer, workload["prompt_build"])
    special = special_token_ids(tokenizer)
    sink = EngineStats()
    prefix = {"requests": 0, "queries": 0, "hits": 0}
    engine = build_engine(settings, config.spec, enable_prefix_caching=config.prefix_caching,
                          stat_loggers=[StepStatsRecorder.factory(sink),
                                        prefix_cache_logger(prefix)])
    try:
        if job["warmup"]:  # one-time costs (kernel selection, allocations) out of the figures
            warm_up(engine)
        sink.samples.clear()
        sink.preemptions = sink.generated_tokens = sink.prompt_tokens = 0
        sink.preempted_tokens = None
        prefix.update(requests=0, queries=0, hits=0)
        last = [0.0]

        def on_step(generated: int) -> None:
            now = time.monotonic()
            if now - last[0] > 1.0:
                last[0] = now
                reporter.progress(generated)

        records, elapsed = drive(
            engine, conversations, builder,
            lambda c, t: sampling_params(c, t, workload["answer_tokens"], special),
            workload["arrivals"], on_step,
        )
    finally:
        from benchmarks.engine import shutdown_engine

        shutdown_engine(engine)
    busy = [s for s in sink.samples if s.running > 0]
    return {
        "records": [asdict(r) for r in records],
        "elapsed_s": elapsed,
        "preemptions": sink.preemptions,
        "preempted_tokens": sink.preempted_tokens,
        "prefix_cache": prefix,
        "peak_running": max((s.running for s in sink.samples), default=0),
        "mean_running": sum(s.running for s in busy) / len(busy) if busy else 0.0,
        "peak_kv_usage": max((s.kv_cache_usage for s in sink.samples), default=0.0),
    }


# ----------------------------------------------------------------------------- parent side
def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated: vanilla (prefix caching on), vanilla-noprefix, "
                             "METHOD:BUDGET or METHOD:r=RATIO with +reuse=on|off")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--recall", action="store_true",
                          help="pass-key recall across turns; defaults: " + ", ".join(
                              f"{key}={value}" for key, value in RECALL_DEFAULTS.items()
                              if key != "output_json") + " (flags given still win)")
    workload.add_argument("--conversations", type=int, default=10)
    workload.add_argument("--turns", type=int, default=5)
    workload.add_argument("--user-tokens", type=int, default=200,
                          help="tokens of each turn's user message (about)")
    workload.add_argument("--answer-tokens", type=int, default=48,
                          help="tokens of each answer (exactly, greedy)")
    workload.add_argument("--arrivals", choices=ARRIVALS, default="rounds",
                          help="rounds: turn k of every conversation, then k + 1; closed: a "
                               "conversation's next turn as soon as its answer is done")
    workload.add_argument("--prompt-build", choices=PROMPT_BUILDS, default="template",
                          help="template: each prompt through the chat template (re-tokenizes "
                               "the answers); tokens: previous prompt + answer ids + new text")
    workload.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine (identical for every configuration)")
    engine.add_argument("--kv-cache-conversations", type=float, default=None,
                        help="KV cache in conversations at their longest, uncompressed "
                             "(default 3; --recall: every conversation)")
    engine.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache in uncompressed tokens; overrides "
                             "--kv-cache-conversations")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--dtype", default="auto",
                        help="auto = bfloat16, or float32 on CPUs without native bf16")
    engine.add_argument("--compile", action="store_true",
                        help="torch.compile / CUDA graphs (default: enforce_eager)")
    engine.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the in-process engine (default: cores - 1)")
    engine.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra kvcompress setting for compressed runs, e.g. kv_window=16")
    run = parser.add_argument_group("run")
    run.add_argument("--no-warmup", dest="warmup", action="store_false")
    run.add_argument("--job-timeout", type=float, default=1800.0,
                     help="seconds before a configuration is killed")
    run.add_argument("--output-json", type=Path, default=RESULTS_DIR / "multi_turn.json")
    run.add_argument("--plot", type=Path, default=None,
                     help="PNG of TTFT and prefilled tokens per turn (default: next to the "
                          "JSON; needs matplotlib)")
    run.add_argument("--log-file", type=Path, default=None,
                     help="vLLM logs (default: a temporary folder)")
    run.add_argument("--verbose", action="store_true", help="INFO-level vLLM logs in the log")
    run.add_argument("--no-progress", action="store_true")
    return parser


def check_args(args: argparse.Namespace) -> None:
    for name in ("conversations", "turns", "user_tokens", "answer_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.recall and args.turns < 2:
        raise SystemExit("--recall needs --turns >= 2")


def longest_conversation(builder: PromptBuilder, conversation: Conversation,
                         answer_tokens: int) -> int:
    """Tokens of a conversation at its end (last prompt + answer), answers stood in for by
    ``answer_tokens`` one-token words, plus slack for re-tokenized answers."""
    messages: list[dict[str, str]] = []
    stand_in = " ".join(["word"] * answer_tokens)
    for turn, user in enumerate(conversation.user):
        messages.append({"role": "user", "content": user})
        if turn < len(conversation.user) - 1:
            messages.append({"role": "assistant", "content": stand_in})
    prompt = builder.encode(builder.render(messages, conversation.answer_prefix))
    return len(prompt) + answer_tokens + 8 * len(conversation.user)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    parser = build_parser()
    if "--recall" in argv:
        parser.set_defaults(**RECALL_DEFAULTS)
    args = parser.parse_args(argv)
    check_args(args)
    started = time.perf_counter()
    try:
        configs = parse_configs(args.configs)
        options = parse_kv_options(args.kv_option)
        check_settings(configs, options)
    except ValueError as error:
        raise SystemExit(f"--configs: {error}") from None

    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    make = recall_conversations if args.recall else chat_conversations
    conversations = make(args.conversations, args.turns, args.user_tokens, args.seed, count)
    builder = PromptBuilder(tokenizer, args.prompt_build)
    longest = max(longest_conversation(builder, c, args.answer_tokens) for c in conversations)
    dtype = resolve_dtype(args.dtype, device)
    per_token = kv_bytes_per_token(model, dtype)
    in_conversations = args.kv_cache_conversations or (
        float(args.conversations) if args.recall else 3.0)
    # vLLM also needs its null block and a whole block for the last partial one (128 tokens
    # each on CPU): a tiny pool of "one conversation" would refuse to start
    kv_tokens = args.kv_cache_tokens or max(int(in_conversations * longest),
                                            longest + 2 * BLOCK_SLACK)
    if kv_tokens < longest:
        raise SystemExit(f"the KV cache ({kv_tokens} tokens) must hold one conversation "
                         f"({longest} tokens)")
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_tokens * per_token, enforce_eager=not args.compile,
        seed=args.seed, compression_options=options,
    )
    threads = (args.threads or default_threads()) if device == "cpu" else None
    workdir = make_workdir("multi-turn")
    workload = {
        "kind": "recall" if args.recall else "chat",
        "conversations": [asdict(c) for c in conversations],
        "turns": args.turns, "user_tokens": args.user_tokens,
        "answer_tokens": args.answer_tokens, "arrivals": args.arrivals,
        "prompt_build": args.prompt_build, "seed": args.seed,
    }
    workload_path = workdir / "workload.json"
    workload_path.write_text(json.dumps(workload))
    log_path = args.log_file or workdir / "vllm.log"
    described = {key: value for key, value in workload.items() if key != "conversations"}
    described.update(num_conversations=len(conversations), longest_conversation_tokens=longest,
                     kv_cache_conversations=kv_tokens / longest)
    header = {
        "benchmark": "multi_turn_recall" if args.recall else "multi_turn",
        "command": command_string([sys.argv[0], *argv]),
        "machine": machine_info(device),
        "settings": {**vars(settings), "kv_cache_capacity_tokens": kv_tokens,
                     "kv_bytes_per_token": per_token, "threads": threads,
                     "enable_prefix_caching": {c.label: c.prefix_caching for c in configs},
                     "warmup": args.warmup},
        "workload": described,
        "ttft_measurement": TTFT_MEASUREMENT,
    }
    print(f"command: {header['command']}")
    print(f"settings: {json.dumps(header['settings'])}")
    print(f"workload: {json.dumps(described)}")
    print(f"configs: {', '.join(c.label for c in configs)}; vLLM logs: {log_path}", flush=True)

    jobs = [{"id": config.label, "config": config.to_json(), "settings": vars(settings),
             "isolate": True, "workload_path": str(workload_path), "warmup": args.warmup}
            for config in configs]
    units = float(len(conversations) * args.turns * args.answer_tokens)
    results = run_jobs(
        WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: units for job in jobs}, job_timeout=args.job_timeout,
        env=worker_env(args.verbose, False, threads), desc="multi-turn",
        show_progress=not args.no_progress,
    )
    rows = [config_row(config, results[config.label]) for config in configs]
    add_ratios(rows)
    if args.recall:
        add_recall(rows, conversations)
    report = {**header, "configs": rows, "runtime_s": time.perf_counter() - started}
    write_json(args.output_json, report)
    print()
    print(render(rows))
    if args.recall:
        print()
        print(render_recall(rows))
    png = args.plot or args.output_json.with_suffix(".png")
    if plot(rows, png, plot_title(report)):
        print(f"\nplot: {png}")
    for row in rows:
        if not row["ok"]:
            print(f"\n{row['label']} FAILED:\n{row['error']}")
    print(f"\nwrote {args.output_json} ({report['runtime_s']:.0f} s)")
    return 0 if all(row["ok"] for row in rows) else 1


TTFT_MEASUREMENT = (
    "ttft_s: monotonic time from just before add_request to the return of the engine step "
    "whose RequestOutput first holds a token (the in-process engine is stepped by the "
    "benchmark), queueing included; ttft_vllm_s: vLLM's RequestOutput.metrics."
    "first_token_latency, the same interval on the wall clock (which the VM may step); "
    "queue_s = scheduled_ts - queued_ts and prefill_s = first_token_ts - scheduled_ts from the "
    "engine core's monotonic timestamps. Cached tokens: RequestOutput.num_cached_tokens."
)


def check_settings(configs: Sequence[RunConfig], options: dict[str, Any]) -> None:
    """Every kvcompress configuration's settings are valid, before any engine starts."""
    from kvcompress.config import KVCompressionConfig, KVCompressionConfigError

    for config in configs:
        try:
            KVCompressionConfig.from_mapping(config.spec.additional_config(options))
        except KVCompressionConfigError as error:
            raise ValueError(f"{config.label}: {error}") from None


def config_row(config: RunConfig, outcome: Any) -> dict[str, Any]:
    spec = config.spec
    row: dict[str, Any] = {
        "label": config.label, "base_label": config.base_label, "method": spec.method,
        "budget": spec.budget, "ratio": spec.ratio, "reuse": config.reuse,
        "prefix_caching": config.prefix_caching, "ok": outcome.error is None,
        "error": outcome.error, "job_seconds": outcome.seconds,
    }
    if outcome.result is not None:
        result = dict(outcome.result)
        records = result.pop("records")
        row.update(summarize(records, result.pop("elapsed_s")))
        row.update(result)
        row["records"] = records
    return row


# ----------------------------------------------------------------------------- output
def render(rows: Sequence[Mapping[str, Any]]) -> str:
    summary = []
    for row in rows:
        van, own = row.get("vs_vanilla") or {}, row.get("vs_no_reuse") or {}
        summary.append({
            **row,
            "out_van": van.get("output_tok_s"), "out_own": own.get("output_tok_s"),
            "ttft_van": van.get("ttft_mean"), "ttft_own": own.get("ttft_mean"),
            "last_van": van.get("ttft_last_turn"), "last_own": own.get("ttft_last_turn"),
            "cached_pct": 100 * row["cached_share"] if row.get("ok") else None,
        })
    table = format_table(summary, [
        ("label", "config"), ("output_tok_s", "out tok/s"), ("out_van", "x van"),
        ("out_own", "x no-reuse"), ("ttft_mean", "TTFT s"), ("ttft_van", "x van"),
        ("ttft_own", "x no-reuse"), ("ttft_last_turn", "TTFT last"), ("last_van", "x van"),
        ("last_own", "x no-reuse"), ("prompt_tokens", "prompt tok"),
        ("cached_tokens", "cached tok"), ("cached_pct", "cached %"),
        ("preemptions", "preempt"), ("peak_running", "peak run"), ("elapsed_s", "time s"),
    ])
    turns = []
    for row in rows:
        van = (row.get("vs_vanilla") or {}).get("ttft_per_turn") or []
        own = (row.get("vs_no_reuse") or {}).get("ttft_per_turn") or []
        for index, turn in enumerate(row.get("per_turn") or []):
            turns.append({
                "label": row["label"], **turn,
                "match_pct": (None if turn["context_match_share"] is None
                              else 100 * turn["context_match_share"]),
                "ttft_van": van[index] if index < len(van) else None,
                "ttft_own": own[index] if index < len(own) else None,
            })
    per_turn_table = format_table(turns, [
        ("label", "config"), ("turn", "turn"), ("ttft_mean", "TTFT s"), ("ttft_van", "x van"),
        ("ttft_own", "x no-reuse"), ("queue_mean", "queue s"), ("prefill_mean", "prefill s"),
        ("prompt_tokens_mean", "prompt tok"), ("cached_tokens_mean", "cached tok"),
        ("match_pct", "ctx match %"), ("preemptions", "preempt"),
    ], digits=2)
    return (f"{table}\n\nper turn (means over conversations; ctx match: common token prefix "
            f"with the previous prompt + answer):\n{per_turn_table}")


def render_recall(rows: Sequence[Mapping[str, Any]]) -> str:
    table = []
    for row in rows:
        recall = row.get("recall") or {}
        interval = recall.get("interval")
        van, own = recall.get("vs_vanilla") or {}, recall.get("vs_no_reuse") or {}
        last = (row.get("per_turn") or [{}])[-1]
        table.append({
            "label": row["label"], "accuracy": recall.get("accuracy"),
            "interval": f"{interval[0]:.2f}-{interval[1]:.2f}" if interval else None,
            "vs_van": van.get("mean"), "vs_own": own.get("mean"),
            "n": len(recall.get("scores") or []), "cached": last.get("cached_tokens_mean"),
            "prompt": last.get("prompt_tokens_mean"),
        })
    return "recall (pass key from turn 1, asked in the last turn):\n" + format_table(table, [
        ("label", "config"), ("accuracy", "accuracy"), ("interval", "95% CI"),
        ("vs_van", "- vanilla"), ("vs_own", "- no-reuse"), ("n", "n"),
        ("prompt", "last prompt tok"), ("cached", "last cached tok"),
    ])


def plot_title(report: Mapping[str, Any]) -> str:
    w = report["workload"]
    return (f"{Path(report['settings']['model']).name}: {w['num_conversations']} conversations x "
            f"{w['turns']} turns, {w['user_tokens']} user + {w['answer_tokens']} answer tokens, "
            f"KV {report['settings']['kv_cache_capacity_tokens']} tokens")


def plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> bool:
    """TTFT and prefilled / cached tokens per turn; False without matplotlib or results."""
    rows = [row for row in rows if row.get("ok")]
    try:
        import matplotlib
    except ImportError:
        return False
    if not rows:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for index, row in enumerate(rows):
        turns = [t["turn"] for t in row["per_turn"]]
        color = f"C{index}"
        left.plot(turns, [t["ttft_mean"] for t in row["per_turn"]], marker="o", color=color,
                  label=row["label"])
        right.plot(turns, [t["prompt_tokens_mean"] - t["cached_tokens_mean"]
                           for t in row["per_turn"]], marker="o", color=color,
                   label=f"{row['label']} prefilled")
        right.plot(turns, [t["cached_tokens_mean"] for t in row["per_turn"]], marker="x",
                   linestyle="--", color=color, label=f"{row['label']} cached")
    left.set_ylabel("mean time to first token (s)")
    right.set_ylabel("tokens per request")
    for ax in (left, right):
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    left.legend()
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
