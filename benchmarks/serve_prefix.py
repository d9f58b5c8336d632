"""One shared prefix over HTTP, with vLLM's own load generator: ``vllm bench serve --dataset-name
prefix_repetition`` against a vanilla `vllm serve` (its prefix cache on, vLLM's default) and a
kvcompress one, the same KV-cache bytes (``--kv-cache-memory-bytes``) and engine flags on both.

    python -m benchmarks.serve_prefix        # 32 prompts: one 1280-token prefix + 256 own, 128 out
    python -m benchmarks.serve_prefix --dataset chats   # issue 40's chats, as text

``--dataset chats`` sends issue 40's own workload instead (``benchmarks.throughput``'s
system-prompt chats: one ~1.5k-token system prompt, each chat its own ~270-token question,
through the model's chat template), as a ``--dataset-name custom`` file of their text
(``--skip-chat-template``: the text is templated already); vLLM's custom dataset needs pandas.

Each side: start the server, send one warm-up completion (64 token ids that share nothing with
the dataset's prompts: one-time costs out of the figures), read ``/metrics``, run the bench
command (printed, and kept in the JSON), read ``/metrics`` again, stop the server. Figures:
what ``vllm bench serve --save-result`` writes (output and total tok/s, request throughput,
time to first token, time per output token and inter-token latency: mean, median, p99) and
what the server's counters grew by over the bench: prompt tokens, prompt tokens served from
the prefix cache (``vllm:prompt_tokens_cached``, which counts kvcompress's adopted tokens
too) and kvcompress's segment requests' prompt tokens (``kvcompress:prefix_segment_tokens``:
a shared prefix computed once, which vLLM's prompt counters do not see), so prefill tokens
computed = prompt - cached + segment; prefix-cache queries and hits.
``cached_per_reader``: cached tokens / (prompts - 1), against the prefix length: every reader
after the first finding the whole prefix cached gives about the prefix length. Ratios: the
kvcompress side over vanilla's. ``--sides`` picks and names the servers' extra flags.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from benchmarks.serve import VLLM, metrics_delta, read_metrics, vllm_server

DEFAULT_SIDES = ("vanilla=--kv-compression none;"
                 "kvcompress=--kv-compression pyramidkv --kv-compression-ratio 0.875")
# Counters read from /metrics before and after the bench (summed over their label sets).
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:generation_tokens_total",
            # a segment request's prompt (kvcompress computing a shared prefix once) is not
            # in vLLM's prompt counters; it is computed all the same
            "kvcompress:prefix_segment_tokens_total",
            # a shared prefix copied off a lone request's pages (counted in its prompt)
            "kvcompress:prefix_fork_tokens_total",
            # readers that prefilled over a whole shared prefix (before its compaction)
            "kvcompress:prefix_segment_whole_reads_total")
# What vllm bench serve's result JSON gives, kept as is (ms for the latencies).
BENCH_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
              "request_throughput", "output_throughput", "total_token_throughput",
              "max_concurrent_requests",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
              "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")
# Compared with vanilla's: the kvcompress side's figure over vanilla's.
# --dataset chats: the prompts' file in the run's folder.
CHATS_FILE = "chats.jsonl"
RATIO_KEYS = ("output_throughput", "total_token_throughput", "request_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
              "prefill_tokens", "duration")


def parse_sides(text: str) -> list[tuple[str, list[str]]]:
    """``NAME=FLAGS;NAME=FLAGS``: each server's name and its extra `vllm serve` flags."""
    sides = []
    for item in text.split(";"):
        if not item.strip():
            continue
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"side {item!r}: NAME=FLAGS")
        sides.append((name.strip(), shlex.split(flags)))
    if not sides:
        raise ValueError("no side")
    if len({name for name, _ in sides}) != len(sides):
        raise ValueError("two sides with one name")
    return sides


