"""KV memory one request holds on a hybrid (sliding-window + full attention) model: vanilla
vLLM's hybrid KV-cache manager against kvcompress, per prompt length, step by step.

Each prompt runs alone through a vanilla engine and a kvcompress engine with the same KV
memory; after every engine step the bytes the request holds are read from the scheduler
(vanilla: blocks in use x bytes per block; kvcompress: pages in use x page bytes). The figure
that matters is the steady state while the request decodes (``decode_bytes``), where
kvcompress holds the compressed full-attention rows plus each sliding row's window.
Both engines run vLLM's default, prefix caching on (blocks a finished request leaves cached
count as free, as vLLM counts them; kvcompress keeps no entries on models with sliding
layers); ``--no-prefix-caching`` turns it off (recorded, and said above the table).

    python -m benchmarks.studies.hybrid_memory --model .models/gemma-3-270m --prompt-lens 2048,8000
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

from benchmarks.report import (
    command_string,
    format_table,
    machine_info,
    with_prefix_caching,
    write_json,
)
from benchmarks.specs import add_prefix_caching_option, detect_device

DEFAULT_MODEL = ".models/gemma-3-270m"


def held_bytes(engine: Any, compressed: bool, memory: int) -> int:
    """KV bytes held by the engine's requests right now."""
    scheduler = engine.engine_core.engine_core.scheduler
    if compressed:
        pages = scheduler.page_manager
        return (pages.total_pages - pages.num_available) * pages.layout.page_bytes
    pool = scheduler.kv_cache_manager.block_pool
    used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # less vLLM's null block
    return used * (memory // pool.num_gpu_blocks)


def run_one(args: argparse.Namespace, prompt: list[int], compression: dict | None) -> list[int]:
    """Bytes held after each engine step while ``prompt`` prefills and decodes alone."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, enforce_eager=True, seed=0,
        max_model_len=max(args.lengths) + args.max_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        additional_config=compression or {},
    ))
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        held = []
        while engine.has_unfinished_requests():
            engine.step()
            held.append(held_bytes(engine, compression is not None, args.kv_cache_bytes))
        return held
    finally:
        engine.engine_core.shutdown()


def run(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    compression = {"kv_compression": args.method, "kv_budget": args.budget}
    rows = []
    for length in args.lengths:
        prompt = [rng.randrange(100, 30000) for _ in range(length)]
        vanilla = run_one(args, prompt, None)
        ours = run_one(args, prompt, compression)
        # The last step frees everything; the one before it is the request decoding.
        row = {
            "prompt_len": length,
            "vanilla_peak_bytes": max(vanilla), "kvcompress_peak_bytes": max(ours),
            "vanilla_decode_bytes": vanilla[-2], "kvcompress_decode_bytes": ours[-2],
            "vanilla_steps": vanilla, "kvcompress_steps": ours,
        }
        row["x_vanilla"] = row["vanilla_decode_bytes"] / max(1, row["kvcompress_decode_bytes"])
        rows.append(row)
        print(f"{length:>7} tokens: while decoding vanilla {vanilla[-2] / 2**20:8.2f} MiB, "
              f"kvcompress {ours[-2] / 2**20:8.2f} MiB ({row['x_vanilla']:.2f}x less); "
              f"peaks {max(vanilla) / 2**20:.2f} / {max(ours) / 2**20:.2f} MiB", flush=True)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """KV MiB held per prompt length: while decoding (the figure that matters) and at peak."""
    mib = 2 ** 20
    table = [{"prompt_len": row["prompt_len"],
              "vanilla": row["vanilla_decode_bytes"] / mib,
              "ours": row["kvcompress_decode_bytes"] / mib, "x": row["x_vanilla"],
              "vanilla_peak": row["vanilla_peak_bytes"] / mib,
              "ours_peak": row["kvcompress_peak_bytes"] / mib} for row in rows]
    return format_table(table, [
        ("prompt_len", "prompt tokens"), ("vanilla", "vanilla MiB decoding"),
        ("ours", "kvcompress MiB decoding"), ("x", "x less"),
        ("vanilla_peak", "vanilla peak MiB"), ("ours_peak", "kvcompress peak MiB")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.hybrid_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-lens", default="2048,8000")
    parser.add_argument("--method", default="pyramidkv")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    add_prefix_caching_option(parser)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.lengths = [int(value) for value in args.prompt_lens.split(",")]
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (a request ending in its prefill step is not "
                     "compressed)")
    # The scheduler is read in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    command, machine = command_string(), machine_info(detect_device())
    print(f"command: {command}")
    rows = run(args)
    settings = {key: value for key, value in vars(args).items() if key != "json"}
    print(with_prefix_caching(render(rows), settings))
    if args.json:
        write_json(args.json, {"benchmark": "hybrid_memory", "command": command,
                               "machine": machine, "settings": settings, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
