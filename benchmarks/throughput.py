"""Offline throughput: the same prompts through vanilla vLLM and kvcompress, in one invocation.

Every configuration gets the same engine settings (KV-cache memory, max_num_seqs,
max_num_batched_tokens, max_model_len, dtype, eager/compiled) and the same prompts (token ids
made once, here), and runs in its own worker process, one after the other:

    python -m benchmarks.throughput                  # defaults: both workloads (CPU: ~11 min)
    python -m benchmarks.throughput --workload random                  # (CPU: ~5 min)
    python -m benchmarks.throughput --workload system-prompt           # (CPU: ~6 min)
    python -m benchmarks.throughput --configs vanilla,pyramidkv:r=0.875,snapkv:128 \\
        --num-prompts 64 --input-len 2048 --output-len 512 --kv-cache-tokens 40000
    python -m benchmarks.throughput --prompts-file prompts.jsonl     # {"prompt", "max_tokens"}
    python -m benchmarks.throughput --long-generation   # 256 in / 1024 out, decode eviction
    python -m benchmarks.throughput --tensor-parallel-size 2 --model .models/random-llama-kv4
    python -m benchmarks.throughput --no-prefix-caching   # leave vLLM's default (said in tables)

Configurations: ``vanilla``, ``METHOD:BUDGET`` (tokens kept per layer and KV head) or
``METHOD:r=RATIO`` (fraction of each prompt evicted: r=0.875 is 8x prompt compression), either
followed by ``@DECODE_POLICY:N`` to keep N generated tokens per KV head during decode
(``pyramidkv:256@h2o:256``).
``ignore_eos`` makes every configuration generate exactly the same number of tokens.

Prefix caching is on, as vLLM's default, for every configuration: a server's defaults, for
kvcompress its multi-turn reuse and the reconstruction pass of ``--kv-scoring auto``. The
synthetic prompts are random token ids, so no two share a prefix; the prefix cache is
emptied after the warm-up and before the prefill-only pass, which would otherwise find its
prompts cached. ``--no-prefix-caching`` turns it off (recorded, and said above the table).

Workloads (``--workload``, both by default, each with its own table and ratios to vanilla):
``random``, random token ids (``--num-prompts``, ``--input-len``, ``--output-len``,
``--kv-cache-tokens``); ``system-prompt``, issue 40's first target: ``--system-prompt-chats``
(32) chats sharing one system prompt of ``--system-prompt-tokens`` (1500: a document, the
template's head included ~1520 shared ids), each with its own user message of
``--question-tokens`` (270) and ``--output-len`` (128) tokens out, in
``--system-prompt-kv-memory`` (130 MiB) of KV; its configurations: vanilla and
``pyramidkv:r=0.875`` (``--system-prompt-configs``, or ``--configs`` when given). Its
prompts share a prefix, so vanilla's prefix cache serves it from the running requests'
blocks while kvcompress prefills each chat's copy (issue 40 is that gap). The headline and
``--sweep-kv-memory`` / ``--long-generation`` are the random workload's. Time on 2 busy
cores: the random workload 308 s (``throughput.json``), the system-prompt one 336 s
(2026-12-04: vanilla 55 s of generation, ``pyramidkv:r=0.875`` 110 s, each plus its
prefill-only pass and engine start).

Memory-bound by design: the KV cache holds only a few uncompressed requests
(``--kv-cache-tokens``) while ``--max-num-seqs`` is large, so the number of requests that run
together is set by KV memory, which compression frees.

KV tokens per running request: vLLM reports, per engine step, the fraction of the KV cache in
use (vanilla: blocks of ``block_size`` tokens; kvcompress: pages of one layer's KV head) and the
number of running requests. Both pools are sized from the same bytes, so capacity in tokens of
every layer and KV head is ``kv_cache_memory_bytes / (2 * layers * kv_heads * head_dim *
dtype_bytes)``, and ``usage * capacity / running`` is the average KV a running request holds,
in token-equivalents (all layers and heads). It includes partially filled blocks / pages and,
for kvcompress, prompts in prefill that are not compressed yet. We report its mean over steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks import memory_sweep
from benchmarks.documents import Prompts, make_documents, system_prompt_prompts
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
    machine_info,
    save_report,
    with_prefix_caching,
)
from benchmarks.specs import (
    DTYPE_BYTES,
    CompressionSpec,
    EngineSettings,
    add_prefix_caching_option,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_bytes,
    parse_kv_options,
    parse_names,
    parse_specs,
    resolve_dtype,
    token_counter,
)

WORKER_MODULE = "benchmarks.throughput"  # workers: python -m WORKER_MODULE --worker ...
DEFAULT_CONFIGS = "vanilla,pyramidkv:r=0.5,pyramidkv:r=0.75,pyramidkv:r=0.875"
# --long-generation: short prompts, long outputs (reasoning, agents), where the cache grows
# during decode. Prompts fit their budget whole; each KV head keeps 256 of the 1024 generated
# tokens (4x decode-time compression); the KV memory holds 4 uncompressed requests.
LONG_GENERATION = {
    "configs": "vanilla,pyramidkv:256@window:256,pyramidkv:256@h2o:256,"
               "pyramidkv:256@snapkv:256",
    "num_prompts": 16, "input_len": 256, "output_len": 1024, "kv_cache_tokens": 4 * 1280,
    "ample_memory_reference": True,
    "output_json": RESULTS_DIR / "throughput_long_generation.json",
}
# Workloads (--workload): random token ids (the memory-bound default), and issue 40's chats
# sharing a system prompt (benchmarks.documents.system_prompt_prompts): its own prompt count,
# lengths and KV memory, and by default vanilla and the 8x configuration only (2 cores: each
# kvcompress configuration of it takes about as long as the whole random workload's).
WORKLOADS = ("random", "system-prompt")
DEFAULT_WORKLOADS = "random,system-prompt"
SYSTEM_PROMPT_CONFIGS = "vanilla,pyramidkv:r=0.875"
# The reference row of --ample-memory-reference: vanilla, with memory for every request.
AMPLE_LABEL = "vanilla, KV for all"
RATIO_KEYS = ("output_tok_s", "total_tok_s", "peak_running", "mean_kv_tokens_per_running",
              "tokens_per_gib_used", "peak_tokens_per_gib_used", "peak_tokens_held")


# ----------------------------------------------------------------------------- prompts
def synthetic_prompts(num: int, input_len: int, output_len: int, seed: int,
                      vocab_size: int, special_ids: set[int]) -> list[dict[str, Any]]:
    """Random token ids (no special tokens), the same for every configuration."""
    rng = random.Random(seed)
    allowed = [i for i in range(vocab_size) if i not in special_ids]
    return [
        {"prompt_token_ids": [rng.choice(allowed) for _ in range(input_len)],
         "max_tokens": output_len}
        for _ in range(num)
    ]


def chat_prompts(num: int, system_tokens: int, question_tokens: int, output_len: int,
                 seed: int, tokenizer: Any) -> list[dict[str, Any]]:
    """``num`` chats sharing one system prompt of about ``system_tokens`` tokens (a
    document with facts), each with its own user message of about ``question_tokens``
    tokens, through the model's chat template; every prompt starts with the same ids."""
    count = token_counter(tokenizer)
    (document,) = make_documents(1, system_tokens, seed, count)
    _, ids, _ = system_prompt_prompts(Prompts(tokenizer), document, num, question_tokens,
                                      count, seed)
    return [{"prompt_token_ids": prompt, "max_tokens": output_len} for prompt in ids]


