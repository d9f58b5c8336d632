"""Kernel microbenchmarks: paged decode attention (also with fused decode scores), cache moves and
the compression step.

Runs on a bare machine with torch + triton only (no vLLM, no install), from the repository
root (``-m`` puts it on the path, so ``kvcompress`` imports from the checkout):

    python -m benchmarks.studies.kernels --quick            # H200: well under 3 minutes
    python -m benchmarks.studies.kernels --smoke            # tiny; CPU uses the interpreter
    python -m benchmarks.studies.kernels --json results/kernels.json

Shapes follow Llama-3-8B (32 layers, 32 query heads, 8 KV heads, head dim 128, bf16). Bandwidth is
bytes the kernel must touch (K/V read, moves read + write) over time, against --peak-gbps
(default 4300, an H200's measured copy bandwidth). Each section first checks the Triton kernel
against the torch reference on a small input and reports the max error. The decode section also
checks and times fp8 pages (``--kv-cache-dtype fp8``: a uint8 pool of e4m3 codes, half the bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors

# imported once TRITON_INTERPRET is set: Triton may read it on import
from kvcompress.kernels import (  # noqa: E402
    DecodeScoreTarget,
    fp8_codes,
    move_kv_ref,
    move_kv_triton,
    paged_attention_ref,
    paged_attention_triton,
    plan_hole_filling_moves,
    positions_to_slots,
    window_scores_triton,
    write_kv_ref,
    write_kv_triton,
)

NUM_LAYERS, NUM_QUERY_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 32, 8, 128
# fp8 pages: scales of the order a checkpoint's K / V scales take for values in [-1, 1)
FP8_SCALES = dict(k_scale=0.01, v_scale=0.005)


@dataclass
class Row:
    section: str
    case: str
    impl: str
    time_us: float
    gbps: float | None = None
    pct_peak: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


class Timer:
    """Median time of ``fn``: CUDA events with warmup and an L2 flush before each run on GPU."""

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if ON_GPU else None

    def __call__(self, fn: Callable[[], object]) -> float:
        if not ON_GPU:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


@dataclass
class PagedBatch:
    query: torch.Tensor
    pool: torch.Tensor
    page_tables: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_kv_len: int


def build_paged_batch(
    kv_lens: torch.Tensor, query_len: int, group: int, page_size: int, dtype: torch.dtype,
    device: torch.device, head_size: int = HEAD_SIZE,
) -> PagedBatch:
    """Per-head pages scattered at random over a fresh pool (kv_lens: int [B, H_kv], CPU)."""
    batch, num_kv_heads = kv_lens.shape
    pages_per_head = (kv_lens + page_size - 1) // page_size
    total_pages = int(pages_per_head.sum())
    max_pages = int(pages_per_head.max())
    order = torch.randperm(total_pages, device=device, dtype=torch.int64).to(torch.int32)
    counts = pages_per_head.flatten().to(device)
    first = torch.cumsum(counts, 0) - counts
    columns = torch.arange(max_pages, device=device)
    index = (first[:, None] + columns[None, :]).clamp_max(total_pages - 1)
    tables = torch.where(columns[None, :] < counts[:, None], order[index], 0)
    pool = torch.empty(total_pages, 2, page_size, head_size, dtype=dtype, device=device)
    pool.uniform_(-1, 1)
    query = torch.randn(batch * query_len, num_kv_heads * group, head_size, device=device)
    return PagedBatch(
        query=query.to(dtype),
        pool=pool,
        page_tables=tables.view(batch, num_kv_heads, max_pages).to(torch.int32),
        kv_lens=kv_lens.to(device=device, dtype=torch.int32),
        query_start_loc=(torch.arange(batch + 1, device=device) * query_len).to(torch.int32),
        max_query_len=query_len,
        max_kv_len=int(kv_lens.max()),
    )


def attention_bytes(batch: PagedBatch) -> int:
    kv = int(batch.kv_lens.sum()) * 2 * batch.pool.shape[3] * batch.pool.element_size()
    return kv + 2 * batch.query.numel() * batch.query.element_size()


def fp8_pool(pool: torch.Tensor, kv_fp8: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The uint8 pool of fp8 pages holding ``pool``'s K and V at ``FP8_SCALES``."""
    return torch.stack([fp8_codes(pool[:, 0], kv_fp8, FP8_SCALES["k_scale"]),
                        fp8_codes(pool[:, 1], kv_fp8, FP8_SCALES["v_scale"])], dim=1)


