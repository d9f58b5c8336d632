"""Inter-token latency of streaming requests while long prompts arrive, over HTTP.

One `vllm serve` per scoring (the README's serve command plus ``--kv-scoring``, the same
KV memory and vLLM defaults on every side): ``--streams`` requests stream their answers
from the start; once they decode, ``--long-prompts`` prompts of ``--long-len`` tokens
arrive ``--interval`` seconds apart. Reported per scoring: the streams' inter-token gaps
(median, p99, max) over the whole run, the long prompts' time to first token, and the
run's output tokens per second. A scoring whose prompt work runs inside the decoding
steps shows it in the streams' p99: reconstruction passes are scheduled in the token
budget (``kvcompress.engine.pass_schedule``), so they should cost the streams no more than
a prefill chunk does.

    python -m benchmarks.streaming_latency --json benchmarks/results/streaming_latency.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.report import command_string, format_table, machine_info, write_json
from benchmarks.serve import vllm_server


@dataclass
class Row:
    scoring: str
    streams: int
    long_prompts: int
    long_len: int
    itl_median_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    long_ttft_s: float  # mean over the long prompts
    output_tokens_per_s: float
    ratio_p99_vs_first: float = 1.0  # p99 against the first scoring's (the reference)


@contextlib.contextmanager
def _server(args: argparse.Namespace, scoring: str, log_dir: Path) -> Iterator[str]:
    options = ["--kv-compression", args.method, "--dtype", "float32",
               "--kv-cache-memory-bytes", args.kv_cache_memory]
    if scoring != "default":
        options += ["--kv-scoring", scoring]
    with vllm_server(args.model, options, log_dir / f"serve-{scoring}.log") as base:
        yield base


async def _stream(session: aiohttp.ClientSession, base: str, model: str,
                  prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the streamed tokens of one completion (one chunk per token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    times: list[float] = []
    async with session.post(f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    return times


async def _run(base: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    streams = [[rng.randrange(100, 49000) for _ in range(args.stream_len)]
               for _ in range(args.streams)]
    longs = [[rng.randrange(100, 49000) for _ in range(args.long_len)]
             for _ in range(args.long_prompts)]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Warm-up: one request end to end.
        await _stream(session, base, args.model, streams[0][:32], 4)
        start = time.perf_counter()
        stream_tasks = [asyncio.create_task(
            _stream(session, base, args.model, prompt, args.stream_tokens))
            for prompt in streams]
        await asyncio.sleep(args.delay)
        long_starts, long_tasks = [], []
        for prompt in longs:
            long_starts.append(time.perf_counter())
            long_tasks.append(asyncio.create_task(
                _stream(session, base, args.model, prompt, args.long_tokens)))
            await asyncio.sleep(args.interval)
        stream_times = await asyncio.gather(*stream_tasks)
        long_times = await asyncio.gather(*long_tasks)
        end = time.perf_counter()
    gaps = np.concatenate([np.diff(times) for times in stream_times if len(times) > 1])
    tokens = sum(len(times) for times in stream_times) + sum(len(t) for t in long_times)
    return {
        "itl_median_ms": float(np.median(gaps) * 1e3),
        "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3),
        "itl_max_ms": float(gaps.max() * 1e3),
        "long_ttft_s": float(np.mean([times[0] - begun
                                      for times, begun in zip(long_times, long_starts)])),
        "output_tokens_per_s": tokens / (end - start),
    }


def render(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, [
        ("scoring", "scoring"), ("streams", "streams"), ("long_prompts", "long prompts"),
        ("long_len", "tokens each"), ("itl_median_ms", "ITL median ms"),
        ("itl_p99_ms", "ITL p99 ms"), ("itl_max_ms", "ITL max ms"),
        ("ratio_p99_vs_first", "p99 vs first"), ("long_ttft_s", "long TTFT s"),
        ("output_tokens_per_s", "output tok/s")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.streaming_latency",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".models/SmolLM2-135M-Instruct")
    parser.add_argument("--method", default="pyramidkv")
    parser.add_argument("--scorings", default="window,reconstruct,default",
                        help="comma-separated --kv-scoring values ('default': the flag "
                        "unset); the first is the reference of the ratio column")
    parser.add_argument("--kv-cache-memory", default="1G")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-len", type=int, default=64, help="stream prompt tokens")
    parser.add_argument("--stream-tokens", type=int, default=384)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--long-tokens", type=int, default=16)
    parser.add_argument("--delay", type=float, default=3.0,
                        help="seconds of decoding before the first long prompt")
    parser.add_argument("--interval", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    command, machine = command_string(), machine_info("cpu")
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores; {machine['date']}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as logs:
        for scoring in args.scorings.split(","):
            with _server(args, scoring, Path(logs)) as base:
                figures = asyncio.run(_run(base, args))
            rows.append(Row(scoring, args.streams, args.long_prompts, args.long_len,
                            **figures))
            print(render([asdict(rows[-1])]), flush=True)
    for row in rows:
        row.ratio_p99_vs_first = row.itl_p99_ms / rows[0].itl_p99_ms
    table = [asdict(row) for row in rows]
    print(render(table))
    if args.json:
        write_json(args.json, {"benchmark": "streaming_latency", "command": command,
                               "machine": machine, "settings": vars(args), "rows": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