def file_prompts(path: Path, tokenizer: Any, default_max_tokens: int,
                 limit: int | None) -> list[dict[str, Any]]:
    """JSONL lines ``{"prompt": str, "max_tokens": int (optional)}``, tokenized once here."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise SystemExit(f"{path}:{number}: expected {{\"prompt\": ...}}: {error}") from None
        max_tokens = int(row.get("max_tokens", default_max_tokens))
        prompts.append({"prompt_token_ids": tokenizer.encode(text), "max_tokens": max_tokens})
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


# ----------------------------------------------------------------------------- metrics
def summarize(samples: list[dict[str, float]], *, elapsed: float, prompt_tokens: int,
              output_tokens: int, preemptions: int, capacity_tokens: int,
              preempted_tokens: int | None = None,
              held: list[dict[str, float]] | None = None,
              kv_cache_gib: float | None = None) -> dict[str, Any]:
    """Throughput and KV figures of one configuration from its per-step samples.

    ``held``: per step, the context tokens of the requests that have output tokens
    (``tokens``, uncompressed: prompt + generated), their number (``requests``), and the
    step's ``running`` and ``kv_cache_usage``; with ``kv_cache_gib`` they give the tokens
    held per GiB of KV memory in use (``HELD_DERIVATION``)."""
    busy = [s for s in samples if s["running"] > 0]
    per_request = [s["kv_cache_usage"] * capacity_tokens / s["running"] for s in busy]
    return {
        **held_figures(held or [], kv_cache_gib),
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed if elapsed > 0 else 0.0,
        "steps": len(samples),
        "peak_running": max((s["running"] for s in samples), default=0),
        "mean_running": sum(s["running"] for s in busy) / len(busy) if busy else 0.0,
        "preemptions": preemptions,
        "preempted_tokens": preempted_tokens,
        "peak_kv_usage": max((s["kv_cache_usage"] for s in samples), default=0.0),
        "mean_kv_tokens_per_running": sum(per_request) / len(per_request) if busy else 0.0,
    }


def held_figures(held: list[dict[str, float]], kv_cache_gib: float | None) -> dict[str, Any]:
    """Tokens held per GiB in use, over the steps where every request that has started
    answering is running (none preempted, none in a prefill chunk before its first token),
    and the most context tokens held at once."""
    per_gib = [h["tokens"] / (h["kv_cache_usage"] * kv_cache_gib) for h in held
               if kv_cache_gib and h["requests"] == h["running"] > 0 and h["kv_cache_usage"] > 0]
    return {
        "peak_tokens_held": max((h["tokens"] for h in held), default=None),
        "tokens_per_gib_used": sum(per_gib) / len(per_gib) if per_gib else None,
        "peak_tokens_per_gib_used": max(per_gib, default=None),
        "held_steps": len(per_gib),
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_vanilla``: each figure of RATIO_KEYS over vanilla's (None without a vanilla run).

    ``of_ample_memory``: output tok/s over that of the --ample-memory-reference row.
    ``cap``: with the prefill-only time of the same prompts in the same engine, the output
    tok/s if decoding cost nothing (``output_tok_s``), that as a ratio to vanilla
    (``x_vanilla``), and the share of it reached (``reached``).
    """
    base = next((r for r in rows if r["label"] == "vanilla" and r.get("ok")), None)
    ample = next((r for r in rows if r["label"] == AMPLE_LABEL and r.get("ok")), None)
    for row in rows:
        if ample and row.get("ok"):  # the share of what memory for all would give vanilla
            row["of_ample_memory"] = row["output_tok_s"] / ample["output_tok_s"]
        ratios = {}
        for key in RATIO_KEYS:
            value, ref = row.get(key), (base or {}).get(key)
            ratios[key] = value / ref if row.get("ok") and value is not None and ref else None
        row["vs_vanilla"] = ratios
        prefill_only = row.get("prefill_only_s")
        if not row.get("ok") or not prefill_only:
            row["cap"] = None
            continue
        cap = row["output_tokens"] / prefill_only
        row["cap"] = {
            "output_tok_s": cap,
            "x_vanilla": cap / base["output_tok_s"] if base else None,
            "reached": row["output_tok_s"] / cap,
        }


