"""Concurrent requests on one long shared prefix: what vLLM's prefix cache shares among running
requests and kvcompress does not yet (issue 40, "compress once, share everywhere"), in one
invocation, same KV-cache bytes.

    python -m benchmarks.shared_prefix --quick                   # N = 8, 32 (~10-15 min)
    python -m benchmarks.shared_prefix --workload system-prompt --quick   # issue 40's chats
    python -m benchmarks.shared_prefix     # N = 8, 32, 128, concurrent + staggered (> 1 h)
    python -m benchmarks.shared_prefix --configs vanilla,pyramidkv:r=0.75 --requests 8 \\
        --arrivals concurrent,warmed --kv-pools 3

Time on 2 busy cores (2026-12-04): ``--workload system-prompt --requests 8
--configs vanilla,pyramidkv:r=0.75`` (both default arrivals) took 180 s: 35 s of scenarios for
vanilla, 54 s for kvcompress, the rest engine starts. Work grows with N, so ``--quick``
(N = 8 and 32: five times the requests) should take ~10-15 minutes with the system-prompt
workload (the document one has two pools and 16-token answers: of the same order), and the
defaults (N = 128 too: 21 times; three configurations) over an hour: estimates from that run.

Workloads (``--workload``; each sets its own defaults for the options left unset):
- ``document`` (the default): per scenario a document of about ``--doc-tokens`` tokens
  (filler with four facts: ``benchmarks.documents``, as in shared_context) and N questions
  about it, numbered and cycling through the document's five, each request the chat
  template's rendering of the document and one question in one user message, the assistant
  message continued from the answer's start; 16-token answers, pools of 3 longest requests
  and ``all``.
- ``system-prompt``: issue 40's chats: the document (~1.5k tokens) is the system message,
  each user message ~``--question-tokens`` (270) tokens of its own (seeded filler, then the
  numbered question), 128 tokens out, a 130 MiB pool (``--kv-pools 130M``).
Token ids: the shared prefix (the template through the end of the document) tokenized once,
the rest of each prompt on its own, so every prompt starts with exactly the same ids (a
client that keeps a system prompt's ids). Answers: greedy, exactly ``--answer-tokens``
tokens (``min_tokens`` masks the stop tokens). Each scenario has a document of its own, so
no scenario's cache serves another.

Arrivals (how the N requests reach the engine):
- ``concurrent``: all N at once.
- ``staggered``: the first alone; the other N-1 once it has its first token (its prefill is
  done). vLLM's prefix cache serves them the prefix from the running request; kvcompress
  shares only finished requests' caches, so they prefill it again: what sharing among
  running requests would buy.
- ``warmed``: the workaround: one request whose prompt is the shared prefix alone (two output
  tokens) runs to its end, then all N at once. vLLM serves its cached blocks; kvcompress
  (``--kv-reuse on``) files the finished request's compressed cache and each of the N adopts
  it (``num_cached_tokens``). The warm request counts in the scenario's time and prefill.
  Two tokens, not one: a request that ends in its prefill step is not compressed, and its
  uncompressed cache is not adopted by requests that would compress it.

Configurations: ``vanilla`` (vLLM with its prefix cache) and kvcompress in the other
benchmarks' syntax (``pyramidkv:r=0.75``; defaults ``--kv-scoring auto`` = hybrid and
``--kv-reuse on``), every one with the engine built with prefix caching on. KV pools
(``--kv-pools``): multiples of the longest request (prompt + answer, uncompressed), and
``all``: every request of the largest N its own uncompressed copy. The first default (3) is
memory-bound: vanilla holds the prefix once and every request's own blocks, not N copies.

Figures per pool, configuration and scenario: KV held per request (``kv_held_per_request``,
bytes; ``KV MB/req``): the mean over engine steps with requests running of the pool's usage
(vLLM's ``kv_cache_usage``: blocks or pages that running requests hold, a shared one counted
once, cached ones no running request reads not counted) times the KV bytes, over the running
requests. It is the pool's occupancy divided among its readers, not any one request's pages:
which pages "belong" to a request is ambiguous once they are shared, and what a shared prefix
saves shows as less memory per reader. kvcompress's usage is a share of its page pool, which
leaves out its scoring reserve, so its bytes are an upper bound. Also its peak
(``peak_kv_held``: the most bytes running requests held at once) and the per-request figure in
tokens of the model's dtype (``kv_held_per_request_tokens``). Prefill tokens computed (vLLM's
iteration details: tokens scheduled per step less one per decoding request; a preempted
request's recompute counts), and the same in copies of the shared prefix (``prefix_computed``:
(prefill - every prompt's own part) / prefix length); cached tokens
(``RequestOutput.num_cached_tokens``), and the fewest any reader but the first (request 0) had
(``min_cached_after_first``; the table: over the prefix length); peak running requests,
preemptions; time to first token (from each request's submission to the step that returned its
first token, monotonic clock) mean and median; output tokens per second over the scenario's
wall time; answers right. Ratios: every kvcompress figure over vanilla's in the same pool and
scenario.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.documents import (
    HEADER,
    Document,
    Prompts,
    Question,
    make_documents,
    prompts_sharing_the_document,
    score_answer,
    system_prompt_prompts,
)
from benchmarks.engine import Wave
from benchmarks.jobs import (
    Reporter,
    make_workdir,
    run_jobs,
    worker_env,
    worker_main,
    write_workload,
)
from benchmarks.report import (
    RESULTS_DIR,
    command_string,
    conclude,
    format_table,
    git_commit,
    machine_info,
    save_report,
)
from benchmarks.specs import (
    CompressionSpec,
    EngineSettings,
    add_engine_options,
    add_run_options,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_bytes,
    parse_ints,
    parse_kv_options,
    parse_names,
    parse_specs,
    resolve_dtype,
    token_counter,
)

WORKER_MODULE = "benchmarks.shared_prefix"
ARRIVALS = ("concurrent", "staggered", "warmed")
DEFAULT_ARRIVALS = "concurrent,staggered"
DEFAULT_REQUESTS = "8,32,128"
DEFAULT_CONFIGS = "vanilla,pyramidkv:r=0.75,snapkv:r=0.75"
ALL_POOL = "all"
WORKLOADS = ("document", "system-prompt")
# Each workload's defaults (flags given win): the document's questions (a short answer,
# checked) and issue 40's chats (a ~1.5k-token system prompt, a ~270-token question each,
# 128 tokens out, 130 MB of KV memory).
WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "document": {"doc_tokens": 2000, "question_tokens": 0, "answer_tokens": 16,
                 "kv_pools": f"3,{ALL_POOL}"},
    "system-prompt": {"doc_tokens": 1500, "question_tokens": 270, "answer_tokens": 128,
                      "kv_pools": "130M"},
}
# --quick: the two smaller N and one configuration against vanilla (see the docstring).
QUICK = {"requests": "8,32", "configs": "vanilla,pyramidkv:r=0.75"}
# The figures compared with vanilla's, and whether more is better (for the table's notes).
RATIO_KEYS = ("prefill_tokens", "ttft_mean", "ttft_p50", "output_tok_s", "peak_running",
              "kv_held_per_request", "elapsed_s")


# ----------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Scenario:
    name: str
    requests: int
    arrivals: str
    document: int
    prefix_ids: list[int]  # the shared prefix; every prompt starts with it
    prompts: list[list[int]]
    questions: list[int]  # the document question each request asks (index)


def scenario_name(requests: int, arrivals: str) -> str:
    return f"n{requests}-{arrivals}"


def shared_prefix_prompts(prompts: Prompts, document: Document,
                          requests: int) -> tuple[list[int], list[list[int]], list[int]]:
    """The shared prefix's ids, then ``requests`` prompts (prefix + their own part) and the
    question each asks: numbered, cycling through the document's questions."""

    def messages(number: int, question: Question) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{HEADER}\n\n{document.text}\n\n"
                                            f"Question {number + 1}: {question.text}"},
                {"role": "assistant", "content": question.prefix}]

    return prompts_sharing_the_document(prompts, document, requests, messages)


