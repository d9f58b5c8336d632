"""Decode-time fidelity: how much of the full cache's long greedy answer each decode-eviction
configuration reproduces, on the real model, in one invocation.

Chat prompts that ask for long texts run greedily (``ignore_eos``) through vanilla vLLM (the
full cache) and through each configuration; every configuration's output is compared with the
full cache's, token by token:

    python -m benchmarks.studies.decode_fidelity              # defaults (CPU: ~10 min)
    python -m benchmarks.studies.decode_fidelity --configs pyramidkv:100000@h2o:128 \\
        --output-len 512

Configurations are ``METHOD:BUDGET@DECODE_POLICY:N`` (see benchmarks.throughput); the default
prompt budget exceeds every prompt, so only decode-time eviction differs from the full cache.
Prefix caching is on, vLLM's default (the chat template's head is shared by every prompt);
``--no-prefix-caching`` turns it off (recorded, and said above the table).

Reported per configuration and horizon H (256 and the output length): ``prefix@H``, the mean
fraction of the first H tokens reproduced before the first difference (greedy decoding never
re-converges once it differs, so this is the agreement that matters), and ``match@H``, the
fraction of positions < H holding the same token.

``--recall`` measures instead whether a fact the model generated early survives decode-time
eviction: a secret code stated in teacher-forced generated tokens, asked for ~1000 tokens
later (benchmarks.studies.decode_recall has the method). Reported per configuration: accuracy
with its 95% Wilson interval and the paired difference to the full cache:

    python -m benchmarks.studies.decode_fidelity --recall --num-prompts 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
    CompressionSpec,
    EngineSettings,
    add_prefix_caching_option,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_specs,
    resolve_dtype,
)

WORKER_MODULE = "benchmarks.studies.decode_fidelity"
DEFAULT_CONFIGS = ("pyramidkv:100000@window:128,pyramidkv:100000@h2o:128,"
                   "pyramidkv:100000@snapkv:128")
TOPICS = (
    "the history of the printing press", "how bridges are designed and built",
    "the water cycle and its effect on weather", "the life cycle of stars",
    "how a city plans its public transport", "the invention of the telephone",
    "how bees make honey and why they matter", "the causes of the industrial revolution",
)


def chat_prompts(tokenizer: Any, num: int, output_len: int) -> list[dict[str, Any]]:
    """Chat-templated requests for long texts, the same for every configuration."""
    prompts = []
    for index in range(num):
        topic = TOPICS[index % len(TOPICS)]
        messages = [{"role": "user", "content": f"Write a long, detailed essay about {topic}, "
                     "with an introduction, several sections and a conclusion."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append({"prompt_token_ids": ids, "max_tokens": output_len})
    return prompts


def agreement(reference: list[int], output: list[int], horizon: int) -> tuple[float, float]:
    """(common prefix within the first ``horizon`` tokens / horizon, positional match rate)."""
    ref, out = reference[:horizon], output[:horizon]
    span = max(1, len(ref))
    prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    matches = sum(a == b for a, b in zip(ref, out))
    return prefix / span, matches / span


def recall_task_prompts(tokenizer: Any, num: int, filler_tokens: int) -> tuple[list, list]:
    """(RecallPrompts, their worker dicts): the forced script travels with each prompt."""
    from benchmarks.studies.decode_recall import FORCED_TOKENS_KEY, recall_prompts

    recall = recall_prompts(tokenizer, num, filler_tokens)
    return recall, [{"prompt_token_ids": p.prompt_token_ids, "max_tokens": p.max_tokens,
                     FORCED_TOKENS_KEY: p.forced_tokens} for p in recall]


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from vllm import SamplingParams

    from benchmarks.engine import build_engine, generate, shutdown_engine
    from benchmarks.studies.decode_recall import FORCED_TOKENS_KEY, PROCESSOR_PATH

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    prompts = json.loads(Path(job["prompts_path"]).read_text())
    # --recall: the forced script travels per request, to a processor the engine loads
    scripted = any(FORCED_TOKENS_KEY in p for p in prompts)
    engine = build_engine(settings, spec, logits_processors=[PROCESSOR_PATH] if scripted else ())
    try:
        params = [SamplingParams(max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True,
                                 extra_args={FORCED_TOKENS_KEY: p[FORCED_TOKENS_KEY]}
                                 if FORCED_TOKENS_KEY in p else None)
                  for p in prompts]
        outputs, elapsed = generate(engine, [p["prompt_token_ids"] for p in prompts], params,
                                    lambda finished, _tokens: reporter.progress(finished))
    finally:
        shutdown_engine(engine)
    return {"token_ids": [o.token_ids for o in outputs], "texts": [o.text for o in outputs],
            "generate_s": elapsed}


def run_rows(specs: list[CompressionSpec], results: dict[str, Any],
             measure: Any) -> list[dict[str, Any]]:
    """A row per configuration: its outcome, and ``measure(token_ids)``'s figures if it ran."""
    rows = []
    for spec in specs:
        outcome = results[spec.label]
        row: dict[str, Any] = {"label": spec.label, "ok": outcome.error is None,
                               "error": outcome.error}
        if outcome.result is not None:
            row["generate_s"] = outcome.result["generate_s"]
            row.update(measure(outcome.result["token_ids"]))
        rows.append(row)
    return rows


