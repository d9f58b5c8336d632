"""What one ``schedule()`` costs with a long waiting queue: kvcompress's scheduler against
vLLM's own, the same config, requests and KV bytes, no model (issue 51, item 3).

    python -m benchmarks.studies.scheduler_cost                       # 64 x 2k and 256 x 8k
    python -m benchmarks.studies.scheduler_cost --cases 256x8192 --prefixes 4

Each case queues N requests of L prompt tokens that share a few prefixes (half of L, one of
``--prefixes`` each), in a KV pool that holds only a few of them: the first are admitted
and prefill, most wait for the whole run, as on a loaded server. Every step calls the
scheduler's ``schedule()`` (timed) and then ``update_from_output`` with what a model would
report (one sampled token for each request whose prompt is done; not timed). vLLM's side
runs with prefix caching on (its default), so its requests carry their block hashes as
EngineCore makes them. Reports the median and 90th percentile milliseconds of a schedule
over ``--steps`` steps after ``--warmup``, per side, and the target: kvcompress at most
2 ms at 64 x 2k, and at most 1.5x vanilla's plus 1 ms at 256 x 8k (and any other case).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json

MAX_TOKENS = 64  # each request's output
# A model's config is all the schedulers read (layers, heads, head size): no weights load.
DEFAULT_MODEL = ".models/SmolLM2-135M-Instruct"


def build_scheduler(model: str, compressed: bool, kv_bytes: int, max_model_len: int,
                    max_num_seqs: int) -> Any:
    """vLLM's scheduler or kvcompress's, over ``kv_bytes`` of KV cache, as EngineCore makes
    it (prefix caching on, its block hasher for requests)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from kvcompress.engine.sched.scheduler import KVCompressScheduler

    additional = {"kv_compression": "pyramidkv"} if compressed else {}
    args = EngineArgs(model=model, dtype="float32", max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                      additional_config=additional, enforce_eager=True)
    config = args.create_engine_config()
    hf = config.model_config.hf_text_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    spec = FullAttentionSpec(block_size=config.cache_config.block_size,
                             num_kv_heads=hf.num_key_value_heads,
                             head_size=getattr(hf, "head_dim", None)
                             or hf.hidden_size // hf.num_attention_heads,
                             dtype=torch.float32)
    per_layer = kv_bytes // len(layers)
    num_blocks = per_layer // spec.page_size_bytes
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        # One allocation every layer's blocks live in, as vLLM 0.32 lays it out.
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * spec.page_size_bytes * len(layers),
                                        layers=layers, layer_stride=0, block_stride=0)],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    config.cache_config.num_gpu_blocks = num_blocks  # as EngineCore sets it after profiling
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    cls = KVCompressScheduler if compressed else Scheduler
    scheduler = cls(config, kv_config, StructuredOutputManager(config), block_size=block_size,
                    hash_block_size=hash_block_size, log_stats=True)
    return scheduler, hash_block_size


def make_requests(count: int, length: int, prefixes: int, hash_block_size: int,
                  seed: int = 0) -> list[Any]:
    """``count`` requests of ``length`` tokens, each one of ``prefixes`` shared halves and
    its own half, with vLLM's block hasher (as EngineCore gives them)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_block_size, hash_fn)
    rng = random.Random(seed)
    shared = [[rng.randrange(1000, 30000) for _ in range(length // 2)]
              for _ in range(prefixes)]
    requests = []
    for index in range(count):
        own = [rng.randrange(1000, 30000) for _ in range(length - length // 2)]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        params.update_from_generation_config({}, None)
        requests.append(Request(f"r{index}", shared[index % prefixes] + own, params, None,
                                block_hasher=hasher))
    return requests


def fake_output(scheduler: Any, scheduler_output: Any) -> Any:
    """What a model reports: a token for each scheduled request whose prompt is done, and on
    kvcompress's side a shared prefix's segment request's plan (its rows kept to
    ``KEPT_TOKENS`` in whole pages, as a worker reports it), so that segments are filed,
    read and compacted as when a model runs. Requests' own prompts stay uncompressed."""
    from vllm.v1.outputs import ModelRunnerOutput

    from kvcompress.engine.messages import REPORT_ATTR, Compaction, WorkerReport

    requests = scheduler.requests
    segments = getattr(scheduler, "segments", None)
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled, plans = [], {}
    for request_id in req_ids:
        request = requests.get(request_id)
        done = request is not None and (request.num_computed_tokens
                                        >= request.num_prompt_tokens)
        sampled.append([7] if done else [])
        if done and segments is not None and segments.is_segment(request_id):
            plans[request_id] = segment_plan(scheduler, request)
    output = ModelRunnerOutput(req_ids=req_ids,
                               req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=sampled)
    if plans:
        setattr(output, REPORT_ATTR, WorkerReport(compactions={
            request_id: Compaction(requests[request_id].num_prompt_tokens, lengths,
                                   kind="deferred")
            for request_id, lengths in plans.items()}))
    return output