def make_scenarios(prompts: Prompts, documents: Sequence[Document], requests: Sequence[int],
                   arrivals: Sequence[str], *, workload: str = "document",
                   question_tokens: int = 0, count: Callable[[str], int] | None = None,
                   seed: int = 0) -> list[Scenario]:
    """Every N x arrivals, each on a document of its own (``documents`` holds enough);
    ``workload``: the document and a question in one user message (``document``) or the
    document as the system prompt and a question of ``question_tokens`` (``system-prompt``,
    ``count`` counts tokens)."""
    scenarios = []
    combos = [(n, a) for n in requests for a in arrivals]
    if len(documents) < len(combos):
        raise ValueError(f"{len(combos)} scenarios need as many documents")
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}; allowed: {', '.join(WORKLOADS)}")
    for (n, kind), document in zip(combos, documents):
        if workload == "system-prompt":
            if count is None:
                raise ValueError("the system-prompt workload needs a token counter")
            prefix_ids, ids, asked = system_prompt_prompts(prompts, document, n,
                                                           question_tokens, count, seed)
        else:
            prefix_ids, ids, asked = shared_prefix_prompts(prompts, document, n)
        scenarios.append(Scenario(scenario_name(n, kind), n, kind, document.index, prefix_ids,
                                  ids, asked))
    return scenarios