def check_row(name: str, errors: dict[str, float], ok: bool) -> Row:
    """A reference check's row: ok or FAIL, with the max error of each case."""
    return Row("check", name, "triton", 0.0,
               note=("ok " if ok else "FAIL ") + str({k: f"{v:.1e}" for k, v in errors.items()}),
               extra={"max_abs_error": errors, "ok": ok})


def bandwidth(row: Row, num_bytes: int, peak_gbps: float) -> Row:
    row.gbps = num_bytes / (row.time_us * 1e-6) / 1e9
    row.pct_peak = 100.0 * row.gbps / peak_gbps
    return row


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ----------------------------------------------------------------------------- sections


def check_attention(device: torch.device, dtype: torch.dtype) -> Row:
    """Triton vs torch reference on a small mixed batch (decode rows + a prefill chunk)."""
    lens = torch.tensor([[300, 41, 77, 1000, 5, 64, 128, 260]] * 3)
    batch = build_paged_batch(lens, query_len=1, group=4, page_size=16, dtype=dtype,
                              device=device, head_size=HEAD_SIZE)
    errors = {}
    for splits in (1, 4):
        out_ref, out = torch.empty_like(batch.query), torch.empty_like(batch.query)
        args = (batch.query, batch.pool, batch.page_tables, batch.kv_lens, batch.query_start_loc,
                HEAD_SIZE**-0.5)
        paged_attention_ref(*args, out_ref)
        paged_attention_triton(*args, out, num_splits=splits)
        errors[f"splits={splits}"] = max_error(out, out_ref)
    chunk = build_paged_batch(torch.tensor([[90, 70, 33, 50, 64, 40, 17, 100]]), query_len=17,
                              group=4, page_size=16, dtype=dtype, device=device)
    out_ref, out = torch.empty_like(chunk.query), torch.empty_like(chunk.query)
    args = (chunk.query, chunk.pool, chunk.page_tables, chunk.kv_lens, chunk.query_start_loc,
            HEAD_SIZE**-0.5)
    paged_attention_ref(*args, out_ref)
    paged_attention_triton(*args, out)
    errors["prefill"] = max_error(out, out_ref)
    ok = max(errors.values()) < (2e-2 if dtype != torch.float32 else 1e-4)
    return check_row("attention vs reference", errors, ok)


def check_fp8(device: torch.device, dtype: torch.dtype) -> Row:
    """fp8 pages (e4m3, e5m2): Triton vs the torch reference, attention (split-K too) and the
    write (its bytes must be identical)."""
    lens = torch.tensor([[300, 41, 77, 1000, 5, 64, 128, 260]] * 2)
    batch = build_paged_batch(lens, query_len=1, group=4, page_size=16, dtype=dtype,
                              device=device)
    errors, ok = {}, True
    for kv_fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        name = str(kv_fp8).split("_")[-1]
        pool = fp8_pool(batch.pool, kv_fp8)
        fp8 = dict(kv_fp8=kv_fp8, **FP8_SCALES)
        args = (batch.query, pool, batch.page_tables, batch.kv_lens, batch.query_start_loc,
                HEAD_SIZE**-0.5)
        out_ref = torch.empty_like(batch.query)
        paged_attention_ref(*args, out_ref, **fp8)
        for splits in (1, 4):
            out = torch.empty_like(batch.query)
            paged_attention_triton(*args, out, num_splits=splits, **fp8)
            errors[f"{name} splits={splits}"] = max_error(out, out_ref)
        key = torch.randn(64, NUM_KV_HEADS, HEAD_SIZE, device=device).to(dtype) * 0.05
        slots = torch.randperm(pool.shape[0] * 16, device=device)[: key.shape[0] * NUM_KV_HEADS]
        slots = slots.view(key.shape[0], NUM_KV_HEADS)
        written, expected = pool.clone(), pool.clone()
        write_kv_triton(key, key, written, slots, **fp8)
        write_kv_ref(key, key, expected, slots, **fp8)
        ok = ok and torch.equal(written, expected)
    ok = ok and max(errors.values()) < (2e-2 if dtype != torch.float32 else 1e-4)
    return check_row("fp8 pages vs reference", errors, ok)


