"""Long-context quality: RULER-style synthetic tasks, full cache vs every compression method.

Tasks are generated (quality/tasks.py) from a seed (no data sets, no downloads) at token lengths
inside the model's context, run greedily through vLLM for the full cache (vanilla vLLM) and for
each method at each budget, and scored by string match against the known answers:

    passkey            the classic pass key in filler text, asked at the very end
    niah_single        one "special magic number" hidden in filler text
    niah_multikey      the same, among distractor needles with other keys
    niah_multivalue    one key with several values: all must be recalled
    variable_tracking  VAR X = 12345, VAR Y = VAR X, ...: name every variable holding the value
    common_words       a long numbered word list: name the most frequent words
    qa                 questions on one of many short synthetic biographies

    python -m benchmarks.quality --threads 2                       # default profile, see below
    python -m benchmarks.quality --tasks all --lengths 1024,2048 --samples 10 \
        --budgets 64,128,256,512,2048
    python -m benchmarks.quality --configs snapkv:64,pyramidkv:64+pyramid_beta=4+window=16
    python -m benchmarks.quality --question-position both --methods pyramidkv,snapkv \
        --scorings window,hybrid

The default profile is sized for statistical power at the budgets that matter on a small CPU:
the retrieval-style tasks the embedded model solves with its full cache (passkey, single and
multi-key needles, QA; not multi-value, variable tracking or common words, which it mostly
fails even uncompressed) at 320 tokens, 30 prompts each, so every cell has 120 prompts, at
budgets 64 and 128 (20% and 40% of the prompt). Each cell is reported with its 95% Wilson
interval, and every configuration with its paired difference to the full cache and to SnapKV
at the same budget over the same prompts (a 95% normal interval on the per-prompt differences),
which separates a 10-point difference when at most about a quarter of the prompts disagree.

Reported per configuration: accuracy per task (mean over samples and lengths), the fraction of
the full cache's accuracy retained, and fidelity: how much of the full cache's greedy output
the configuration reproduces token for token (common prefix / full-cache output length).
A budget at or above every prompt length evicts nothing; such configurations are not run and
are reported as the full cache (marked ``not_run``).

Where the question is when the cache is compressed (``--question-position``, question.py):
``inside`` (the default) compresses each prompt with its question at the end, so the window's
queries are the question's; ``outside`` is kvpress's default evaluation: the context alone is
compressed (request 1), then the question is asked from the compressed cache (request 2, the
same tokens, adopting request 1's cache through the prefix cache; every adoption is checked
and misses are reported); ``both`` runs each configuration both ways and reports them side by
side with their paired difference. Every engine runs vLLM's default, prefix caching on, as a
server does, so ``--kv-scoring auto`` resolves to hybrid in both modes; ``--no-prefix-caching``
runs the question-inside mode without it (``auto``: the window, each prompt alone; recorded
and said above the table; the outside mode needs it). ``--scorings`` runs the grid with
explicit scorings (method x budget x scoring).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.jobs import (
    Reporter,
    make_workdir,
    run_jobs,
    worker_env,
    worker_main,
    write_workload,
)
from benchmarks.quality.question import (
    CHOICES,
    add_vs_inside,
    adoption,
    adoption_problems,
    compressible,
    positions,
    question_split,
    resolved_scoring,
    run_outside,
)
from benchmarks.quality.report import plot, plot_title, render_run, replot
from benchmarks.quality.scoring import collect_rows, evicts_nothing, mean
from benchmarks.quality.tasks import TASKS, Sample, make_samples
from benchmarks.report import RESULTS_DIR, command_string, machine_info, write_json
from benchmarks.specs import (
    CompressionSpec,
    EngineSettings,
    add_prefix_caching_option,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    model_shape,
    parse_ints,
    parse_kv_options,
    parse_names,
    parse_specs,
    resolve_dtype,
    token_counter,
)
from kvcompress.policies import METHODS
from kvcompress.settings.flags import SCORINGS

# The default profile's tasks: those the embedded model solves with its full cache.
DEFAULT_TASKS = ("passkey", "niah_single", "niah_multikey", "qa")
WORKER_MODULE = "benchmarks.quality"  # workers: python -m WORKER_MODULE --worker ...


# ----------------------------------------------------------------------------- worker side
def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from vllm import SamplingParams

    from benchmarks.engine import (
        build_engine,
        compression_figures_logger,
        generate,
        prompt_kept_fraction,
        shutdown_engine,
    )

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    prompts = json.loads(Path(job["prompts_path"]).read_text())
    outside = job.get("question") == "outside"
    figures: dict[str, int] = {}
    # Question outside: its settings have prefix caching on (reuse adopts the context's cache).
    engine = build_engine(settings, spec,
                          stat_loggers=[compression_figures_logger(figures)] if outside else None)
    extra: dict[str, Any] = {}
    try:
        params = [SamplingParams(max_tokens=p["max_tokens"], temperature=0.0) for p in prompts]
        started = time.perf_counter()
        if outside:
            outputs, extra = run_outside(engine, prompts, params, figures, reporter.progress)
            elapsed = extra["context_s"] + extra["question_s"]
        else:
            outputs, elapsed = generate(
                engine, [p["prompt_token_ids"] for p in prompts], params,
                lambda finished, _tokens: reporter.progress(finished),
            )
        if not spec.is_vanilla:
            extra["measured_kept_fraction"] = prompt_kept_fraction(engine)
    finally:
        shutdown_engine(engine)
    return {
        "outputs": [{"text": o.text, "token_ids": o.token_ids} for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "generate_s": elapsed,
        "engine_s": time.perf_counter() - started,
        **extra,
    }


# ----------------------------------------------------------------------------- parent side
def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help=f"comma-separated task names, or all: {', '.join(TASKS)}")
    parser.add_argument("--lengths", default="320",
                        help="prompt lengths in tokens (each prompt is at most this long)")
    parser.add_argument("--samples", type=int, default=30, help="samples per task and length")
    parser.add_argument("--methods", default=",".join(METHODS))
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budgets", default="64,128",
                        help="tokens kept per layer and KV head (window included)")
    budget.add_argument("--ratios", default=None,
                        help="fractions of each prompt evicted instead of budgets, e.g. 0.875")
    parser.add_argument("--configs", default=None,
                        help="explicit configurations instead of --methods x --budgets: "
                             "METHOD:BUDGET or METHOD:r=RATIO, each with its own +KEY=VALUE "
                             "settings, e.g. pyramidkv:64,pyramidkv:64+pyramid_beta=4")
    parser.add_argument("--scorings", default="",
                        help="explicit scorings for the grid (method x budget x scoring), e.g. "
                             f"window,hybrid; one of {', '.join(SCORINGS)} each (default: none "
                             "given, the engine's --kv-scoring auto)")
    parser.add_argument("--question-position", choices=CHOICES, default="inside",
                        help="compress each prompt with its question (inside), the context "
                             "alone and ask the question from its compressed cache "
                             "(outside, kvpress's default), or both, side by side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="auto = bfloat16, or float32 on CPUs without native bf16")
    parser.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra kvcompress setting, e.g. kv_window=16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the engine (default: cores - 1)")
    parser.add_argument("--compile", action="store_true", help="no enforce_eager")
    add_prefix_caching_option(parser)
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--output-json", type=Path, default=RESULTS_DIR / "quality.json")
    parser.add_argument("--plot", type=Path, default=RESULTS_DIR / "quality.png")
    parser.add_argument("--log-file", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="redraw the table and --plot from a saved JSON, no engine")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the generated prompts' statistics and one example, no engine")
    return parser


def make_specs(methods: Sequence[str], budgets: Sequence[int] | None,
               ratios: Sequence[float] | None,
               scorings: Sequence[str] = ()) -> list[CompressionSpec]:
    """method x budget (or ratio) x scoring; no scorings: the engine's default scoring."""
    options = [(("kv_scoring", scoring),) for scoring in scorings] or [()]
    if ratios:
        return [CompressionSpec(m, ratio=r, options=o) for m in methods for r in ratios
                for o in options]
    return [CompressionSpec(m, budget=b, options=o) for m in methods for b in budgets or ()
            for o in options]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    args = build_parser().parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.plot)
    started = time.perf_counter()
    try:
        tasks = list(TASKS) if args.tasks == "all" else parse_names(args.tasks, list(TASKS),
                                                                      "--tasks")
        methods = parse_names(args.methods, METHODS, "--methods")
        scorings = parse_names(args.scorings, SCORINGS, "--scorings")
    except ValueError as error:
        raise SystemExit(str(error)) from None
    ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else None
    budgets = None if ratios else parse_ints(args.budgets)
    try:
        explicit = parse_specs(args.configs) if args.configs else None
    except ValueError as error:
        raise SystemExit(f"--configs: {error}") from None
    lengths = parse_ints(args.lengths)

    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    context = model_shape(model)["max_position_embeddings"]
    if context and max(lengths) > context:
        raise SystemExit(f"--lengths: {max(lengths)} exceeds the model's context {context}")

    count = token_counter(tokenizer)

    def encode_alone(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    samples = make_samples(tasks, lengths, args.samples, args.seed, count)
    prompts = []
    for sample in samples:
        ids, context_tokens = question_split(sample.prompt, tokenizer.encode, encode_alone)
        prompts.append({"prompt_token_ids": ids, "context_tokens": context_tokens,
                        "max_tokens": sample.max_tokens})
    modes = positions(args.question_position)
    if not args.enable_prefix_caching and "outside" in modes:
        raise SystemExit("--no-prefix-caching: the question-outside mode adopts each context's "
                         "cache through the prefix cache; use it with --question-position "
                         "inside")
    # The inside mode's prompts as ever (the whole prompt tokenized at once); the outside
    # mode's differ only where the tokenizer would merge across the context's end.
    retokenized = sum(p["prompt_token_ids"] != tokenizer.encode(s.prompt)
                      for p, s in zip(prompts, samples))
    if retokenized and "inside" in modes:
        inside_prompts = [{**p, "prompt_token_ids": tokenizer.encode(s.prompt)}
                          for p, s in zip(prompts, samples)]
    else:
        inside_prompts = prompts
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
    if args.dry_run:
        return dry_run(samples, prompt_lens)

    # the full cache always runs first; vanilla with another cache dtype is a config
    specs = [s for s in explicit if s != CompressionSpec()] if explicit else make_specs(
        methods, budgets, ratios, scorings)
    check_settings(specs, parse_kv_options(args.kv_option))
    to_run = [CompressionSpec()] + [s for s in specs if not evicts_nothing(s, prompt_lens)]
    dtype = resolve_dtype(args.dtype, device)
    longest = max(n + p["max_tokens"] for n, p in zip(prompt_lens, prompts))
    # Room for every request at once: quality runs are not meant to be memory-bound.
    kv_tokens = min(sum(n + p["max_tokens"] for n, p in zip(prompt_lens, prompts)),
                    args.max_num_seqs * longest)
    kv_tokens = max(kv_tokens, 2 * longest)
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(2048, longest),
        kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(model, dtype),
        enforce_eager=not args.compile, seed=args.seed,
        compression_options=parse_kv_options(args.kv_option),
        enable_prefix_caching=args.enable_prefix_caching,
    )
    # Question outside: every context's cache waits in the prefix cache for its question,
    # beside the running requests; room for all of them uncompressed (an entry evicted
    # before its question is a miss). The inside mode's engines stay as they were.
    outside_bytes = settings.kv_cache_memory_bytes + sum(
        p["context_tokens"] for p in prompts) * kv_bytes_per_token(model, dtype)
    mode_settings = {"inside": settings, "outside": dataclasses.replace(
        settings, enable_prefix_caching=True, kv_cache_memory_bytes=outside_bytes)}
    threads = None if device != "cpu" else args.threads or default_threads()
    workdir = make_workdir("quality")
    prompts_paths = {"inside": write_workload(workdir, inside_prompts, "prompts_inside.json"),
                     "outside": write_workload(workdir, prompts, "prompts_outside.json")}
    log_path = args.log_file or workdir / "vllm.log"
    header = {
        "benchmark": "quality",
        "command": command_string([sys.argv[0], *argv]),
        "machine": machine_info(device),
        "settings": {**vars(settings), "threads": threads},
        **({"outside_kv_cache_memory_bytes": mode_settings["outside"].kv_cache_memory_bytes}
           if "outside" in modes else {}),
        "workload": {
            "tasks": tasks, "lengths": lengths, "samples_per_task_length": args.samples,
            "seed": args.seed, "num_prompts": len(samples),
            "prompt_tokens": sum(prompt_lens), "prompt_len_range": [min(prompt_lens),
                                                                    max(prompt_lens)],
            "methods": list(dict.fromkeys(s.method for s in specs)),
            "budgets": sorted({s.budget for s in specs if s.budget is not None}) or None,
            "ratios": sorted({s.ratio for s in specs if s.ratio is not None}) or None,
            "configs": [spec.label for spec in specs],
            "question_positions": modes,
            "context_tokens_mean": mean([p["context_tokens"] for p in prompts]),
            # outside mode: prompts whose question was tokenized alone after the context
            "retokenized_at_question": retokenized,
        },
    }
    print(f"command: {header['command']}")
    print(f"settings: {json.dumps(header['settings'])}")
    print(f"workload: {json.dumps(header['workload'])}")
    where = "" if modes == ["inside"] else f"; question {' and '.join(modes)}"
    print(f"{len(to_run) * len(modes)} engine runs ({len(specs) + 1 - len(to_run)} budgets >= "
          f"every prompt not run{where}); vLLM logs: {log_path}", flush=True)

    # Configuration by configuration, each in every mode (a stopped run has whole pairs).
    jobs = [{"id": job_id(spec, mode), "spec": vars(spec), "settings": vars(mode_settings[mode]),
             "question": mode, "prompts_path": str(prompts_paths[mode])}
            for spec in to_run for mode in modes]
    results = run_jobs(
        WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: len(prompts) * (2 if job["question"] == "outside" else 1)
               for job in jobs},
        job_timeout=args.job_timeout, env=worker_env(args.verbose, False, threads),
        desc="quality", show_progress=not args.no_progress,
    )
    rows = build_rows(samples, [CompressionSpec(), *specs], results, prompts,
                      {mode: mode_settings[mode] for mode in modes})
    report = {**header, "configs": rows, "samples": sample_records(samples, prompt_lens),
              "runtime_s": time.perf_counter() - started}
    write_json(args.output_json, report)
    print()
    print(render_run(report))
    for row in rows:
        if not row["ok"]:
            print(f"\n{row['label']} ({row['question']}) FAILED:\n{row['error']}")
        elif adoption_problems(row):
            print(f"\n{row['label']} (question outside): {adoption_problems(row)}")
    plot(rows, args.plot, title=plot_title(header))
    print(f"\nwrote {args.output_json} and {args.plot} ({report['runtime_s']:.0f} s)")
    return 0 if all(row["ok"] for row in rows) else 1