def waves(scenario: Scenario, params: Any, warm_params: Any) -> list[Wave]:
    """How the scenario's requests reach the engine (``ARRIVALS``)."""
    ids = [(f"{scenario.name}-{k}", p) for k, p in enumerate(scenario.prompts)]
    if scenario.arrivals == "concurrent":
        return [Wave(ids, params)]
    if scenario.arrivals == "staggered":
        return [Wave(ids[:1], params), Wave(ids[1:], params, after="first_token")]
    if scenario.arrivals == "warmed":
        return [Wave([(f"{scenario.name}-warm", scenario.prefix_ids)], warm_params),
                Wave(ids, params, after="finished")]
    raise ValueError(f"arrivals {scenario.arrivals!r}; allowed: {', '.join(ARRIVALS)}")


# ----------------------------------------------------------------------------- summaries
@dataclass
class RequestRecord:
    index: int  # 0..N-1; the warm request is not recorded
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    correct: float


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def scenario_figures(scenario: Mapping[str, Any], records: Sequence[Mapping[str, Any]], *,
                     elapsed_s: float, prefill_tokens: int, steps: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """One scenario's figures from its requests' records and the engine's per-step counts
    (``steps``: preemptions, preempted_tokens, peak_running, mean_running, prefix_cache)."""
    prefix = len(scenario["prefix_ids"])
    own = sum(len(p) - prefix for p in scenario["prompts"])
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    output = sum(r["output_tokens"] for r in records)
    return {
        "scenario": scenario["name"], "requests": scenario["requests"],
        "arrivals": scenario["arrivals"], "prefix_tokens": prefix,
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "requests_with_cache_hit": sum(1 for r in records if r["cached_tokens"] > 0),
        # issue 40's target: every reader after the first finds the prefix cached
        "min_cached_after_first": min((r["cached_tokens"] for r in records
                                       if r["index"] > 0), default=None),
        "prefill_tokens": prefill_tokens,
        "prefix_computed": (prefill_tokens - own) / prefix if prefix else None,
        "ttft_mean": _mean(ttfts), "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_max": max(ttfts, default=None),
        "output_tokens": output, "elapsed_s": elapsed_s,
        "output_tok_s": output / elapsed_s if elapsed_s > 0 else None,
        "accuracy": _mean([r["correct"] for r in records]),
        **steps,
    }


KV_HELD_DERIVATION = (
    "kv_held_per_request: mean over engine steps with running > 0 of kv_cache_usage * "
    "kv_cache_memory_bytes / running (usage: blocks or pages running requests hold, a shared "
    "one once); peak_kv_held: max of kv_cache_usage * kv_cache_memory_bytes. kvcompress's "
    "usage is out of its page pool, which excludes its scoring reserve, so its figures are "
    "upper bounds")


def kv_held(busy: Sequence[Any], kv_bytes: int, per_token: int | None) -> dict[str, Any]:
    """KV memory held, from the steps with requests running (``busy``: samples with
    ``running`` and ``kv_cache_usage``). The pool's usage counts what running requests hold,
    a page (kvcompress, reference-counted) or block (vanilla, by its ref count) that several
    requests read once, so a shared prefix is divided among its readers: per request, the
    mean over steps of ``usage * kv_bytes / running``; and the peak of ``usage * kv_bytes``
    (cached entries no running request reads are free to both). Also in tokens of the
    model's dtype (all layers and KV heads) with ``per_token``."""
    per_request = _mean([s.kv_cache_usage * kv_bytes / s.running for s in busy])
    peak = max((s.kv_cache_usage for s in busy), default=0.0) * kv_bytes
    return {"kv_held_per_request": per_request, "peak_kv_held": peak,
            "kv_held_per_request_tokens": (per_request / per_token
                                           if per_request is not None and per_token else None)}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_vanilla`` of every scenario: each of RATIO_KEYS over vanilla's figure in the same
    pool and scenario (None without one)."""
    vanilla = {(row["pool"], s["scenario"]): s for row in rows
               if row["label"] == "vanilla" and row["ok"] for s in row["scenarios"]}
    for row in rows:
        for figures in row.get("scenarios") or ():
            base = vanilla.get((row["pool"], figures["scenario"]))
            figures["vs_vanilla"] = {
                key: (figures[key] / base[key] if base and figures.get(key) is not None
                      and base.get(key) else None) for key in RATIO_KEYS}


# shown once a result has KV held (results from before it keep their table)
KV_HELD_COLUMNS = ("kv_held_mb", "kv_held_per_request_x", "peak_kv_mb",
                   "cached_after_first")


def _mb(value: float | None) -> float | None:
    return value / 1e6 if value is not None else None


def render(rows: Sequence[Mapping[str, Any]]) -> str:
    table = []
    for row in rows:
        for s in row.get("scenarios") or ():
            ratios = s.get("vs_vanilla") or {}
            table.append({"pool": row["pool"], "config": row["label"], **s,
                          "kv_held_mb": _mb(s.get("kv_held_per_request")),
                          "cached_after_first": (
                              s["min_cached_after_first"] / s["prefix_tokens"]
                              if s.get("min_cached_after_first") is not None
                              and s.get("prefix_tokens") else None),
                          "peak_kv_mb": _mb(s.get("peak_kv_held")),
                          **{f"{key}_x": value for key, value in ratios.items()}})
    columns = [("pool", "pool"), ("config", "config"), ("scenario", "scenario"),
               ("prefix_computed", "prefix x computed"), ("cached_tokens", "cached tok"),
               ("prefill_tokens_x", "prefill x van"),
               ("cached_after_first", "min cached after 1st / prefix"),
               ("peak_running", "peak run"),
               ("preemptions", "preempt"), ("kv_held_mb", "KV MB/req"),
               ("kv_held_per_request_x", "x van"), ("peak_kv_mb", "peak KV MB"),
               ("ttft_mean", "TTFT s"),
               ("ttft_mean_x", "x van"), ("ttft_p50", "TTFT p50 s"), ("ttft_p50_x", "x van"),
               ("output_tok_s", "out tok/s"), ("output_tok_s_x", "x van"),
               ("accuracy", "right")]
    if not any(row.get("kv_held_per_request") is not None for row in table):
        # results from before KV held was measured keep their table
        columns = [c for c in columns if c[0] not in KV_HELD_COLUMNS]
    return format_table(table, columns)


# ----------------------------------------------------------------------------- worker side
def step_logger(sink: dict[str, int]) -> Any:
    """A vLLM stat logger factory summing, over steps, the prompt tokens computed (from
    vLLM's iteration details) and the scheduler's prefix-cache queries and hits."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepCounter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is not None and not details.is_dummy:
                # a decoding request schedules one token; the rest is prompt (or recompute)
                sink["prefill_tokens"] += (details.num_ctx_tokens + details.num_generation_tokens
                                           - details.num_generation_requests)
            stats = getattr(scheduler_stats, "prefix_cache_stats", None)
            if stats is not None:
                sink["prefix_cache_queries"] += stats.queries
                sink["prefix_cache_hits"] += stats.hits

        def log_engine_initialized(self) -> None:
            pass

    return StepCounter


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from benchmarks.engine import build_engine, run_waves, shutdown_engine
    from kvcompress.engine.stats import EngineStats, StepStatsRecorder

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    workload = json.loads(Path(job["workload_path"]).read_text())
    documents = {d["index"]: Document.from_json(d) for d in workload["documents"]}
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    special = sorted(set(tokenizer.all_special_ids))
    answer = workload["answer_tokens"]
    params = SamplingParams(max_tokens=answer, min_tokens=answer, temperature=0.0,
                            stop_token_ids=special)
    # The warm request decodes once so that its prompt is compressed: an entry that ended in
    # its prefill step is uncompressed, and nobody who would compress it adopts it.
    warm_params = SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0)
    sink = EngineStats()
    counts = {"prefill_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    engine = build_engine(settings, spec, iteration_details=True,
                          stat_loggers=[StepStatsRecorder.factory(sink), step_logger(counts)])
    results = []
    try:
        # one-time costs (kernel selection, allocations) out of the figures; its ids share
        # no prefix with a chat-templated prompt
        run_waves(engine, [Wave([("warmup", list(range(1000, 1064)))], SamplingParams(
            max_tokens=8, min_tokens=8, temperature=0.0))])
        done_requests = 0
        for scenario in workload["scenarios"]:
            sink.samples.clear()
            sink.preemptions = 0
            sink.preempted_tokens = None
            counts.update(dict.fromkeys(counts, 0))
            run = run_waves(engine, waves(Scenario(**scenario), params, warm_params))
            questions = documents[scenario["document"]].questions
            records = []
            for k, asked in enumerate(scenario["questions"]):
                request_id = f"{scenario['name']}-{k}"
                output = run.outputs[request_id]
                completion = output.outputs[0]
                records.append(asdict(RequestRecord(
                    k, len(output.prompt_token_ids or ()), int(output.num_cached_tokens or 0),
                    len(completion.token_ids), run.ttft_s.get(request_id),
                    score_answer(completion.text, questions[asked]))))
            busy = [s for s in sink.samples if s.running > 0]
            steps = {"preemptions": sink.preemptions, "preempted_tokens": sink.preempted_tokens,
                     "peak_running": max((s.running for s in sink.samples), default=0),
                     "mean_running": (sum(s.running for s in busy) / len(busy)
                                      if busy else 0.0),
                     "peak_kv_usage": max((s.kv_cache_usage for s in sink.samples),
                                          default=0.0),
                     **kv_held(busy, settings.kv_cache_memory_bytes,
                               job.get("kv_bytes_per_token")),
                     "prefix_cache_queries": counts["prefix_cache_queries"],
                     "prefix_cache_hits": counts["prefix_cache_hits"]}
            results.append({"figures": scenario_figures(
                scenario, records, elapsed_s=run.elapsed_s,
                prefill_tokens=counts["prefill_tokens"], steps=steps), "records": records})
            done_requests += scenario["requests"]
            reporter.progress(done_requests)
    finally:
        shutdown_engine(engine)
    return {"scenarios": results}


# ----------------------------------------------------------------------------- parent side
def pool_tokens(pools: Sequence[str], longest: int, largest_n: int,
                per_token: int | None = None) -> list[tuple[str, int]]:
    """(label, KV tokens) of every ``--kv-pools`` entry: a multiple of the longest request,
    ``all`` (every request of the largest N its own uncompressed copy), or bytes with a unit
    (``130M``: 130 MiB, as vLLM reads ``--kv-cache-memory-bytes``; ``per_token`` bytes a
    token, rounded down to whole tokens)."""
    out = []
    for pool in pools:
        if pool == ALL_POOL:
            out.append((ALL_POOL, largest_n * longest))
            continue
        if pool[-1:].isalpha():
            if not per_token:
                raise ValueError(f"KV pool {pool!r}: bytes need the KV bytes of a token")
            out.append((pool, parse_bytes(pool) // per_token))
            continue
        multiple = float(pool)
        if multiple < 1:
            raise ValueError(f"KV pool {pool!r}: at least one request (1)")
        out.append((f"{multiple:g}x", int(multiple * longest)))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="vanilla and kvcompress configurations (pyramidkv:r=0.75, "
                             "snapkv:r=0.75+scoring=window)")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=WORKLOADS, default="document",
                          help="document: the document and a question in one user message; "
                               "system-prompt: the document as the system prompt, a question "
                               "of --question-tokens each (issue 40's chats); each has its "
                               "own defaults for the options below left unset: " + "; ".join(
                                   f"{name}: " + ", ".join(f"{key}={value}"
                                                           for key, value in values.items())
                                   for name, values in WORKLOAD_DEFAULTS.items()))
    workload.add_argument("--quick", action="store_true",
                          help="a shorter run: " + ", ".join(f"{key}={value}" for key, value
                                                             in QUICK.items())
                               + " (flags given still win)")
    workload.add_argument("--requests", default=DEFAULT_REQUESTS,
                          help="readers of the prefix per scenario (N), comma-separated")
    workload.add_argument("--arrivals", default=DEFAULT_ARRIVALS,
                          help=f"comma-separated, of {', '.join(ARRIVALS)}")
    workload.add_argument("--doc-tokens", type=int, default=None,
                          help="the shared document's (system prompt's) tokens")
    workload.add_argument("--question-tokens", type=int, default=None,
                          help="system-prompt: each user message's tokens (filler + question)")
    workload.add_argument("--answer-tokens", type=int, default=None)
    workload.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine (identical for every configuration)")
    engine.add_argument("--kv-pools", default=None,
                        help="KV-cache sizes: multiples of the longest request (prompt + "
                             f"answer), '{ALL_POOL}' (every request its own copy), or bytes "
                             "as vLLM's --kv-cache-memory-bytes reads them (130M: 130 MiB)")
    add_engine_options(engine)
    # N = 128 readers must be able to run at once where memory allows
    parser.set_defaults(max_num_seqs=256)
    add_run_options(parser, RESULTS_DIR / "shared_prefix.json")
    return parser


def apply_workload_defaults(args: argparse.Namespace) -> None:
    """The options left unset take ``args.workload``'s defaults (WORKLOAD_DEFAULTS)."""
    for key, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    parser = build_parser()
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    apply_workload_defaults(args)
    started = time.perf_counter()
    try:
        specs = parse_specs(args.configs)
        requests = parse_ints(args.requests)
        arrivals = parse_names(args.arrivals, ARRIVALS, "arrivals")
        pools = [p.strip() for p in args.kv_pools.split(",") if p.strip()]
        options = parse_kv_options(args.kv_option)
        if not requests or min(requests) < 1 or not arrivals or not pools:
            raise ValueError("give at least one N >= 1, one arrival and one pool")
    except ValueError as error:
        raise SystemExit(f"arguments: {error}") from None

    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    count = token_counter(tokenizer)

    documents = make_documents(len(requests) * len(arrivals), args.doc_tokens, args.seed,
                               count)
    scenarios = make_scenarios(Prompts(tokenizer), documents, requests, arrivals,
                               workload=args.workload, question_tokens=args.question_tokens,
                               count=count, seed=args.seed)
    longest = max(len(p) for s in scenarios for p in s.prompts) + args.answer_tokens
    dtype = resolve_dtype(args.dtype, device)
    per_token = kv_bytes_per_token(model, dtype)
    try:
        sized = pool_tokens(pools, longest, max(requests), per_token)
    except ValueError as error:
        raise SystemExit(f"--kv-pools: {error}") from None
    base = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=0,
        seed=args.seed, compression_options=options,
        enable_prefix_caching=True)  # what it measures: requests that share a prefix
    threads = (args.threads or default_threads()) if device == "cpu" else None
    workdir = make_workdir("shared-prefix")
    workload_path = write_workload(workdir, {
        "documents": [asdict(d) for d in documents], "answer_tokens": args.answer_tokens,
        "scenarios": [asdict(s) for s in scenarios]})
    log_path = args.log_file or workdir / "vllm.log"
    header = {
        "benchmark": "shared_prefix",
        "command": command_string([sys.argv[0], *argv]),
        "commit": git_commit(),
        "machine": machine_info(device),
        "settings": {**vars(base), "kv_cache_memory_bytes": None, "threads": threads,
                     "kv_bytes_per_token": per_token,
                     "kv_pools": {label: tokens for label, tokens in sized}},
        "kv_held_derivation": KV_HELD_DERIVATION,
        "workload": {"kind": args.workload, "requests": requests, "arrivals": list(arrivals),
                     "doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
                     "answer_tokens": args.answer_tokens,
                     "seed": args.seed, "longest_request": longest,
                     "prefix_tokens": {s.name: len(s.prefix_ids) for s in scenarios}},
    }
    print(f"command: {header['command']}")
    print(f"KV pools (tokens): {header['settings']['kv_pools']}; longest request {longest}")
    print(f"configs: {', '.join(s.label for s in specs)}; vLLM logs: {log_path}", flush=True)
    jobs = [{"id": f"{label}/{spec.label}", "pool": label, "spec": vars(spec),
             "settings": {**vars(base), "kv_cache_memory_bytes": tokens * per_token},
             "kv_bytes_per_token": per_token,
             "isolate": True, "workload_path": str(workload_path)}
            for label, tokens in sized for spec in specs]
    units = float(sum(s.requests for s in scenarios))
    results = run_jobs(WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
                       units={job["id"]: units for job in jobs}, job_timeout=args.job_timeout,
                       env=worker_env(args.verbose, False, threads), desc="shared-prefix",
                       show_progress=not args.no_progress)
    rows = [config_row(job, results[job["id"]]) for job in jobs]
    add_ratios(rows)
    report = save_report(header, rows, started, args.output_json)
    print()
    print(render(rows))
    return conclude(report, str(args.output_json),
                    describe=lambda row: f"{row['pool']} {row['label']}")


def config_row(job: Mapping[str, Any], outcome: Any) -> dict[str, Any]:
    spec = CompressionSpec(**job["spec"])
    row: dict[str, Any] = {"pool": job["pool"], "label": spec.label, "spec": vars(spec),
                           "kv_cache_memory_bytes": job["settings"]["kv_cache_memory_bytes"],
                           "ok": outcome.error is None, "seconds": outcome.seconds}
    if outcome.error is not None:
        row["error"] = outcome.error
        return row
    row["scenarios"] = [s["figures"] for s in outcome.result["scenarios"]]
    row["records"] = {s["figures"]["scenario"]: s["records"]
                      for s in outcome.result["scenarios"]}
    return row


if __name__ == "__main__":
    sys.exit(main())