def score(specs: list[CompressionSpec], results: dict[str, Any],
          horizons: list[int]) -> list[dict[str, Any]]:
    reference = results["vanilla"].result["token_ids"]

    def measure(token_ids: list[list[int]]) -> dict[str, float]:
        figures = {}
        for horizon in horizons:
            pairs = [agreement(ref, out, horizon) for ref, out in zip(reference, token_ids)]
            figures[f"prefix@{horizon}"] = sum(p for p, _ in pairs) / len(pairs)
            figures[f"match@{horizon}"] = sum(m for _, m in pairs) / len(pairs)
        return figures

    return run_rows(specs, results, measure)


def score_recall_runs(specs: list[CompressionSpec], results: dict[str, Any], recall: list,
                      tokenizer: Any) -> list[dict[str, Any]]:
    """Recall accuracy per configuration and its paired difference to the full cache."""
    from benchmarks.quality.scoring import paired_difference
    from benchmarks.studies.decode_recall import score_recall

    rows = run_rows(specs, results,
                    lambda token_ids: score_recall(recall, token_ids, tokenizer))
    full = rows[0].get("scores")  # vanilla comes first
    for row in rows:
        if "scores" in row and full is not None:
            row["vs_full"] = paired_difference(row["scores"], full)
    return rows


def fidelity_table(rows: list[dict[str, Any]]) -> str:
    """prefix@H and match@H of every configuration, for the horizons H the rows carry."""
    horizons = sorted({int(key.split("@")[1]) for row in rows for key in row
                       if key.startswith("prefix@")})
    return format_table(rows, [("label", "config")] + [
        (f"{kind}@{h}", f"{kind}@{h}") for h in horizons for kind in ("prefix", "match")
    ])


