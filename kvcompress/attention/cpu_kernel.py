"""Per-head paged attention on CPU through vLLM's own C++ attention kernel.

vLLM's CPU kernel reads one block table per sequence. Treating every (request, KV head)
pair as its own sequence with one KV head and G query heads lets it read our per-head
page tables unchanged: the pool viewed as ``[pages, 1, 2 * page_size, head_size]`` is
exactly its KV-cache layout (K transposed per page for the vec/vec16 ISAs, V row-major; AMX
tiles for the amx ISA, ``kvcompress.paging.page_format``).

The kernel also applies the model's logit soft-cap and attention sinks. It takes one sink
per query head of a sequence, the same for every sequence, while ours differ per KV head, so
a layer with sinks runs one call per KV head (over that head's sequences).

A sliding window W goes to the kernel as vLLM's own CPU backend passes it (left extent W - 1,
causal): its query positions are ``seq_len - query_len + i`` of each sequence, i.e. of each of
our rows, so the mask is per row with the row's own length (checked against the torch
reference in tests/attention/test_sliding_window_kernels.py).

fp8 pages (``kv_cache_dtype`` fp8 / fp8_e4m3 / fp8_e5m2) run the kernel's vec ISA in its fp8
mode, as vLLM's own CPU backend does on x86 with AVX-512 or AMX: the write quantizes with the
layer's K/V scales, attention dequantizes with them; the layout is the vec one byte per element
(``CPU_PAGE_FORMAT`` with ``fp8_dtype``), checked against vLLM's write in
tests/paging/test_fp8_page_format.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm import _custom_ops as ops
from vllm import envs

from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.paging import PageLayout
from kvcompress.paging.batch_tables import on_class_tokens
from kvcompress.paging.page_format import (
    AMX_PAGE_FORMAT,
    CPU_PAGE_FORMAT,
    PageFormat,
    fp8_dtype_of,
)
from kvcompress.step import UNSCALED, DecodeScoring, KVScales, StepBatch


def cpu_supports_fp8_pages() -> bool:
    """vLLM's CPU attention reads fp8 pages on x86 with AVX-512 or AMX only."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def cpu_isa(page_size: int, head_size: int, dtype: torch.dtype | None = None,
            kv_cache_dtype: str = "auto") -> str:
    """The kernel variant for our pages: ``amx`` (AMX tiles, bf16, pages and heads multiples of
    32: its own page layout, ``AMX_PAGE_FORMAT``) where the CPU has it, else vec / vec16 (K
    transposed per page, ``CPU_PAGE_FORMAT``), as vLLM's own CPU backend picks. fp8 pages
    always run vec (pages and heads multiples of 32, AVX-512 or AMX)."""
    if head_size % 16:
        raise NotImplementedError(f"kvcompress on CPU needs head_size % 16 == 0, got {head_size}")
    if fp8_dtype_of(kv_cache_dtype) is not None:
        if not cpu_supports_fp8_pages():
            raise NotImplementedError(
                f"--kv-cache-dtype {kv_cache_dtype}: fp8 KV pages on CPU need x86 with AVX-512 "
                "or AMX (vLLM's CPU attention kernel); use --kv-cache-dtype auto")
        if page_size % 32 or head_size % 32:
            raise NotImplementedError(
                f"--kv-cache-dtype {kv_cache_dtype} on CPU needs --kv-page-size and the head "
                f"size to be multiples of 32, got {page_size} and {head_size}")
        return "vec"
    if (dtype == torch.bfloat16 and page_size % 32 == 0 and head_size % 32 == 0
            and torch.cpu._is_amx_tile_supported()):
        return "amx"
    return "vec" if page_size % 32 == 0 and head_size % 32 == 0 else "vec16"


def page_format_for(isa: str, kv_cache_dtype: str = "auto") -> PageFormat:
    fp8_dtype = fp8_dtype_of(kv_cache_dtype)
    if fp8_dtype is not None:
        return PageFormat(CPU_PAGE_FORMAT.key_layout, fp8_dtype)
    return AMX_PAGE_FORMAT if isa == "amx" else CPU_PAGE_FORMAT


@dataclass
class CpuClassArgs:
    """One width class of the step (``kvcompress.paging.batch_tables``) re-indexed as one
    sequence per (KV head, request), head-major."""

    token_index: torch.Tensor | None  # the class's query tokens (None: every token)
    query_start_loc: torch.Tensor  # [H * n + 1] int32
    request_start_loc: torch.Tensor  # [n + 1] int32: one KV head's sequences
    seq_lens: torch.Tensor  # [L, H * n] int32
    block_tables: torch.Tensor  # [L, H * n, width] int32, a view of the class's tables
    # By (layer, KV head), or (layer, None) for the call over every head's sequences.
    scheduler_metadata: dict[tuple[int, int | None], torch.Tensor] = field(
        default_factory=dict)


