"""What compression costs: window scoring + selection + moves as a fraction of prefill time.

The same long prompts run twice through ONE engine, generating two tokens (the prefill step
and one decode step: a request that ends in its prefill step is never compressed): once
compressed, once with ``kv_compression: none`` per request (the same
paged engine, no scoring, no eviction). The worker's own counters give the time spent
scoring observation windows (inside attention) and compacting (after the forward).

    python -m benchmarks.studies.compression_cost              # defaults, ~5 min on 2 cores
    python -m benchmarks.studies.compression_cost --prompt-lens 1024,4096 --method snapkv \\
        --budget 256
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.engine import generate  # no vLLM import until an engine is built
from benchmarks.report import command_string, format_table, machine_info, write_json
from benchmarks.specs import detect_device

# In-process engine core and worker: the worker's counters are read directly (set before
# run() imports vLLM).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass
class CostRow:
    prompt_len: int
    num_prompts: int
    compressed_seconds: float
    uncompressed_seconds: float
    score_seconds: float
    compaction_seconds: float
    tokens_moved: int
    tokens_evicted: int

    @property
    def compression_fraction(self) -> float:
        """Scoring + compaction time over the compressed run's prefill time."""
        return (self.score_seconds + self.compaction_seconds) / self.compressed_seconds

    @property
    def slowdown(self) -> float:
        return self.compressed_seconds / self.uncompressed_seconds


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(length)]


def worker_stats(engine: Any) -> dict:
    (stats,) = engine.collective_rpc(
        lambda worker: asdict(worker.model_runner.paged_runtime.collect_stats())
    )
    return stats


def timed_generate(engine: Any, prompts: list[list[int]], params: Any) -> float:
    _, seconds = generate(engine, prompts, [params] * len(prompts))
    return seconds


def run(args: argparse.Namespace) -> list[CostRow]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    lengths = [int(value) for value in args.prompt_lens.split(",")]
    compression = {"kv_compression": args.method}
    if args.ratio is not None:
        compression["kv_compression_ratio"] = args.ratio
    else:
        compression["kv_budget"] = args.budget
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, enforce_eager=not args.compile, max_model_len=max(lengths) + 16,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_prompts,
        kv_cache_memory_bytes=args.kv_cache_bytes, additional_config=compression,
        dtype=args.dtype, seed=0,
    ))
    rng = random.Random(args.seed)
    compressed = SamplingParams(temperature=0, max_tokens=2)
    uncompressed = SamplingParams(temperature=0, max_tokens=2,
                                  extra_args={"kv_compression": "none"})
    rows = []
    try:
        warmup = [random_prompt(rng, 256)]
        timed_generate(engine, warmup, compressed)
        timed_generate(engine, warmup, uncompressed)
        for length in lengths:
            prompts = [random_prompt(rng, length) for _ in range(args.num_prompts)]
            before = worker_stats(engine)
            compressed_seconds = timed_generate(engine, prompts, compressed)
            after = worker_stats(engine)
            uncompressed_seconds = timed_generate(engine, prompts, uncompressed)
            rows.append(CostRow(
                prompt_len=length,
                num_prompts=args.num_prompts,
                compressed_seconds=compressed_seconds,
                uncompressed_seconds=uncompressed_seconds,
                score_seconds=after["score_seconds"] - before["score_seconds"],
                compaction_seconds=after["seconds"] - before["seconds"],
                tokens_moved=after["tokens_moved"] - before["tokens_moved"],
                tokens_evicted=after["tokens_evicted"] - before["tokens_evicted"],
            ))
            print(format_row(rows[-1]), flush=True)
    finally:
        engine.engine_core.shutdown()
    return rows


def format_row(row: CostRow) -> str:
    return (
        f"{row.prompt_len:>7} x{row.num_prompts:<3} prefill {row.compressed_seconds:7.2f}s "
        f"(none: {row.uncompressed_seconds:7.2f}s, ratio {row.slowdown:5.3f})  "
        f"scoring {row.score_seconds:6.3f}s  compaction {row.compaction_seconds:6.3f}s  "
        f"-> {100 * row.compression_fraction:5.2f}% of prefill  "
        f"moved {row.tokens_moved} evicted {row.tokens_evicted} token-rows"
    )


def render(rows: list[dict[str, Any]]) -> str:
    """Scoring + compaction as a share of prefill time, per prompt length (the JSON's rows)."""
    table = [{**row, "pct": 100 * row["compression_fraction"]} for row in rows]
    return format_table(table, [
        ("prompt_len", "prompt tokens"), ("num_prompts", "prompts"),
        ("compressed_seconds", "prefill s (compressed)"),
        ("uncompressed_seconds", "prefill s (none)"), ("slowdown", "ratio"),
        ("score_seconds", "scoring s"), ("compaction_seconds", "compaction s"),
        ("pct", "% of prefill"), ("tokens_moved", "token-rows moved"),
        ("tokens_evicted", "token-rows evicted")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.compression_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".models/SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-lens", default="1024,2048,4096")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--method", default="pyramidkv")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="float32",
                        help="float32 by default: bf16 matmuls are ~20x slower on CPUs "
                        "without AVX512-BF16/AMX")
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM torch.compile the model (slow start, faster steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    command, machine = command_string(), machine_info(detect_device())
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, {machine['device']}; "
          f"{machine['date']}")
    rows = run(args)
    print(render([asdict(row) | {"compression_fraction": row.compression_fraction,
                                 "slowdown": row.slowdown} for row in rows]))
    if args.json:
        write_json(args.json, {
            "benchmark": "compression_cost",
            "command": command,
            "machine": machine,
            "settings": vars(args),
            "rows": [asdict(row) | {"compression_fraction": row.compression_fraction,
                                    "slowdown": row.slowdown} for row in rows],
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