# ----------------------------------------------------------------------------- worker side
def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from vllm import SamplingParams

    from benchmarks.engine import build_engine, clear_prefix_cache, generate, shutdown_engine
    from kvcompress.engine.stats import EngineStats, StepStatsRecorder

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    prompts = json.loads(Path(job["prompts_path"]).read_text())
    sink = EngineStats()
    engine = build_engine(settings, spec, stat_loggers=[StepStatsRecorder.factory(sink)])
    try:
        params = [SamplingParams(max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True)
                  for p in prompts]
        if job["warmup"]:  # first steps pay one-time costs (kernel selection, allocations)
            warm = prompts[0]["prompt_token_ids"][:64]
            generate(engine, [warm], [SamplingParams(max_tokens=8, ignore_eos=True)])
            clear_prefix_cache(engine)  # else prompt 0 would start from the warm-up's cache
        sink.samples.clear()
        sink.preemptions = sink.generated_tokens = sink.prompt_tokens = 0
        sink.preempted_tokens = None
        sink.score_seconds = sink.compaction_seconds = 0.0
        last = [0.0]

        def on_step(_finished: int, _generated: int) -> None:
            now = time.monotonic()
            if now - last[0] > 1.0:
                last[0] = now
                reporter.progress(sink.generated_tokens)

        contexts: dict[str, int] = {}  # request -> prompt + generated tokens, until it ends
        held: list[dict[str, float]] = []

        def on_outputs(step_outputs: Any) -> None:
            for output in step_outputs:
                if output.finished:
                    contexts.pop(output.request_id, None)
                else:
                    contexts[output.request_id] = (len(output.prompt_token_ids or ())
                                                   + len(output.outputs[0].token_ids))
            if sink.samples:  # the step's own sample: its logger ran inside engine.step()
                latest = sink.samples[-1]
                held.append({"tokens": sum(contexts.values()), "requests": len(contexts),
                             "running": latest.running,
                             "kv_cache_usage": latest.kv_cache_usage})

        outputs, elapsed = generate(engine, [p["prompt_token_ids"] for p in prompts], params,
                                    on_step, on_outputs)
        spent = sink.score_seconds, sink.compaction_seconds  # before the cap pass adds more
        prefill_only = None
        if job.get("measure_cap"):  # the same prompts again, one token each: prefill alone
            clear_prefix_cache(engine)  # each prompt computed, not found cached
            firsts = [SamplingParams(max_tokens=1, temperature=0.0) for _ in prompts]
            _, prefill_only = generate(engine, [p["prompt_token_ids"] for p in prompts], firsts)
    finally:
        shutdown_engine(engine)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    result = summarize(
        [vars(s) for s in sink.samples],
        elapsed=elapsed,
        prompt_tokens=sum(o.prompt_len for o in outputs),
        output_tokens=output_tokens,
        preemptions=sink.preemptions,
        capacity_tokens=job["capacity_tokens"],
        preempted_tokens=sink.preempted_tokens,
        held=held,
        kv_cache_gib=settings.kv_cache_memory_bytes * settings.tensor_parallel_size / 2**30,
    )
    # what the workers report spending on scores and compaction, as a share of the run
    result["score_s"], result["compaction_s"] = spent
    result["score_share"] = spent[0] / elapsed if elapsed > 0 else None
    result["prefill_only_s"] = prefill_only
    # prompt tokens the prefix cache served (vLLM's num_cached_tokens), and the fewest any
    # request but the first found (issue 40: every chat after the first finds the system
    # prompt cached)
    result["cached_tokens"] = sum(o.cached_tokens for o in outputs)
    result["min_cached_after_first"] = min((o.cached_tokens for o in outputs[1:]),
                                           default=None)
    result["all_outputs_full_length"] = all(
        len(o.token_ids) == p["max_tokens"] for o, p in zip(outputs, prompts)
    )
    return result