def bench_decode(args, timer: Timer, device: torch.device, dtype: torch.dtype) -> list[Row]:
    rows = [check_attention(device, dtype), check_fp8(device, dtype)]
    if args.smoke:
        cases = [(2, 64, None), (3, 200, 48)]
    elif args.quick:
        cases = [(1, 8192, None), (1, 32768, None), (16, 8192, None), (64, 8192, None),
                 (128, 8192, None), (16, 32768, None), (64, 32768, 2048), (128, 32768, 2048)]
    else:
        cases = [(b, c, None) for b in (1, 4, 16, 32, 64, 128) for c in (8192, 16384, 32768)]
        cases += [(b, 32768, budget) for b in (16, 64, 128) for budget in (1024, 2048, 4096)]
    generator = torch.Generator().manual_seed(0)
    for batch_size, context, budget in cases:
        if budget is None:
            lens = torch.full((batch_size, NUM_KV_HEADS), context)
            name = f"B={batch_size} ctx={context}"
        else:  # compressed: per-head lengths spread around the budget (Ada-style allocation)
            spread = torch.rand(batch_size, NUM_KV_HEADS, generator=generator) * 1.5 + 0.25
            lens = (spread * budget).long().clamp(16, context)
            name = f"B={batch_size} ctx={context} compressed~{budget}/head"
        rows.extend(bench_decode_case(args, timer, device, dtype, lens, name,
                                      with_sdpa=budget is None and batch_size * context <= 2**19))
        release_memory()
    return rows


def bench_decode_case(
    args, timer: Timer, device: torch.device, dtype: torch.dtype, lens: torch.Tensor, name: str,
    with_sdpa: bool,
) -> list[Row]:
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    batch = build_paged_batch(lens, 1, group, 16, dtype, device)
    out = torch.empty_like(batch.query)
    call_args = (batch.query, batch.pool, batch.page_tables, batch.kv_lens,
                 batch.query_start_loc, HEAD_SIZE**-0.5, out)
    hints = dict(max_query_len=1, max_kv_len=batch.max_kv_len)
    seconds = timer(lambda: paged_attention_triton(*call_args, **hints))
    rows = [bandwidth(Row("decode", name, "triton paged", seconds * 1e6),
                      attention_bytes(batch), args.peak_gbps)]
    batch.pool = fp8_pool(batch.pool)  # the same K/V as fp8 (e4m3) pages
    fp8_args = (batch.query, batch.pool, *call_args[2:])
    seconds = timer(lambda: paged_attention_triton(*fp8_args, kv_fp8=torch.float8_e4m3fn,
                                                   **FP8_SCALES, **hints))
    rows.append(bandwidth(Row("decode", name, "triton paged fp8", seconds * 1e6),
                          attention_bytes(batch), args.peak_gbps))
    if ON_GPU and with_sdpa:
        rows.append(bench_dense_sdpa(timer, batch, int(lens.max()), args.peak_gbps, name))
    return rows


def release_memory() -> None:
    if ON_GPU:
        torch.cuda.empty_cache()


def bench_dense_sdpa(timer: Timer, batch: PagedBatch, context: int, peak: float, name: str) -> Row:
    """Reference point: torch SDPA on the same bytes stored densely (no paging, equal heads)."""
    batch_size = batch.kv_lens.shape[0]
    keys = torch.randn(batch_size, NUM_KV_HEADS, context, HEAD_SIZE, device=batch.pool.device,
                       dtype=batch.pool.dtype)
    values = torch.randn_like(keys)
    query = batch.query.view(batch_size, NUM_QUERY_HEADS, 1, HEAD_SIZE)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        query, keys, values, enable_gqa=True
    )
    seconds = timer(fn)
    return bandwidth(Row("decode", name, "torch sdpa dense", seconds * 1e6),
                     attention_bytes(batch), peak)