def serve_options(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """The flags every side's `vllm serve` gets, then the side's own."""
    return ["--dtype", args.dtype, "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
            "--max-model-len", str(args.max_model_len), "--seed", str(args.seed), *extra]


def write_chats(args: argparse.Namespace, path: Path) -> int:
    """Issue 40's chats (``benchmarks.throughput.chat_prompts``: one ~1.5k-token system
    prompt, each chat's own ~270-token question, through the model's chat template) as a
    ``--dataset-name custom`` JSONL of their text; returns the shared prefix's token count."""
    from transformers import AutoTokenizer

    from benchmarks.throughput import chat_prompts, shared_prefix_length

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = chat_prompts(args.num_prompts, args.system_prompt_tokens, args.question_tokens,
                           args.output_len, args.seed, tokenizer)
    with path.open("w") as out:
        for prompt in prompts:
            out.write(json.dumps({"prompt": tokenizer.decode(prompt["prompt_token_ids"])})
                      + "\n")
    return shared_prefix_length(prompts)


def bench_command(args: argparse.Namespace, base: str, result_dir: Path,
                  filename: str) -> list[str]:
    """The `vllm bench serve` command of one side."""
    if args.dataset == "chats":
        dataset = ["--dataset-name", "custom", "--dataset-path", str(result_dir / CHATS_FILE),
                   "--custom-output-len", str(args.output_len), "--skip-chat-template"]
    else:
        dataset = ["--dataset-name", "prefix_repetition",
                   "--prefix-repetition-prefix-len", str(args.prefix_len),
                   "--prefix-repetition-suffix-len", str(args.suffix_len),
                   "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                   "--prefix-repetition-output-len", str(args.output_len)]
    return [VLLM, "bench", "serve", "--backend", "openai", "--base-url", base,
            "--model", args.model, "--tokenizer", args.model, *dataset,
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
            "--ignore-eos", "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
            "--disable-tqdm"]


def shown_command(vllm_args: Sequence[str]) -> str:
    """``vllm ARGS`` as a user types it from the repository root."""
    return shlex.join([".venv/bin/vllm", *vllm_args])


def bench_figures(result: Mapping[str, Any], counters: Mapping[str, float], *,
                  prefix_len: int, num_prompts: int) -> dict[str, Any]:
    """One side's figures: ``result`` is vllm bench serve's saved JSON, ``counters`` what
    the server's /metrics counters (COUNTERS) grew by over the bench."""
    figures: dict[str, Any] = {key: result.get(key) for key in BENCH_KEYS}
    prompt = counters.get("vllm:prompt_tokens_total")
    cached = counters.get("vllm:prompt_tokens_cached_total")
    queries = counters.get("vllm:prefix_cache_queries_total")
    hits = counters.get("vllm:prefix_cache_hits_total")
    segments = counters.get("kvcompress:prefix_segment_tokens_total") or 0.0
    figures.update({
        "prompt_tokens": prompt, "cached_tokens": cached,
        "segment_tokens": segments,
        "fork_tokens": counters.get("kvcompress:prefix_fork_tokens_total") or 0.0,
        "prefill_tokens": prompt - cached + segments
        if prompt is not None and cached is not None else None,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
        "cached_per_reader": (cached / (num_prompts - 1)
                              if cached is not None and num_prompts > 1 else None),
        "prefix_len": prefix_len,
    })
    return figures


def load_bench_result(path: Path) -> dict[str, Any]:
    """vllm bench serve's ``--save-result`` file: one JSON object (the last line's, were
    results appended)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty")
    return json.loads(lines[-1])


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """``vs_vanilla`` of every run: RATIO_KEYS over the first run's (the reference)."""
    base = runs[0]["figures"] if runs and runs[0].get("figures") else {}
    for run in runs:
        figures = run.get("figures") or {}
        run["vs_vanilla"] = {
            key: (figures[key] / base[key] if figures.get(key) is not None and base.get(key)
                  else None) for key in RATIO_KEYS}


def render(runs: Sequence[Mapping[str, Any]]) -> str:
    table = [{"side": run["label"], **(run.get("figures") or {}),
              **{f"{key}_x": value for key, value in (run.get("vs_vanilla") or {}).items()}}
             for run in runs]
    return format_table(table, [
        ("side", "server"), ("completed", "done"), ("output_throughput", "out tok/s"),
        ("output_throughput_x", "x van"), ("mean_ttft_ms", "TTFT ms"),
        ("mean_ttft_ms_x", "x van"), ("p99_ttft_ms", "TTFT p99 ms"),
        ("mean_tpot_ms", "TPOT ms"), ("mean_tpot_ms_x", "x van"),
        ("prefill_tokens", "prefill tok"), ("prefill_tokens_x", "x van"),
        ("segment_tokens", "of it segments"),
        ("cached_per_reader", "cached/reader"), ("prefix_len", "prefix"),
        ("prefix_cache_hit_rate", "hit rate"), ("max_concurrent_requests", "peak conc"),
        ("duration", "time s")])


def render_report(report: Mapping[str, Any]) -> str:
    """The result's table, then each side's two commands."""
    lines = [render(report["runs"]), ""]
    for run in report["runs"]:
        lines.append(f"- {run['label']}: `{run['serve_command']}`; "
                     f"`{run['bench_command']}`")
    return "\n".join(lines)


def warm_up(base: str, model: str) -> None:
    """One short completion of ids the dataset's prompts do not start with."""
    body = json.dumps({"model": model, "prompt": list(range(1000, 1064)), "max_tokens": 4,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def run_side(args: argparse.Namespace, name: str, extra: Sequence[str],
             workdir: Path) -> dict[str, Any]:
    options = serve_options(args, extra)
    run: dict[str, Any] = {"label": name,
                           "serve_command": shown_command(["serve", args.model, *options])}
    with vllm_server(args.model, options, workdir / f"serve-{name}.log") as base:
        warm_up(base, args.model)
        before = read_metrics(base, COUNTERS)
        command = bench_command(args, base, workdir, f"bench-{name}.json")
        # the port and the folder differ per run: the recorded command names them
        run["bench_command"] = shown_command(command[1:]).replace(base, "BASE").replace(
            str(workdir), "DIR")
        print(f"{name}: {run['bench_command']}", flush=True)
        started = time.perf_counter()
        completed = subprocess.run(
            command, stdout=sys.stdout, stderr=sys.stderr, timeout=args.bench_timeout)
        run["bench_seconds"] = time.perf_counter() - started
        if completed.returncode != 0:
            raise RuntimeError(f"vllm bench serve exited with {completed.returncode}")
        counters = metrics_delta(before, read_metrics(base, COUNTERS))
    result = load_bench_result(workdir / f"bench-{name}.json")
    run["counters"] = counters
    run["bench_result"] = result  # as vllm bench serve saved it (no per-request lists)
    run["figures"] = bench_figures(result, counters, prefix_len=args.prefix_len,
                                   num_prompts=args.num_prompts)
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_prefix",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".models/SmolLM2-135M-Instruct",
                        help="model folder; also the bench's tokenizer (no network)")
    parser.add_argument("--sides", default=DEFAULT_SIDES,
                        help="NAME=FLAGS;NAME=FLAGS: each server's extra `vllm serve` flags; "
                             "the first is the reference of the ratios")
    server = parser.add_argument_group("servers (identical on every side)")
    server.add_argument("--kv-cache-memory-bytes", default="130M")
    server.add_argument("--dtype", default="float32")
    server.add_argument("--max-model-len", type=int, default=2048)
    bench = parser.add_argument_group("vllm bench serve --dataset-name prefix_repetition")
    bench.add_argument("--dataset", choices=("prefix_repetition", "chats"),
                       default="prefix_repetition",
                       help="chats: issue 40's own (a ~1.5k-token system prompt, each chat's "
                            "~270-token question) as a custom dataset of their text")
    bench.add_argument("--system-prompt-tokens", type=int, default=1500,
                       help="--dataset chats")
    bench.add_argument("--question-tokens", type=int, default=270, help="--dataset chats")
    bench.add_argument("--prefix-len", type=int, default=1280)
    bench.add_argument("--suffix-len", type=int, default=256)
    bench.add_argument("--num-prefixes", type=int, default=1)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--num-prompts", type=int, default=32)
    bench.add_argument("--request-rate", default="inf",
                       help="requests per second (inf: all at once)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--bench-timeout", type=float, default=3600.0)
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="keep each server's log and vllm bench's result in DIR")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "serve_prefix" /
                        "serve_prefix.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        sides = parse_sides(args.sides)
    except ValueError as error:
        raise SystemExit(f"--sides: {error}") from None
    started = time.perf_counter()
    command, machine = command_string([sys.argv[0], *argv]), machine_info("cpu")
    print(f"command: {command}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="serve-prefix-") as folder:
        workdir = args.keep_logs or Path(folder)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.dataset == "chats":
            args.prefix_len = write_chats(args, workdir / CHATS_FILE)
            print(f"chats: {args.num_prompts}, shared prefix {args.prefix_len} tokens")
        for name, extra in sides:
            runs.append(run_side(args, name, extra, workdir))
            print(render(runs[-1:]), flush=True)
    add_ratios(runs)
    report = {"benchmark": "serve_prefix", "command": command, "machine": machine,
              "settings": dict(vars(args)),  # (write_json writes paths as text)
              "runs": runs, "runtime_s": time.perf_counter() - started}
    write_json(args.json, report)
    print()
    print(render_report(report))
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
