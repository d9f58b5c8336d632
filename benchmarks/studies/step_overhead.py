"""Host work per engine step, at Llama-3-8B shapes, without a model: what the scheduler and
the worker do in Python / NumPy around every forward pass.

    python -m benchmarks.studies.step_overhead      # 256 decoding requests, +- a 32k prefill
    python -m benchmarks.studies.step_overhead --num-decoding 64 --decode-len 4096

Per step: the scheduler reserves each running request's next slots in pages and ships the page
deltas (``PageManager``); the worker mirrors them and builds the step's page tables, slot
mapping and lengths (``WorkerKVState.prepare_step``), then advances its lengths
(``finish_step``). With a request waiting, the admission check (``AdmissionPlanner.admits``)
runs over the running set. Three cases: only decoding requests; the same plus one long prompt
at its last prefill chunk (an uncompressed row 2048 pages wide); and decoding with churn, one
request ending and a new one joining every step (the batch's membership changes, as in real
serving). Where vLLM is installed, the CPU attention kernel's per-step ``prepare`` is timed
too. Needs only torch + numpy otherwise: it runs on the bare GPU box, where tables are built
on the host all the same. Median milliseconds per step over ``--steps`` steps."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from kvcompress.engine.sched.admission import AdmissionPlanner
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageManager
from kvcompress.settings.config import KVCompressionConfig

TARGET_MS = 2.0  # issue 17: host work per step at these shapes


def fake_request(request_id: str, prompt: int, computed: int, max_tokens: int) -> Any:
    """What the admission planner reads of a vLLM request."""
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=prompt,
                           num_computed_tokens=computed, num_tokens=computed + 1,
                           num_output_tokens=computed + 1 - prompt, max_tokens=max_tokens,
                           sampling_params=SimpleNamespace(extra_args=None))


def cpu_kernel_prepare(layout: PageLayout) -> Callable[[Any], Any] | None:
    """The CPU attention kernel's per-step ``prepare``, or None without vLLM."""
    try:
        from kvcompress.attention.cpu_kernel import CpuPagedKernel
    except ImportError:
        return None
    return CpuPagedKernel(layout, torch.bfloat16).prepare