# ----------------------------------------------------------------------------- parent side
def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated: vanilla, METHOD:BUDGET, METHOD:r=RATIO")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--long-generation", action="store_true",
                          help="defaults for long outputs: "
                          + ", ".join(f"{key}={value}" for key, value in LONG_GENERATION.items()
                                      if key != "output_json")
                          + " (flags given still win)")
    workload.add_argument("--sweep-kv-memory", action="store_true",
                          help="run every configuration at several KV-cache sizes (see "
                          "--sweep-points) and plot throughput, peak running requests and "
                          "preemptions against memory; defaults: " + ", ".join(
                              f"{key}={value}" for key, value in
                              memory_sweep.SWEEP_DEFAULTS.items() if key != "output_json"))
    workload.add_argument("--sweep-points", default=memory_sweep.DEFAULT_MULTIPLES,
                          help="with --sweep-kv-memory: KV-cache sizes in multiples of the "
                          "longest request (prompt + output), comma-separated, >= 1")
    workload.add_argument("--workload", default=DEFAULT_WORKLOADS,
                          help=f"comma-separated, of {', '.join(WORKLOADS)}: random token ids "
                               "(--num-prompts, --input-len), and chats sharing one system "
                               "prompt (--system-prompt-*), each run with its own KV memory "
                               "and its own ratios to vanilla; --prompts-file, "
                               "--long-generation and --sweep-kv-memory run one workload")
    workload.add_argument("--num-prompts", type=int, default=24)
    workload.add_argument("--input-len", type=int, default=1024, help="synthetic prompt tokens")
    workload.add_argument("--output-len", type=int, default=128,
                          help="tokens generated per prompt (default for --prompts-file too)")
    workload.add_argument("--prompts-file", type=Path, default=None,
                          help='JSONL of {"prompt": str, "max_tokens": int}; replaces synthetic')
    workload.add_argument("--seed", type=int, default=0)
    chats = parser.add_argument_group(
        "system-prompt workload (issue 40's first target: 32 chats, 128 tokens out)")
    chats.add_argument("--system-prompt-chats", type=int, default=32)
    chats.add_argument("--system-prompt-tokens", type=int, default=1500,
                       help="the shared system prompt (a document)")
    chats.add_argument("--question-tokens", type=int, default=270,
                       help="each chat's own user message")
    chats.add_argument("--system-prompt-kv-memory", default="130M",
                       help="its KV-cache bytes, as vLLM's --kv-cache-memory-bytes reads them "
                            "(130M: 130 MiB), split over tensor-parallel ranks")
    chats.add_argument("--system-prompt-configs", default=None,
                       help=f"its configurations (default: {SYSTEM_PROMPT_CONFIGS}, or "
                            "--configs when given)")
    engine = parser.add_argument_group("engine (identical for every configuration)")
    engine.add_argument("--kv-cache-tokens", type=int, default=3456,
                        help="KV-cache size in uncompressed tokens (all layers and heads), "
                        "converted to bytes for the dtype; the default holds 3 default requests")
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV-cache bytes; overrides --kv-cache-tokens")
    engine.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks per engine; --kv-cache-tokens is then split over the "
                             "ranks (each holds its KV heads' share); on CPU one core each")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="default: longest prompt + its output")
    engine.add_argument("--dtype", default="auto",
                        help="auto = bfloat16, or float32 on CPUs without native bf16")
    engine.add_argument("--compile", action="store_true",
                        help="torch.compile / CUDA graphs (default: enforce_eager)")
    engine.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the in-process engine (default: cores - 1)")
    engine.add_argument("--multiprocess-engine", action="store_true",
                        help="vLLM's engine-core and worker processes (default: in-process)")
    engine.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra kvcompress setting for compressed runs, e.g. kv_window=16")
    add_prefix_caching_option(engine)
    run = parser.add_argument_group("run")
    run.add_argument("--no-warmup", dest="warmup", action="store_false")
    run.add_argument("--ample-memory-reference", action="store_true",
                     help="also run vanilla with KV memory for every request at full length "
                     "(what memory alone can buy; on by default with --long-generation)")
    run.add_argument("--no-cap", dest="measure_cap", action="store_false",
                     help="skip the prefill-only pass that gives each configuration its cap "
                     "(output tok/s if decoding were free)")
    run.add_argument("--job-timeout", type=float, default=1800.0,
                     help="seconds before a configuration is killed")
    run.add_argument("--output-json", type=Path, default=RESULTS_DIR / "throughput.json")
    run.add_argument("--log-file", type=Path, default=None,
                     help="vLLM logs (default: a temporary folder)")
    run.add_argument("--verbose", action="store_true", help="INFO-level vLLM logs in the log")
    run.add_argument("--no-progress", action="store_true")
    return parser