KEPT_TOKENS = 512  # a segment's rows after its plan (the default budget)


def segment_plan(scheduler: Any, request: Any) -> Any:
    """Per row, the physical tokens a segment request's rows keep: whole pages dropped from
    the end of the part it computed itself, down to ``KEPT_TOKENS``."""
    pages = scheduler.page_manager.shards[0]
    page_size = pages.layout.page_size
    lengths = pages.physical_lengths(request.request_id)
    state = pages.tables.states[request.request_id]
    shared = 0 if state.shared is None else state.shared
    whole = lengths // page_size
    keep = max(1, KEPT_TOKENS // page_size)
    drop = (whole - shared - keep).clip(min=0)
    return lengths - drop * page_size


def run_side(args: argparse.Namespace, compressed: bool, count: int,
             length: int) -> dict[str, Any]:
    scheduler, hash_block_size = build_scheduler(args.model, compressed, args.kv_bytes,
                                                 length, max(count, 8))
    # Prompt and output together fill ``length`` (the model's 8,192 positions at 8k).
    prompt = length - MAX_TOKENS
    for request in make_requests(count, prompt, args.prefixes, hash_block_size):
        scheduler.add_request(request)
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        output = scheduler.schedule()
        elapsed = time.perf_counter() - started
        scheduler.update_from_output(output, fake_output(scheduler, output))
        if step >= args.warmup:
            times.append(elapsed * 1e3)
    times.sort()
    made = getattr(getattr(scheduler, "segments", None), "made", None)
    return {"median_ms": statistics.median(times), "segments_made": made,
            "p90_ms": times[int(0.9 * (len(times) - 1))],
            "waiting_at_end": len(scheduler.waiting), "running_at_end": len(scheduler.running)}


def run_case(args: argparse.Namespace, case: str) -> dict[str, Any]:
    count, length = (int(part) for part in case.split("x"))
    vanilla = run_side(args, False, count, length)
    ours = run_side(args, True, count, length)
    # Issue 51's targets: 2 ms at 64 x 2k; 1.5x vanilla's plus 1 ms at 256 x 8k (and others).
    limit = 2.0 if (count, length) == (64, 2048) else 1.5 * vanilla["median_ms"] + 1.0
    return {"case": f"{count} waiting x {length} tokens", "vanilla": vanilla,
            "kvcompress": ours, "ratio": ours["median_ms"] / vanilla["median_ms"],
            "limit_ms": limit, "meets_target": ours["median_ms"] <= limit}


TABLE_COLUMNS = [("case", "waiting queue"), ("vanilla_ms", "vanilla ms"),
                 ("kvcompress_ms", "kvcompress ms"), ("ratio", "ratio"),
                 ("limit_ms", "limit ms"), ("meets_target", "met")]


def render(results: list[dict[str, Any]]) -> str:
    return format_table(table_rows(results), TABLE_COLUMNS)


def table_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"case": r["case"], "vanilla_ms": r["vanilla"]["median_ms"],
             "kvcompress_ms": r["kvcompress"]["median_ms"], "ratio": r["ratio"],
             "limit_ms": r["limit_ms"], "meets_target": r["meets_target"]} for r in results]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.scheduler_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--cases", default="64x2048,256x8192",
                        help="comma-separated COUNTxLENGTH waiting queues")
    parser.add_argument("--prefixes", type=int, default=4,
                        help="shared prefixes (half of each prompt) among the requests")
    parser.add_argument("--kv-bytes", type=int, default=1 << 30,
                        help="KV-cache bytes on both sides (small: most requests wait)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--output-json", type=Path,
                        default=RESULTS_DIR / "scheduler_cost.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = [run_case(args, case) for case in args.cases.split(",")]
    print(render(results))
    write_json(args.output_json, {"command": command_string(sys.argv),
                                  "machine": machine_info("cpu"), "settings": vars(args) | {
                                      "output_json": str(args.output_json)},
                                  "results": results})
    return 0 if all(r["meets_target"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