def bench_prefill(args, timer: Timer, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Last prefill chunk on prior context: reported in TFLOP/s (compute bound)."""
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    cases = [(1, 32, 64)] if args.smoke else [(1, 2048, 8192), (4, 2048, 8192), (1, 4096, 32768)]
    rows = []
    for batch_size, chunk, prompt in cases:
        lens = torch.full((batch_size, NUM_KV_HEADS), prompt)
        batch = build_paged_batch(lens, chunk, group, 16, dtype, device)
        seconds = time_attention(timer, batch)
        context = prompt - chunk
        visible = chunk * context + chunk * (chunk + 1) / 2  # keys seen, summed over queries
        flops = 4 * batch_size * NUM_QUERY_HEADS * HEAD_SIZE * visible
        rows.append(Row("prefill", f"B={batch_size} chunk={chunk} prompt={prompt}",
                        "triton paged", seconds * 1e6,
                        note=f"{flops / seconds / 1e12:.1f} TFLOP/s",
                        extra={"tflops": flops / seconds / 1e12}))
        del batch
        release_memory()
    return rows


def time_attention(timer: Timer, batch: PagedBatch) -> float:
    out = torch.empty_like(batch.query)
    return timer(lambda: paged_attention_triton(
        batch.query, batch.pool, batch.page_tables, batch.kv_lens, batch.query_start_loc,
        HEAD_SIZE**-0.5, out, max_query_len=batch.max_query_len, max_kv_len=batch.max_kv_len))


def score_target(batch: PagedBatch, width: int) -> DecodeScoreTarget:
    """Every request scored, mean over the group, the last ``width`` positions of each row."""
    device = batch.pool.device
    batch_size = batch.kv_lens.shape[0]
    begin = (batch.kv_lens.long() - width).clamp(min=0)
    return DecodeScoreTarget(
        slots=torch.arange(batch_size, dtype=torch.int32, device=device),
        begin=begin,
        reduce_codes=torch.zeros(batch_size, dtype=torch.int64, device=device),
        mass=torch.zeros(batch_size, NUM_KV_HEADS, width, device=device),
    )


def check_decode_scores(device: torch.device, dtype: torch.dtype) -> Row:
    """Fused scores (Triton, with and without split-K) vs the torch reference."""
    lens = torch.tensor([[300, 41, 77, 200, 5, 64, 128, 260]] * 3)
    batch = build_paged_batch(lens, query_len=1, group=4, page_size=16, dtype=dtype,
                              device=device)
    args = (batch.query, batch.pool, batch.page_tables, batch.kv_lens, batch.query_start_loc,
            HEAD_SIZE**-0.5)
    want = score_target(batch, 96)
    paged_attention_ref(*args, torch.empty_like(batch.query), decode_scores=want)
    errors = {}
    for splits in (1, 4):
        got = score_target(batch, 96)
        paged_attention_triton(*args, torch.empty_like(batch.query), num_splits=splits,
                               decode_scores=got)
        errors[f"splits={splits}"] = max_error(got.mass, want.mass)
    ok = max(errors.values()) < 1e-4  # probabilities from fp32 logits of the same inputs
    return check_row("fused decode scores vs reference", errors, ok)


def bench_decode_scores(args, timer: Timer, device: torch.device,
                        dtype: torch.dtype) -> list[Row]:
    """One layer's decode attention without and with fused decode scores (every request scored
    over its last W positions), and the torch second pass it replaces where it fits."""
    rows = [check_decode_scores(device, dtype)]
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    cases = [(2, 64, 16)] if args.smoke else [(16, 8192, 512), (64, 8192, 512),
                                              (64, 32768, 1024)]
    for batch_size, context, width in cases:
        lens = torch.full((batch_size, NUM_KV_HEADS), context)
        batch = build_paged_batch(lens, 1, group, 16, dtype, device)
        rows.extend(bench_decode_scores_case(args, timer, batch, width,
                                             f"B={batch_size} ctx={context} W={width}"))
        del batch
        release_memory()
    return rows


def bench_decode_scores_case(args, timer: Timer, batch: PagedBatch, width: int,
                             name: str) -> list[Row]:
    out = torch.empty_like(batch.query)
    call_args = (batch.query, batch.pool, batch.page_tables, batch.kv_lens,
                 batch.query_start_loc, HEAD_SIZE**-0.5, out)
    hints = dict(max_query_len=1, max_kv_len=batch.max_kv_len)
    target = score_target(batch, width)
    plain = timer(lambda: paged_attention_triton(*call_args, **hints))
    fused = timer(lambda: paged_attention_triton(*call_args, decode_scores=target, **hints))
    rows = [
        bandwidth(Row("decode_scores", name, "attention", plain * 1e6),
                  attention_bytes(batch), args.peak_gbps),
        bandwidth(Row("decode_scores", name, "attention + fused scores", fused * 1e6,
                      note=f"+{100 * (fused / plain - 1):.0f}%"),
                  attention_bytes(batch), args.peak_gbps),
    ]
    batch_size, context = batch.kv_lens.shape[0], batch.max_kv_len
    if ON_GPU and batch_size * context <= 2**19:
        second = time_torch_decode_scores(timer, batch, width)
        rows.append(Row("decode_scores", name, "torch second pass (replaced)", second * 1e6,
                        note=f"{100 * second / plain:.0f}% of attention"))
    return rows


def time_torch_decode_scores(timer: Timer, batch: PagedBatch, width: int) -> float:
    """``attention.decode_scores.score_decode_layer`` over the same batch, as one layer."""
    from kvcompress.attention.decode_scores import score_decode_layer
    from kvcompress.paging.page_format import GPU_PAGE_FORMAT
    from kvcompress.step import DecodeScoring

    device = batch.pool.device
    batch_size, num_kv_heads, num_pages = batch.page_tables.shape
    lengths = batch.kv_lens.long()
    plan = DecodeScoring(
        tokens=torch.arange(batch_size, device=device),
        page_ids=batch.page_tables.long()[None].contiguous(),
        lengths=lengths[None],
        key_positions=torch.arange(num_pages * batch.pool.shape[2], device=device),
        prompt_kept=(lengths - width).clamp(min=0)[None],
        offsets=torch.arange(width, device=device),
        group_reduce="mean",
        reduce_codes=None,
        mass=torch.zeros(batch_size, 1, num_kv_heads, width, device=device),
    )
    return timer(lambda: score_decode_layer(batch.query, batch.pool, GPU_PAGE_FORMAT, plan, 0,
                                            HEAD_SIZE**-0.5))


def bench_window_scores(args, timer: Timer, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Observation-window scores of one layer (window 32) at the end of a prompt."""
    group = NUM_QUERY_HEADS // NUM_KV_HEADS
    window = 8 if args.smoke else 32
    cases = [(1, 64)] if args.smoke else [(1, 8192), (1, 32768), (8, 8192)]
    rows = []
    for batch_size, prompt in cases:
        lens = torch.full((batch_size, NUM_KV_HEADS), prompt)
        batch = build_paged_batch(lens, window, group, 16, dtype, device)
        seconds = time_window_scores(timer, batch, window)
        key_bytes = int(batch.kv_lens.sum()) * HEAD_SIZE * batch.pool.element_size()
        row = Row("window_scores", f"B={batch_size} prompt={prompt} W={window}", "triton",
                  seconds * 1e6, note=f"x{NUM_LAYERS} layers = {seconds * NUM_LAYERS * 1e3:.2f} ms")
        rows.append(bandwidth(row, 2 * key_bytes, args.peak_gbps))  # two passes over K
        del batch
        release_memory()
    return rows