def make_prompts(args: argparse.Namespace, model: str,
                 workload: str = "random") -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.prompts_file is not None:
        return file_prompts(args.prompts_file, tokenizer, args.output_len, args.num_prompts)
    if workload == "system-prompt":
        return chat_prompts(args.system_prompt_chats, args.system_prompt_tokens,
                            args.question_tokens, args.output_len, args.seed, tokenizer)
    return synthetic_prompts(args.num_prompts, args.input_len, args.output_len, args.seed,
                             len(tokenizer), set(tokenizer.all_special_ids))


def selected_workloads(args: argparse.Namespace) -> list[str]:
    """The workloads this run measures, in order (the first is the headline's)."""
    if args.prompts_file is not None:
        return ["random"]  # the file replaces the synthetic prompts: one workload
    names = parse_names(args.workload, WORKLOADS, "workload")
    if not names:
        raise ValueError("no workload")
    if len(names) > 1 and (args.sweep_kv_memory or args.long_generation):
        raise ValueError("--sweep-kv-memory and --long-generation run one workload")
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    parser = build_parser()
    if "--long-generation" in argv:
        parser.set_defaults(**LONG_GENERATION, workload="random")
    if "--sweep-kv-memory" in argv:
        parser.set_defaults(**memory_sweep.SWEEP_DEFAULTS, workload="random")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        workloads = selected_workloads(args)
        specs = parse_specs(args.configs)
        chat_specs = parse_specs(args.system_prompt_configs or (
            args.configs if args.configs != DEFAULT_CONFIGS else SYSTEM_PROMPT_CONFIGS))
        chat_bytes = parse_bytes(args.system_prompt_kv_memory)
    except ValueError as error:
        raise SystemExit(f"arguments: {error}") from None
    device = detect_device()
    model = args.model or default_model_dir()
    workdir = make_workdir("throughput")
    log_path = args.log_file or workdir / "vllm.log"
    header: dict[str, Any] = {
        "benchmark": "throughput",
        "command": command_string([sys.argv[0], *argv]),
        "machine": machine_info(device),
        "kv_tokens_per_request_derivation": KV_DERIVATION,
        "tokens_held_derivation": HELD_DERIVATION,
    }
    print(f"command: {header['command']}")
    jobs: list[dict[str, Any]] = []
    job_pools: list[int] = []  # each job's pool in uncompressed model-dtype tokens
    job_workloads: list[str] = []
    threads = ranks = None
    for index, name in enumerate(workloads):
        prompts = make_prompts(args, model, name)
        kv_bytes = chat_bytes if name == "system-prompt" else None
        settings, per_token = build_settings(args, model, device, prompts, kv_bytes)
        capacity = settings.kv_cache_memory_bytes * settings.tensor_parallel_size // per_token
        # Tensor parallelism: vLLM binds each rank's threads (VLLM_CPU_OMP_THREADS_BIND).
        one_cpu_engine = device == "cpu" and settings.tensor_parallel_size == 1
        threads = (args.threads or default_threads()) if one_cpu_engine else None
        ranks = settings.tensor_parallel_size if device == "cpu" else 1
        prompts_path = write_workload(workdir, prompts, f"prompts-{name}.json")
        workload = describe_workload(args, prompts, name)
        run_settings = {**vars(settings), "kv_cache_capacity_tokens": capacity,
                        "threads": threads, "kv_bytes_per_token": per_token,
                        "warmup": args.warmup}
        if index == 0:  # the first workload's, where every run before workloads had them
            header["settings"], header["workload"] = run_settings, workload
        header.setdefault("workloads", {})[name] = {"settings": run_settings,
                                                    "workload": workload}
        specs_here = chat_specs if name == "system-prompt" else specs
        print(f"{name}: settings: {json.dumps(run_settings)}")
        print(f"{name}: workload: {json.dumps(workload)}")
        print(f"{name}: configs: {', '.join(s.label for s in specs_here)}", flush=True)
        added = workload_jobs(args, name if index else None, specs_here, settings, per_token,
                              prompts, str(prompts_path))
        jobs.extend(job for job, _ in added)
        job_pools.extend(tokens for _, tokens in added)
        job_workloads.extend(name for _ in added)
    print(f"vLLM logs: {log_path}", flush=True)
    results = run_jobs(
        WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: job["output_tokens"] for job in jobs}, job_timeout=args.job_timeout,
        env=worker_env(args.verbose, args.multiprocess_engine, threads, ranks=ranks or 1),
        desc="throughput",
        show_progress=not args.no_progress,
    )
    rows = [{**config_row(CompressionSpec(**job["spec"]), results[job["id"]]),
             "kv_cache_tokens": tokens, "kv_cache_capacity_tokens": job["capacity_tokens"]}
            for job, tokens in zip(jobs, job_pools)]
    for row, job, name in zip(rows, jobs, job_workloads):
        if job.get("ample"):
            row["label"] = AMPLE_LABEL
        if len(workloads) > 1:
            row["workload"] = name
    for group in ratio_groups(rows, args.sweep_kv_memory, len(specs)):
        add_ratios(group)
    report = save_report(header, rows, started, args.output_json)
    print()
    if args.sweep_kv_memory:
        png = args.output_json.with_suffix(".png")
        workload = header["workload"]
        memory_sweep.plot(rows, png, f"{Path(model).name}: {workload['num_prompts']} prompts, "
                          f"{workload['input_len']} in / {workload['output_len']} out")
        print(memory_sweep.render_report(report))
        print(f"plot: {png}")
    else:
        print(render_report(report))
        print(f"KV tok/req = {header['kv_tokens_per_request_derivation']}")
    return conclude(report, str(args.output_json))