def run_case(args: argparse.Namespace, with_prefill: bool, churn: bool = False) -> dict[str, Any]:
    """Median ms per step of each part, with ``args.num_decoding`` decoding requests (and one
    prompt of ``args.prefill_len`` tokens at its last chunk when ``with_prefill``; one request
    replaced by a new one every step with ``churn``)."""
    rows = args.layers * args.kv_heads
    per_decoding = rows * (-(-(args.decode_len + args.steps) // args.page_size))
    total = ((args.num_decoding + 1) * per_decoding
             + rows * (-(-args.prefill_len // args.page_size)))
    layout = PageLayout(args.layers, args.kv_heads, args.head_size, args.page_size, 2, total)
    pages, worker = PageManager(layout), WorkerKVState(layout, torch.device("cpu"))
    decoding = [f"d{i}" for i in range(args.num_decoding)]
    for request_id in decoding:
        pages.allocate(request_id, args.decode_len)
    chunk_start = args.prefill_len - args.chunk
    if with_prefill:
        pages.allocate("prefill", chunk_start)
    worker.apply_deltas(pages.take_deltas())
    for request_id in decoding:
        worker.requests[request_id].lengths[:] = args.decode_len
    if with_prefill:
        worker.requests["prefill"].lengths[:] = chunk_start
    running = [fake_request(r, args.decode_len // 2, args.decode_len, args.decode_len)
               for r in decoding]
    planner = AdmissionPlanner(pages, KVCompressionConfig(), max_model_len=1 << 20,
                               max_num_batched_tokens=args.chunk, lookahead=512,
                               running=lambda: running)
    waiting = fake_request("waiting", 4096, 0, 256)
    waiting.num_tokens, waiting.num_output_tokens = 4096, 0

    kernel_prepare = cpu_kernel_prepare(layout)
    logical = dict.fromkeys(decoding, args.decode_len)
    num_new = np.array([1] * len(decoding) + ([args.chunk] if with_prefill else []))
    prompt_lens = np.array([args.decode_len // 2] * len(decoding)
                           + ([args.prefill_len] if with_prefill else []))
    copied: list[int] = []  # request tables copied into the step's class tables
    timings: dict[str, list[float]] = {"scheduler": [], "admission": [], "worker_prepare": [],
                                       "worker_finish": [], "kernel_prepare": []}
    for step in range(args.steps):
        if churn:  # the oldest request ends, a new one (as long as the others) joins
            ended = decoding.pop(0)
            pages.free(ended)
            worker.drop([ended])
            joined = f"j{step}"
            pages.allocate(joined, args.decode_len)
            worker.apply_deltas(pages.take_deltas())
            worker.requests[joined].lengths[:] = args.decode_len
            decoding.append(joined)
            logical[joined] = args.decode_len
            running.pop(0)
            running.append(fake_request(joined, args.decode_len // 2, args.decode_len,
                                        args.decode_len))
        req_ids = decoding + (["prefill"] if with_prefill else [])
        computed = np.array([logical[r] for r in decoding]
                            + ([chunk_start] if with_prefill else []))
        started = time.perf_counter()
        for request_id in decoding:
            pages.allocate(request_id, logical[request_id] + 1)
        if with_prefill:
            pages.allocate("prefill", args.prefill_len)
        deltas = pages.take_deltas()
        scheduled = time.perf_counter()
        planner.admits(waiting)
        admitted = time.perf_counter()
        worker.apply_deltas(deltas)
        copied_before = worker.tables.copied_requests
        batch = worker.prepare_step(req_ids, num_new, computed, prompt_lens,
                                    observation_windows=[8] * len(req_ids),
                                    wants_compression=[False] * len(req_ids))
        prepared = time.perf_counter()
        copied.append(worker.tables.copied_requests - copied_before)
        worker.finish_step(batch)
        finished = time.perf_counter()
        if kernel_prepare is not None:
            kernel_prepare(batch)
        kernel_prepared = time.perf_counter()
        for request_id in decoding:
            logical[request_id] += 1
        if with_prefill:  # the same last chunk again next step
            worker.requests["prefill"].lengths[:] = chunk_start
        for request in running:
            request.num_computed_tokens += 1
            request.num_tokens += 1
            request.num_output_tokens += 1
        for key, seconds in (("scheduler", scheduled - started),
                             ("admission", admitted - scheduled),
                             ("worker_prepare", prepared - admitted),
                             ("worker_finish", finished - prepared),
                             ("kernel_prepare", kernel_prepared - finished)):
            timings[key].append(seconds * 1e3)
    medians = {f"{key}_ms": statistics.median(values) for key, values in timings.items()}
    medians["total_ms"] = sum(value for key, value in medians.items()
                              if key != "kernel_prepare_ms")
    if kernel_prepare is None:
        medians["kernel_prepare_ms"] = None
    classes = batch.tables.classes
    name = f"{len(decoding)} decoding" + (f" + {args.prefill_len}-token prefill"
                                          if with_prefill else "")
    return {"case": name + (", one replaced per step" if churn else ""),
            "table_widths": [table.width for table in classes],
            "page_table_mb": sum(table.tables.numel() * table.tables.element_size()
                                 for table in classes) / 2**20,
            "tables_copied_per_step": statistics.median(copied),
            "pages_in_batch": int(sum(worker.requests[r].table.total_pages for r in req_ids)),
            **medians, "meets_target": medians["total_ms"] <= TARGET_MS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.step_overhead",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-decoding", type=int, default=256)
    parser.add_argument("--decode-len", type=int, default=1024,
                        help="tokens each decoding request holds per row")
    parser.add_argument("--prefill-len", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048, help="the prompt's last chunk")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-json", type=Path, default=RESULTS_DIR / "step_overhead.json")
    return parser


def render(rows: list[dict[str, Any]]) -> str:
    columns = [("case", "case"), ("scheduler_ms", "scheduler"), ("admission_ms", "admission"),
               ("worker_prepare_ms", "worker prepare"), ("worker_finish_ms", "worker finish"),
               ("total_ms", "total ms"), ("kernel_prepare_ms", "CPU kernel prepare"),
               ("table_widths", "table widths"), ("page_table_mb", "tables MB"),
               ("tables_copied_per_step", "tables copied / step")]
    return format_table(rows, columns)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # the scheduler and the worker's host side are single threads
    rows = [run_case(args, with_prefill=False), run_case(args, with_prefill=True),
            run_case(args, with_prefill=False, churn=True)]
    print(render(rows))
    print(f"target: <= {TARGET_MS} ms per step")
    report = {"benchmark": "step_overhead", "command": command_string([sys.argv[0], *argv]),
              "machine": machine_info("cuda" if torch.cuda.is_available() else "cpu"),
              "settings": vars(args) | {"output_json": str(args.output_json)},
              "target_ms": TARGET_MS, "cases": rows}
    write_json(args.output_json, report)
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