def recall_table(rows: list[dict[str, Any]]) -> str:
    def cells(row: dict[str, Any]) -> dict[str, Any]:
        low, high = row.get("interval") or (None, None)
        diff = row.get("vs_full") or {}
        return {"label": row["label"], "accuracy": row.get("accuracy"), "low": low,
                "high": high, "diff": diff.get("mean"), "diff_low": diff.get("low"),
                "diff_high": diff.get("high"), "digits": row.get("leading_digits"),
                "script": row.get("script_followed")}

    columns = [("label", "config"), ("accuracy", "accuracy"), ("low", "95% low"),
               ("high", "95% high"), ("diff", "vs full"), ("diff_low", "diff low"),
               ("diff_high", "diff high"), ("digits", "leading digits"),
               ("script", "script followed")]
    return format_table([cells(row) for row in rows], columns)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated METHOD:BUDGET@DECODE_POLICY:N (vanilla is added)")
    parser.add_argument("--recall", action="store_true",
                        help="recall of a code stated early in the (forced) generated text")
    parser.add_argument("--recall-filler-tokens", type=int, default=900,
                        help="--recall: forced filler tokens between the code and the question")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: 8, or 20 with --recall")
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    add_prefix_caching_option(parser)
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--output-json", type=Path, default=None,
                        help="default: benchmarks/results/decode_fidelity.json, or "
                        "decode_recall.json with --recall")
    parser.add_argument("--log-file", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        specs = [CompressionSpec()] + [s for s in parse_specs(args.configs) if not s.is_vanilla]
    except ValueError as error:
        raise SystemExit(f"--configs: {error}") from None
    if args.recall_filler_tokens < 1:
        raise SystemExit("--recall-filler-tokens must be >= 1")
    from transformers import AutoTokenizer

    name = "decode_recall" if args.recall else "decode_fidelity"
    num_prompts = args.num_prompts or (20 if args.recall else 8)
    output_json = args.output_json or RESULTS_DIR / f"{name}.json"
    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    recall: list[Any] = []  # --recall: the RecallPrompts, for scoring
    if args.recall:
        recall, prompts = recall_task_prompts(tokenizer, num_prompts, args.recall_filler_tokens)
    else:
        prompts = chat_prompts(tokenizer, num_prompts, args.output_len)
    dtype = resolve_dtype(args.dtype, device)
    longest = max(len(p["prompt_token_ids"]) + p["max_tokens"] for p in prompts)
    # Room for every request at once (fidelity, not memory), plus 1024 tokens' worth for
    # kvcompress's window-score reserve, which small pools would otherwise feel.
    kv_tokens = (len(prompts) + 1) * longest + 1024
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=len(prompts),
        max_num_batched_tokens=max(2048, longest),
        kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(model, dtype),
        enable_prefix_caching=args.enable_prefix_caching,
    )
    threads = None if device != "cpu" else args.threads or default_threads()
    workdir = make_workdir(name)
    prompts_path = write_workload(workdir, prompts, "prompts.json")
    log_path = args.log_file or workdir / "vllm.log"
    workload: dict[str, Any] = {"num_prompts": len(prompts),
                                "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts]}
    if args.recall:
        workload.update(filler_tokens=args.recall_filler_tokens, codes=[p.code for p in recall],
                        forced_tokens=[len(p.forced_tokens) for p in recall])
    else:
        workload["output_len"] = args.output_len
    header = {"benchmark": name, "command": command_string([sys.argv[0], *argv]),
              "machine": machine_info(device), "settings": {**vars(settings), "threads": threads},
              "workload": workload}
    print(f"command: {header['command']}\nvLLM logs: {log_path}", flush=True)
    jobs = [{"id": spec.label, "spec": vars(spec), "settings": vars(settings),
             "prompts_path": str(prompts_path)} for spec in specs]
    results = run_jobs(
        WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: len(prompts) for job in jobs}, job_timeout=args.job_timeout,
        env=worker_env(args.verbose, False, threads), desc=name.replace("_", " "),
        show_progress=not args.no_progress,
    )
    if results["vanilla"].error is not None:
        print(f"the full-cache run failed:\n{results['vanilla'].error}")
        return 1
    if args.recall:
        rows = score_recall_runs(specs, results, recall, tokenizer)
        table = recall_table(rows)
    else:
        horizons = sorted({min(256, args.output_len), args.output_len})
        rows = score(specs, results, horizons)
        table = fidelity_table(rows)
    report = save_report(header, rows, started, output_json)
    print()
    print(with_prefix_caching(table, header["settings"]))
    return conclude(report, str(output_json))


if __name__ == "__main__":
    sys.exit(main())
