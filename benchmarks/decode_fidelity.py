"""Decode-time fidelity: how much of the full cache's long greedy answer each decode-eviction
configuration reproduces, on the real model, in one invocation.

Chat prompts that ask for long texts run greedily (``ignore_eos``) through vanilla vLLM (the
full cache) and through each configuration; every configuration's output is compared with the
full cache's, token by token:

    python -m benchmarks.decode_fidelity                       # defaults (CPU: ~10 min)
    python -m benchmarks.decode_fidelity --configs pyramidkv:100000@h2o:128 --output-len 512

Configurations are ``METHOD:BUDGET@DECODE_POLICY:N`` (see benchmarks.throughput); the default
prompt budget exceeds every prompt, so only decode-time eviction differs from the full cache.

Reported per configuration and horizon H (256 and the output length): ``prefix@H``, the mean
fraction of the first H tokens reproduced before the first difference (greedy decoding never
re-converges once it differs, so this is the agreement that matters), and ``match@H``, the
fraction of positions < H holding the same token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.jobs import Reporter, make_workdir, run_jobs, worker_env, worker_main
from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from benchmarks.specs import (
    CompressionSpec,
    EngineSettings,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_specs,
    resolve_dtype,
)

WORKER_MODULE = "benchmarks.decode_fidelity"
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


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from vllm import SamplingParams

    from benchmarks.engine import build_engine, generate, shutdown_engine

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    prompts = json.loads(Path(job["prompts_path"]).read_text())
    engine = build_engine(settings, spec)
    try:
        params = [SamplingParams(max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True)
                  for p in prompts]
        outputs, elapsed = generate(engine, [p["prompt_token_ids"] for p in prompts], params,
                                    lambda finished, _tokens: reporter.progress(finished))
    finally:
        shutdown_engine(engine)
    return {"token_ids": [o.token_ids for o in outputs], "texts": [o.text for o in outputs],
            "generate_s": elapsed}


def score(specs: list[CompressionSpec], results: dict[str, Any],
          horizons: list[int]) -> list[dict[str, Any]]:
    reference = results["vanilla"].result["token_ids"]
    rows = []
    for spec in specs:
        outcome = results[spec.label]
        row: dict[str, Any] = {"label": spec.label, "ok": outcome.error is None,
                               "error": outcome.error}
        if outcome.result is not None:
            row["generate_s"] = outcome.result["generate_s"]
            for horizon in horizons:
                pairs = [agreement(ref, out, horizon)
                         for ref, out in zip(reference, outcome.result["token_ids"])]
                row[f"prefix@{horizon}"] = sum(p for p, _ in pairs) / len(pairs)
                row[f"match@{horizon}"] = sum(m for _, m in pairs) / len(pairs)
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated METHOD:BUDGET@DECODE_POLICY:N (vanilla is added)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--output-json", type=Path, default=RESULTS_DIR / "decode_fidelity.json")
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
    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts,
                           args.output_len)
    dtype = resolve_dtype(args.dtype, device)
    longest = max(len(p["prompt_token_ids"]) + p["max_tokens"] for p in prompts)
    # Room for every request at once (fidelity, not memory), plus 1024 tokens' worth for
    # kvcompress's window-score reserve, which small pools would otherwise feel.
    kv_tokens = (len(prompts) + 1) * longest + 1024
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=len(prompts),
        max_num_batched_tokens=max(2048, longest),
        kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(model, dtype),
    )
    threads = None if device != "cpu" else args.threads or default_threads()
    workdir = make_workdir("decode_fidelity")
    prompts_path = workdir / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    log_path = args.log_file or workdir / "vllm.log"
    header = {"benchmark": "decode_fidelity", "command": command_string([sys.argv[0], *argv]),
              "machine": machine_info(device), "settings": {**vars(settings), "threads": threads},
              "workload": {"num_prompts": len(prompts), "output_len": args.output_len,
                           "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts]}}
    print(f"command: {header['command']}\nvLLM logs: {log_path}", flush=True)
    jobs = [{"id": spec.label, "spec": vars(spec), "settings": vars(settings),
             "prompts_path": str(prompts_path)} for spec in specs]
    results = run_jobs(
        WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: len(prompts) for job in jobs}, job_timeout=args.job_timeout,
        env=worker_env(args.verbose, False, threads), desc="decode fidelity",
        show_progress=not args.no_progress,
    )
    if results["vanilla"].error is not None:
        print(f"the full-cache run failed:\n{results['vanilla'].error}")
        return 1
    horizons = sorted({min(256, args.output_len), args.output_len})
    rows = score(specs, results, horizons)
    report = {**header, "configs": rows, "runtime_s": time.perf_counter() - started}
    write_json(args.output_json, report)
    columns = [("label", "config")] + [
        (f"{kind}@{h}", f"{kind}@{h}") for h in horizons for kind in ("prefix", "match")
    ]
    print()
    print(format_table(rows, columns))
    failed = [row for row in rows if not row["ok"]]
    for row in failed:
        print(f"\n{row['label']} FAILED:\n{row['error']}")
    print(f"\nwrote {args.output_json} ({report['runtime_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