@dataclass
class CpuStepArgs:
    """The step's width classes: each is attended by its own calls of the kernel."""

    classes: list[CpuClassArgs]


class CpuPagedKernel:
    """``kvcompress.step.PlatformKernel`` on CPU."""

    def __init__(self, layout: PageLayout, dtype: torch.dtype, isa: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """``dtype``: the model's (queries'); ``isa``: the kernel variant (default:
        ``cpu_isa``'s pick for this CPU); ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype``
        (``auto``: pages in ``dtype``; fp8 ones: one byte per element)."""
        self.layout = layout
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.isa = isa or cpu_isa(layout.page_size, layout.head_size, dtype, kv_cache_dtype)
        self.page_format = page_format_for(self.isa, kv_cache_dtype)
        if self.isa == "amx":
            torch.cpu._init_amx()  # the process may use AMX tiles (Linux asks first)

    def prepare(self, step: StepBatch) -> CpuStepArgs:
        layers, heads = self.layout.num_layers, self.layout.num_kv_heads
        lengths_after = step.lengths_after
        classes = []
        for table in step.tables.classes:
            num_reqs, width = table.num_reqs, table.width
            lengths = lengths_after[torch.from_numpy(table.batch_indices)]
            seq_lens = lengths.view(num_reqs, layers, heads).permute(1, 2, 0)
            starts = torch.tensor(table.query_start_loc, dtype=torch.int32)
            total = int(starts[-1])
            head_offsets = torch.arange(heads, dtype=torch.int32)[:, None] * total
            query_start_loc = torch.cat(
                [(head_offsets + starts[None, :-1]).flatten(), torch.tensor([heads * total])]
            ).to(torch.int32)
            classes.append(CpuClassArgs(
                token_index=table.token_index,
                query_start_loc=query_start_loc,
                request_start_loc=starts,
                seq_lens=seq_lens.reshape(layers, heads * num_reqs).to(torch.int32).contiguous(),
                # [rows, n, width] row-major: a layer's head-major sequences are a view
                block_tables=table.tables.view(layers, heads * num_reqs, width),
            ))
        return CpuStepArgs(classes)

    def write(self, pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, *, kv_scales: KVScales = UNSCALED) -> None:
        """key/value ``[T, H, D]`` to per-head ``slots [T, H]`` (fp8 pages: quantized with
        ``kv_scales``)."""
        key_cache, value_cache = self._caches(pool)
        head_size = self.layout.head_size
        # The op reads the slot list densely: one layer's column of the step's [T, rows]
        # slot mapping is strided (with one KV head, reshape keeps that stride).
        ops.cpu_attn_reshape_and_cache(
            key.reshape(-1, 1, head_size), value.reshape(-1, 1, head_size),
            key_cache, value_cache, slots.reshape(-1).contiguous(), self.isa,
            k_scale=kv_scales.key, v_scale=kv_scales.value, kv_cache_dtype=self.kv_cache_dtype,
        )

    def attend(self, args: CpuStepArgs, layer: int, query: torch.Tensor, pool: torch.Tensor,
               output: torch.Tensor, scale: float, *, soft_cap: float | None = None,
               sinks: torch.Tensor | None = None, sliding_window: int | None = None,
               kv_scales: KVScales = UNSCALED,
               decode_scoring: DecodeScoring | None = None) -> None:
        """``soft_cap`` / ``sinks [Hq]``: the layer's softmax (``kvcompress.kernels.logits``);
        ``sliding_window``: the layer's window W (None or 0: full), see ``PlatformKernel``;
        ``kv_scales``: the layer's fp8 scales (unused on unquantized pages).
        ``decode_scoring``: never given (``fuses_decode_scores`` is False here)."""
        window = _window_for_cpu_kernel(sliding_window)
        for part in args.classes:
            on_class_tokens(part.token_index, query, output,
                            lambda part_query, part_output, part=part: self._attend_class(
                                part, layer, part_query, pool, part_output, scale, soft_cap,
                                sinks, window, kv_scales))

    def fuses_decode_scores(self, args: CpuStepArgs, plan: DecodeScoring) -> bool:
        """vLLM's CPU kernel returns no probabilities: decode scores take the torch pass."""
        return False

    def _attend_class(self, args: CpuClassArgs, layer: int, query: torch.Tensor,
                      pool: torch.Tensor, output: torch.Tensor, scale: float,
                      soft_cap: float | None, sinks: torch.Tensor | None, window: int,
                      kv_scales: KVScales) -> None:
        """Attention of one width class: ``query`` / ``output`` hold its tokens only."""
        num_tokens, num_q_heads, head_size = query.shape
        heads = self.layout.num_kv_heads
        group = num_q_heads // heads
        per_sequence = query.view(num_tokens, heads, group, head_size).transpose(0, 1)
        per_sequence = per_sequence.reshape(heads * num_tokens, group, head_size)
        result = torch.empty_like(per_sequence)
        if sinks is None:
            self._attend_sequences(args, layer, None, per_sequence, result, pool, scale,
                                   soft_cap, None, window, kv_scales)
        else:
            head_sinks = _sinks_for_cpu_kernel(sinks).view(heads, group)
            for head in range(heads):
                rows = slice(head * num_tokens, (head + 1) * num_tokens)
                self._attend_sequences(args, layer, head, per_sequence[rows], result[rows], pool,
                                       scale, soft_cap, head_sinks[head], window, kv_scales)
        output.view(num_tokens, heads, group, head_size).copy_(
            result.view(heads, num_tokens, group, head_size).transpose(0, 1)
        )

    def _attend_sequences(self, args: CpuClassArgs, layer: int, head: int | None,
                          query: torch.Tensor, result: torch.Tensor, pool: torch.Tensor,
                          scale: float, soft_cap: float | None,
                          sinks: torch.Tensor | None, window: int, kv_scales: KVScales) -> None:
        """One call of vLLM's kernel over the sequences of KV head ``head`` (``query [R * T',
        G, D]``), or of every head (``head`` None, ``query [H * T', G, D]``). ``window``: the
        layer's W, -1 for none; a layer always has the same one, so the scheduler metadata
        cached by (layer, head) fits it."""
        if head is None:
            query_start_loc = args.query_start_loc
            sequences = slice(None)
        else:
            num_reqs = args.request_start_loc.numel() - 1
            query_start_loc = args.request_start_loc
            sequences = slice(head * num_reqs, (head + 1) * num_reqs)
        seq_lens = args.seq_lens[layer, sequences]
        metadata = args.scheduler_metadata.get((layer, head))
        if metadata is None:
            metadata = args.scheduler_metadata[layer, head] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=seq_lens.numel(), num_heads=query.shape[1], num_kv_heads=1,
                head_dim=query.shape[2], seq_lens=seq_lens, dtype=self.dtype,
                query_start_loc=query_start_loc, causal=True, sliding_window_size=window,
                isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        key_cache, value_cache = self._caches(pool)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=result,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale,
            causal=True, alibi_slopes=None, sliding_window=window,
            block_table=args.block_tables[layer, sequences], softcap=soft_cap or 0,
            scheduler_metadata=metadata, s_aux=sinks,
            k_scale=kv_scales.key, v_scale=kv_scales.value, kv_cache_dtype=self.kv_cache_dtype,
        )

    def accumulate_window_scores(self, args: CpuStepArgs, layer: int, query: torch.Tensor,
                                 key: torch.Tensor | None, pool: torch.Tensor, step: StepBatch,
                                 scale: float, *,
                                 soft_cap: float | None = None,
                                 sinks: torch.Tensor | None = None) -> None:
        accumulate_window_scores(query, pool, self.page_format, step, layer, scale,
                                 key=key, soft_cap=soft_cap, sinks=sinks)

    def move(self, pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
             *, disjoint: bool = False) -> None:
        """Compaction's cache move: torch gather-then-scatter over the CPU page format."""
        self.page_format.move(pool, src_slots, dst_slots)

    def _caches(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_pages, _, page_size, head_size = pool.shape
        return pool.view(num_pages, 1, 2 * page_size, head_size).chunk(2, dim=2)


def _window_for_cpu_kernel(sliding_window: int | None) -> int:
    """vLLM's CPU kernel takes the window W itself (it sees W - 1 positions back), -1 for none."""
    if sliding_window is None or sliding_window == 0:
        return -1
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (full) or positive, got {sliding_window}")
    return int(sliding_window)


def _sinks_for_cpu_kernel(sinks: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU kernel reads sinks in bf16 or fp32 (as vLLM's own CPU backend hands them)."""
    if sinks.dtype in (torch.bfloat16, torch.float32):
        return sinks
    return sinks.float()