def job_id(spec: CompressionSpec, mode: str) -> str:
    return spec.label if mode == "inside" else f"{spec.label} (question outside)"


def build_rows(samples: Sequence[Sample], specs: Sequence[CompressionSpec],
               results: dict[str, Any], prompts: Sequence[dict[str, Any]],
               mode_settings: dict[str, EngineSettings]) -> list[dict[str, Any]]:
    """One row per configuration and mode run (``mode_settings``: each mode's engine settings;
    each mode compared with its own full cache), the mode and resolved scoring on each row,
    adoption on the outside rows, and each outside row's paired difference to its inside
    twin."""
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
    rows: list[dict[str, Any]] = []
    for mode, settings in mode_settings.items():
        options = settings.compression_options
        mine = {spec.label: results[job_id(spec, mode)] for spec in specs
                if job_id(spec, mode) in results}
        mode_rows = collect_rows(samples, specs, mine, prompt_lens)
        for spec, row in zip(specs, mode_rows):
            row["question"] = mode
            row["scoring"] = resolved_scoring(spec, options, settings.enable_prefix_caching,
                                              settings.model)
            outcome = mine.get(spec.label)
            if mode == "outside" and row["ok"] and outcome is not None and outcome.result:
                result = outcome.result
                contexts = [p["context_tokens"] for p in prompts]
                row["adoption"] = adoption(
                    contexts, result["cached_tokens"], compressible(spec, options, contexts),
                    result["context_figures"], result["question_figures"])
                row["context_s"] = result["context_s"]
        rows.extend(mode_rows)
    add_vs_inside(rows)
    return rows