def workload_jobs(args: argparse.Namespace, prefix: str | None,
                  specs: list[CompressionSpec], settings: EngineSettings, per_token: int,
                  prompts: list[dict[str, Any]], prompts_path: str
                  ) -> list[tuple[dict[str, Any], int]]:
    """One workload's jobs, each with its pool in uncompressed model-dtype tokens; job ids
    ``PREFIX/LABEL`` (just the label for the first workload, as before workloads)."""
    capacity = settings.kv_cache_memory_bytes * settings.tensor_parallel_size // per_token
    output_tokens = sum(p["max_tokens"] for p in prompts)
    pools = [capacity]
    if args.sweep_kv_memory:
        longest = max(len(p["prompt_token_ids"]) + p["max_tokens"] for p in prompts)
        pools = memory_sweep.pool_tokens(memory_sweep.parse_multiples(args.sweep_points),
                                         longest)
        print(f"KV-cache pools (uncompressed tokens): {pools}", flush=True)
    out = []
    for tokens in pools:
        pool_settings = settings
        if args.sweep_kv_memory:
            pool_settings = dataclasses.replace(
                settings, kv_cache_memory_bytes=tokens * per_token // settings.tensor_parallel_size)
        for spec in specs:
            label = (memory_sweep.job_id(tokens, spec.label) if args.sweep_kv_memory
                     else spec.label)
            out.append(({
                "id": f"{prefix}/{label}" if prefix else label,
                "spec": vars(spec), "settings": vars(pool_settings), "isolate": True,
                "prompts_path": prompts_path, "output_tokens": output_tokens,
                "capacity_tokens": tokens * DTYPE_BYTES[settings.dtype]
                // spec.kv_element_bytes(settings.dtype),
                "warmup": args.warmup, "measure_cap": args.measure_cap}, tokens))
    if args.ample_memory_reference and not args.sweep_kv_memory:
        ample = sum(len(p["prompt_token_ids"]) + p["max_tokens"] for p in prompts)
        first = out[0][0]
        # its cap (prefill-only pass) would be vanilla's again: not measured
        out.append(({**first, "id": f"{prefix}/{AMPLE_LABEL}" if prefix else AMPLE_LABEL,
                     "spec": vars(CompressionSpec()), "measure_cap": False, "ample": True,
                     "settings": vars(dataclasses.replace(
                         settings, kv_cache_memory_bytes=ample * per_token
                         // settings.tensor_parallel_size)),
                     "capacity_tokens": ample}, ample))
    return out


def ratio_groups(rows: list[dict[str, Any]], sweep: bool,
                 num_specs: int) -> list[list[dict[str, Any]]]:
    """The rows compared with one vanilla: each workload's; in a sweep, each pool's."""
    if sweep:
        return [rows[first: first + num_specs] for first in range(0, len(rows), num_specs)]
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get("workload"), []).append(row)
    return list(groups.values())


HELD_DERIVATION = (
    "tokens_per_gib_used: mean over engine steps where every request that has output tokens "
    "is running (none preempted) and no other runs (none in prefill before its first token) "
    "of context tokens held (prompt + generated, uncompressed) / (kv_cache_usage * KV-cache "
    "GiB); peak_tokens_per_gib_used: its maximum; peak_tokens_held: most context tokens of "
    "requests with output tokens at once. Usage counts pages in use out of the pool, which "
    "for kvcompress excludes its scoring reserve, so its figure is a lower bound"
)
KV_DERIVATION = (
    "mean over engine steps with running > 0 of kv_cache_usage * capacity_tokens / running, "
    "capacity_tokens = kv_cache_memory_bytes / kv_bytes_per_token (all layers and KV heads of "
    "one token); usage counts allocated vLLM blocks (vanilla) or per-head pages (kvcompress), "
    "prompts in prefill uncompressed"
)


def build_settings(args: argparse.Namespace, model: str, device: str,
                   prompts: list[dict[str, Any]], kv_bytes: int | None = None
                   ) -> tuple[EngineSettings, int]:
    """The engine settings every configuration shares, and the KV bytes of one token;
    ``kv_bytes``: the KV-cache bytes of every rank together (default: the options')."""
    dtype = resolve_dtype(args.dtype, device)
    longest = max(len(p["prompt_token_ids"]) + p["max_tokens"] for p in prompts)
    per_token = kv_bytes_per_token(model, dtype)
    tp = args.tensor_parallel_size
    if tp < 1:
        raise SystemExit(f"--tensor-parallel-size must be >= 1, got {tp}")
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=args.max_model_len or longest,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        # vLLM's KV-cache memory is per rank: each rank holds 1/tp of every token's KV.
        kv_cache_memory_bytes=(kv_bytes // tp if kv_bytes else args.kv_cache_memory_bytes
                               or args.kv_cache_tokens * per_token // tp),
        enforce_eager=not args.compile, seed=args.seed, multiprocess=args.multiprocess_engine,
        tensor_parallel_size=tp,
        compression_options=parse_kv_options(args.kv_option),
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return settings, per_token


def describe_workload(args: argparse.Namespace, prompts: list[dict[str, Any]],
                      workload: str = "random") -> dict:
    if workload == "system-prompt":
        return {
            "source": "chats sharing a system prompt (benchmarks.documents."
                      "system_prompt_prompts)",
            "num_prompts": len(prompts), "system_prompt_tokens": args.system_prompt_tokens,
            "question_tokens": args.question_tokens, "output_len": args.output_len,
            "shared_prefix_tokens": shared_prefix_length(prompts),
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
            "output_tokens": sum(p["max_tokens"] for p in prompts),
            "seed": args.seed,
        }
    return {
        "source": str(args.prompts_file) if args.prompts_file else "synthetic random token ids",
        "num_prompts": len(prompts),
        "input_len": None if args.prompts_file else args.input_len,
        "output_len": None if args.prompts_file else args.output_len,
        "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "output_tokens": sum(p["max_tokens"] for p in prompts),
        "seed": args.seed,
    }


def shared_prefix_length(prompts: list[dict[str, Any]]) -> int:
    """How many leading token ids every prompt has in common."""
    ids = [p["prompt_token_ids"] for p in prompts]
    length = 0
    while all(len(p) > length and p[length] == ids[0][length] for p in ids):
        length += 1
    return length


def config_row(spec: CompressionSpec, outcome: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "label": spec.label, "method": spec.method, "budget": spec.budget, "ratio": spec.ratio,
        "prompt_compression": spec.compression_factor, "ok": outcome.error is None,
        "error": outcome.error, "job_seconds": outcome.seconds,
    }
    row.update(outcome.result or {})
    return row


def render_report(report: Mapping[str, Any]) -> str:
    """A run's table, headed by a line when it ran with prefix caching off (every run
    before the setting was recorded did); a table per workload where it ran several."""
    rows = report["configs"]
    names = list(dict.fromkeys(row.get("workload") for row in rows))
    if len(names) <= 1:
        return with_prefix_caching(render(rows), report.get("settings") or {})
    workloads = report.get("workloads") or {}
    parts = []
    for name in names:
        described = workloads.get(name) or {}
        parts.append(f"Workload {name}{workload_line(described)}:\n\n" + with_prefix_caching(
            render([row for row in rows if row.get("workload") == name]),
            described.get("settings") or report.get("settings") or {}))
    return "\n\n".join(parts)


def workload_line(described: Mapping[str, Any]) -> str:
    """`` (24 prompts, 1024 in / 128 out, 80 MB of KV)``, from a run's ``workloads`` entry."""
    workload, settings = described.get("workload") or {}, described.get("settings") or {}
    if not workload:
        return ""
    if "system_prompt_tokens" in workload:
        shape = (f"{workload['num_prompts']} chats, a {workload['shared_prefix_tokens']}-token "
                 f"shared prefix + ~{workload['question_tokens']} tokens each, "
                 f"{workload['output_len']} out")
    else:
        shape = (f"{workload['num_prompts']} prompts, {workload.get('input_len')} in / "
                 f"{workload.get('output_len')} out")
    kv_bytes = settings.get("kv_cache_memory_bytes")
    tp = settings.get("tensor_parallel_size") or 1
    memory = f", {kv_bytes * tp / 1e6:.0f} MB of KV" if kv_bytes else ""
    return f" ({shape}{memory})"


def render(rows: list[dict[str, Any]]) -> str:
    table_rows = []
    for row in rows:
        ratios = row.get("vs_vanilla") or {}
        table_rows.append({
            **row,
            "out_x": ratios.get("output_tok_s"),
            "total_x": ratios.get("total_tok_s"),
            "peak_x": ratios.get("peak_running"),
            "kv_x": ratios.get("mean_kv_tokens_per_running"),
            "gib_x": ratios.get("tokens_per_gib_used"),
            "cap_x": (row.get("cap") or {}).get("x_vanilla"),
            "cap_reached": (row.get("cap") or {}).get("reached"),
        })
    columns = [
        ("label", "config"), ("output_tok_s", "out tok/s"), ("out_x", "x van"),
        ("total_tok_s", "total tok/s"), ("total_x", "x van"), ("peak_running", "peak run"),
        ("peak_x", "x van"), ("mean_running", "mean run"), ("preemptions", "preempt"),
        ("preempted_tokens", "preempt tok"),
        ("mean_kv_tokens_per_running", "KV tok/req"), ("kv_x", "x van"),
        ("tokens_per_gib_used", "tok/GiB"), ("gib_x", "x van"),
        ("score_share", "scoring"),
        ("cap_x", "cap x van"), ("cap_reached", "of cap"),
        ("of_ample_memory", "of ample mem"), ("elapsed_s", "time s"),
    ]
    return format_table(table_rows, columns)


if __name__ == "__main__":
    sys.exit(main())