def time_window_scores(timer: Timer, batch: PagedBatch, window: int) -> float:
    batch_size = batch.kv_lens.shape[0]
    scores = torch.zeros(batch_size, NUM_KV_HEADS, batch.max_kv_len, device=batch.pool.device)
    starts = torch.zeros(batch_size, dtype=torch.int32, device=batch.pool.device)
    return timer(lambda: window_scores_triton(
        batch.query, batch.pool, batch.page_tables, batch.kv_lens, batch.query_start_loc,
        starts, HEAD_SIZE**-0.5, scores, max_window_len=window, max_kv_len=batch.max_kv_len))


def load_native_move() -> Callable | None:
    """The CUDA cache-move extension, when built (optional): ``move_kv(pool, src, dst)``."""
    try:
        from kvcompress import _C  # type: ignore[attr-defined]
    except Exception:
        return None
    native = getattr(_C, "move_kv", None)
    if native is None and hasattr(torch.ops, "kvcompress"):
        native = getattr(torch.ops.kvcompress, "move_kv", None)
    return native


def torch_index_copy_move(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Torch alternative: the pool as rows [pages * 2 * P, D], index_select + index_copy_."""
    page_size = pool.shape[2]
    flat = pool.view(-1, pool.shape[3])

    def rows(slots: torch.Tensor) -> torch.Tensor:
        base = (slots // page_size) * (2 * page_size) + slots % page_size
        return torch.cat([base, base + page_size])  # K rows then V rows

    src_rows, dst_rows = rows(src), rows(dst)
    flat.index_copy_(0, dst_rows, flat.index_select(0, src_rows))


def pyramid_budgets(average: int, prompt: int) -> list[int]:
    """PyramidKV-like per-layer budgets: 1.5x the average at the bottom down to 0.5x at the top."""
    return [min(prompt, int(average * (1.5 - layer / (NUM_LAYERS - 1)))) for layer in
            range(NUM_LAYERS)]


def bench_compression(args, timer: Timer, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Compaction of requests that just finished prefill: all 32 layers x 8 heads each."""
    rows = [check_moves(device, dtype)]
    if args.smoke:
        cases = [(1, 128, 32)]
        layers, heads = 2, 2
    else:
        cases = [(1, 8192, 2048), (1, 32768, 2048), (8, 8192, 2048), (4, 32768, 4096)]
        layers, heads = NUM_LAYERS, NUM_KV_HEADS
    native_move = load_native_move()
    for num_requests, prompt, average_budget in cases:
        rows.extend(bench_compression_case(args, timer, device, dtype, num_requests, prompt,
                                           average_budget, layers, heads, native_move))
        release_memory()
    return rows


def bench_compression_case(
    args, timer: Timer, device: torch.device, dtype: torch.dtype, num_requests: int, prompt: int,
    average_budget: int, layers: int, heads: int, native_move: Callable | None,
) -> list[Row]:
    page_size = 16
    rows = []
    name = f"R={num_requests} prompt={prompt} budget~{average_budget}"
    num_rows = num_requests * layers * heads
    pages_per_head = prompt // page_size
    pool = torch.empty(num_rows * pages_per_head, 2, page_size, HEAD_SIZE, dtype=dtype,
                       device=device)
    pool.uniform_(-1, 1)
    page_rows = torch.randperm(pool.shape[0], device=device).view(num_rows, pages_per_head)
    budgets = pyramid_budgets(average_budget, prompt)[:layers]
    counts = torch.tensor(budgets, device=device).repeat_interleave(heads).repeat(num_requests)
    max_keep = max(budgets)
    scores = torch.rand(num_rows, prompt, device=device)

    def select() -> torch.Tensor:
        top = scores.topk(max_keep, dim=1).indices  # best first
        columns = torch.arange(max_keep, device=device)
        top = torch.where(columns[None, :] < counts[:, None], top, prompt + columns[None, :])
        return top.sort(dim=1).values

    keep = select()
    plan = plan_hole_filling_moves(keep, counts)
    src = positions_to_slots(page_rows, plan.src_positions, page_size).flatten()
    dst = positions_to_slots(page_rows, plan.dst_positions, page_size).flatten()
    real = src >= 0
    src_compact, dst_compact = src[real], dst[real]
    num_moves = int(src_compact.numel())
    move_bytes = num_moves * 2 * 2 * HEAD_SIZE * pool.element_size()  # K+V, read+write

    t_select = timer(select)
    t_plan = timer(lambda: plan_hole_filling_moves(keep, counts))
    t_slots = timer(lambda: (positions_to_slots(page_rows, plan.src_positions, page_size),
                             positions_to_slots(page_rows, plan.dst_positions, page_size)))
    t_compact = timer(lambda: (src[src >= 0], dst[dst >= 0]))  # syncs (nonzero)
    info = {"moves": num_moves, "moved_fraction": num_moves / float(counts.sum())}
    move_impls: list[tuple[str, Callable[[], object]]] = [
        ("triton (padded -1 list)", lambda: move_kv_triton(pool, src, dst)),
        ("triton (compacted list)", lambda: move_kv_triton(pool, src_compact, dst_compact)),
        ("torch advanced indexing", lambda: move_kv_ref(pool, src_compact, dst_compact)),
        ("torch index_copy_", lambda: torch_index_copy_move(pool, src_compact, dst_compact)),
    ]
    if native_move is not None:
        move_impls.append(("kvcompress._C", lambda: native_move(pool, src_compact, dst_compact)))
    move_times = {}
    for impl, fn in move_impls:
        seconds = timer(fn)
        move_times[impl] = seconds
        rows.append(bandwidth(Row("move", name, impl, seconds * 1e6, extra=info), move_bytes,
                              args.peak_gbps))
    t_move = move_times["triton (padded -1 list)"]
    rows.append(Row(
        "compression_step", name, "select+plan+slots+triton move",
        (t_select + t_plan + t_slots + t_move) * 1e6,
        note=(f"select {t_select * 1e3:.2f} ms, plan {t_plan * 1e3:.2f}, slots "
              f"{t_slots * 1e3:.2f}, move {t_move * 1e3:.2f}; {num_moves} moves, "
              f"compacting the list {t_compact * 1e3:.2f} ms"),
        extra=info | {"select_us": t_select * 1e6, "plan_us": t_plan * 1e6,
                      "slots_us": t_slots * 1e6, "compact_us": t_compact * 1e6},
    ))
    return rows


def check_moves(device: torch.device, dtype: torch.dtype) -> Row:
    pool = torch.randn(64, 2, 16, HEAD_SIZE, device=device).to(dtype)
    slots = torch.randperm(64 * 16, device=device)
    src, dst = slots[:300], slots[300:600]
    expected, result = pool.clone(), pool.clone()
    move_kv_ref(expected, src, dst)
    move_kv_triton(result, src, dst)
    ok = torch.equal(expected, result)
    return Row("check", "move vs reference", "triton", 0.0, note="ok" if ok else "FAIL",
               extra={"ok": ok})


# ----------------------------------------------------------------------------- driver


def print_table(rows: list[Row]) -> None:
    header = f"{'section':<17}{'case':<42}{'impl':<30}{'time_us':>11}{'GB/s':>9}{'%peak':>7}  note"
    print(header)
    print("-" * len(header))
    for row in rows:
        gbps = f"{row.gbps:9.0f}" if row.gbps is not None else " " * 9
        pct = f"{row.pct_peak:7.1f}" if row.pct_peak is not None else " " * 7
        print(f"{row.section:<17}{row.case[:41]:<42}{row.impl[:29]:<30}{row.time_us:11.1f}"
              f"{gbps}{pct}  {row.note}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.kernels",
                                     description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    mode.add_argument("--quick", action="store_true", help="a representative subset for one GPU")
    parser.add_argument("--peak-gbps", type=float, default=4300.0)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (GPU)")
    parser.add_argument("--sections", default="decode,decode_scores,prefill,window,compression",
                        help="comma list of: decode, decode_scores, prefill, window, "
                             "compression")
    parser.add_argument("--json", dest="json_path", default=None, help="write rows as JSON here")
    args = parser.parse_args()
    if not ON_GPU and not args.smoke:
        print("no CUDA device: running --smoke (Triton interpreter on CPU)")
        args.smoke = True
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    device = torch.device("cuda" if ON_GPU else "cpu")
    timer = Timer(device, warmup=1 if args.smoke else 3,
                  iters=args.iters or (2 if args.smoke else 10))
    torch.manual_seed(0)

    sections = {
        "decode": bench_decode,
        "decode_scores": bench_decode_scores,
        "prefill": bench_prefill,
        "window": bench_window_scores,
        "compression": bench_compression,
    }
    started = time.perf_counter()
    rows: list[Row] = []
    for name in args.sections.split(","):
        section_start = time.perf_counter()
        rows.extend(sections[name.strip()](args, timer, device, dtype))
        print(f"[{name}] {time.perf_counter() - section_start:.1f} s", file=sys.stderr)
    print_table(rows)
    failed = [r for r in rows if r.section == "check" and not r.extra.get("ok", False)]
    meta = {
        "device": torch.cuda.get_device_name() if ON_GPU else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "interpreter": not ON_GPU,
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "dtype": args.dtype,
        "peak_gbps": args.peak_gbps,
        "wall_s": time.perf_counter() - started,
        "checks_failed": len(failed),
    }
    print(f"\n{meta['device']} | {meta['mode']} | {meta['wall_s']:.1f} s | "
          f"checks failed: {len(failed)}")
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as handle:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, handle, indent=2,
                      default=str)
    return 1 if failed else 0


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