def check_settings(specs: Sequence[CompressionSpec], options: dict[str, Any]) -> None:
    """Every configuration's settings are valid, before any engine starts."""
    from kvcompress.settings.config import KVCompressionConfig, KVCompressionConfigError

    for spec in specs:
        try:
            KVCompressionConfig.from_mapping(spec.additional_config(options))
        except KVCompressionConfigError as error:
            raise SystemExit(f"{spec.label}: {error}") from None


def sample_records(samples: Sequence[Sample], prompt_lens: Sequence[int]) -> list[dict]:
    return [
        {"task": s.task, "length": s.length, "index": s.index, "prompt_tokens": n,
         "answers": s.answers, "metric": s.metric, "max_tokens": s.max_tokens}
        for s, n in zip(samples, prompt_lens)
    ]


def dry_run(samples: Sequence[Sample], prompt_lens: Sequence[int]) -> int:
    for task in dict.fromkeys(s.task for s in samples):
        lens = [n for s, n in zip(samples, prompt_lens) if s.task == task]
        print(f"{task:18s} {len(lens):3d} prompts, {min(lens)}..{max(lens)} tokens")
    example = samples[0]
    print(f"\nexample ({example.task}, answers {example.answers}):\n"
          f"{example.prompt[:600]} [...] {example.prompt[-300:]}")
    print(json.dumps([asdict(s) | {"prompt": None} for s in samples[:3]], indent=1))
    return 0
