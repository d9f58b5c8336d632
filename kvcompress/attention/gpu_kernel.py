"""Per-head paged attention on GPU through kvcompress's own Triton kernels.

``kvcompress.step.PlatformKernel`` over the GPU page format (K row-major), as
:class:`kvcompress.attention.cpu_kernel.CpuPagedKernel` is on CPU. The
kernels take per-head page tables directly, so no re-indexing is needed: ``prepare`` only
casts the step's lengths to int32 once per step and reads the host-side maxima every layer's
launch needs, so no layer waits on a device->host copy. Each width class of the step's page
tables (``kvcompress.paging.batch_tables``) is its own launch per layer.

Decode scores (``kvcompress.step.DecodeScoring``) are fused into attention: a class holding
scored requests passes a :class:`kvcompress.kernels.DecodeScoreTarget` (built once per step in
``prepare``), and the layer's scores come out of the same kernel launches as its output (see
:mod:`kvcompress.kernels.decode_mass`), with no second pass over the keys.

Compaction moves go through :meth:`TritonPagedKernel.move`: for move lists the host proved
disjoint, the native CUDA kernel (``csrc/``, see :mod:`kvcompress.kernels.cuda_ext`) when it is
available, else the Triton move; otherwise the torch gather-then-scatter.

fp8 pages (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``): the pool is uint8, each
element the fp8 code of ``x / scale`` with the layer's K or V scale (``KVScales``); the Triton
kernels write and read the codes, the scales applied once per launch (moves copy bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.kernels import (
    DecodeScoreTarget,
    has_triton_gpu,
    move_kv,
    move_kv_ref,
    paged_attention,
    window_scores,
    write_kv,
)
from kvcompress.kernels.cuda_ext import MoveFn, native_move_kv
from kvcompress.paging import PageLayout
from kvcompress.paging.batch_tables import on_class_tokens
from kvcompress.paging.page_format import GPU_PAGE_FORMAT, PageFormat, fp8_dtype_of
from kvcompress.step import GQA_REDUCE_CODES, UNSCALED, DecodeScoring, KVScales, StepBatch


@dataclass
class WindowBatch:
    """This step's observation-window queries as one sub-batch for the window-score kernel.

    Sub-request i holds only window i's query rows, and its K/V length is cut right after
    its last window query: the kernel's causal rule (row j sees positions up to
    ``kv_len - num_rows + j``) then matches the real query positions.
    """

    rows: torch.Tensor  # int64 [N]: query rows of every window, window after window
    query_start_loc: torch.Tensor  # int32 [W + 1]
    window_start: torch.Tensor  # int32 [W], zeros: every row of a sub-request is scored
    page_tables: torch.Tensor  # int32 [W, rows, max_pages]
    kv_lens: torch.Tensor  # int32 [W, rows]
    max_window_len: int
    num_keys: list[list[int]]  # [W][layer]: positions window i scores in that layer


@dataclass
class TritonClassArgs:
    """One width class of the step (``kvcompress.paging.batch_tables``)."""

    token_index: torch.Tensor | None  # the class's query tokens (None: every token)
    page_tables: torch.Tensor  # int32 [n, rows, width], a view of the class's tables
    kv_lens: torch.Tensor  # int32 [n, rows], this step's tokens included
    query_start_loc: torch.Tensor  # int32 [n + 1]
    max_query_len: int
    max_kv_len: list[int]  # per layer, host side


@dataclass
class DecodeSlots:
    """Where each width class's scored requests sit in the step's decode scoring plan."""

    plan: DecodeScoring  # the plan these were built for (a subset of it is another plan)
    slots: list[torch.Tensor | None]  # per class: int32 [n], -1 unscored; None: none scored
    reduce_codes: torch.Tensor  # int64 [plan's requests]: index in GQA_REDUCE_CODES


@dataclass
class TritonStepArgs:
    classes: list[TritonClassArgs]
    windows: WindowBatch | None = None
    decode: DecodeSlots | None = None


class TritonPagedKernel:
    page_format = GPU_PAGE_FORMAT

    def __init__(
        self,
        layout: PageLayout,
        dtype: torch.dtype,
        device: torch.device | None = None,
        *,
        use_triton: bool | None = None,
        native_move: MoveFn | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``use_triton``: None picks Triton for CUDA tensors and the torch references
        otherwise (True forces Triton, e.g. under ``TRITON_INTERPRET=1`` in tests).
        ``native_move``: the CUDA move op; looked up (and JIT-built once) for CUDA devices
        when not given, so a build happens at start-up rather than at the first compaction.
        ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype`` (``auto``: pages in ``dtype``; fp8
        ones: one byte per element).
        """
        self.layout = layout
        self.dtype = dtype
        self.use_triton = use_triton
        self.kv_fp8 = fp8_dtype_of(kv_cache_dtype)
        if self.kv_fp8 is not None:
            self.page_format = PageFormat(GPU_PAGE_FORMAT.key_layout, self.kv_fp8)
        if native_move is None and device is not None and torch.device(device).type == "cuda":
            native_move = native_move_kv()
        self.native_move = native_move

    # ------------------------------------------------------------------ per step
    def prepare(self, step: StepBatch) -> TritonStepArgs:
        layout = self.layout
        device = step.lengths_before.device
        kv_lens = step.lengths_after.to(torch.int32)
        # Launch hints from the host's copy of the lengths: no device->host copy in a step.
        host_lengths = torch.from_numpy(step.host_lengths_after)
        classes = []
        for table in step.tables.classes:
            starts = table.query_start_loc
            members = torch.from_numpy(table.batch_indices)
            per_layer = host_lengths[members].view(table.num_reqs, layout.num_layers,
                                                   layout.num_kv_heads)
            query_lens = [stop - start for start, stop in zip(starts[:-1], starts[1:])]
            classes.append(TritonClassArgs(
                token_index=table.token_index,
                page_tables=table.request_major(),
                kv_lens=kv_lens.index_select(0, members.to(device)),
                query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
                max_query_len=max(query_lens, default=0),
                max_kv_len=[int(value) for value in per_layer.amax(dim=(0, 2)).tolist()],
            ))
        return TritonStepArgs(classes, windows=self._window_batch(step),
                              decode=self._decode_slots(step))

    def fuses_decode_scores(self, args: TritonStepArgs, plan: DecodeScoring) -> bool:
        """True when attention runs in Triton (GPU, or forced) and ``plan`` is the one
        ``prepare`` saw; the torch references take the torch pass."""
        if args.decode is None or args.decode.plan is not plan:
            return False
        if self.use_triton is None:
            return plan.mass.is_cuda and has_triton_gpu()
        return self.use_triton

    def write(self, pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, *, kv_scales: KVScales = UNSCALED) -> None:
        """key/value ``[T, H, D]`` to per-head ``slots [T, H]`` (fp8 pages: the codes of
        them divided by ``kv_scales``)."""
        shape = (slots.shape[0], self.layout.num_kv_heads, self.layout.head_size)
        write_kv(key.reshape(shape), value.reshape(shape), pool, slots, kv_fp8=self.kv_fp8,
                 k_scale=kv_scales.key, v_scale=kv_scales.value, use_triton=self.use_triton)

    def attend(self, args: TritonStepArgs, layer: int, query: torch.Tensor, pool: torch.Tensor,
               output: torch.Tensor, scale: float, *, soft_cap: float | None = None,
               sinks: torch.Tensor | None = None, sliding_window: int | None = None,
               kv_scales: KVScales = UNSCALED,
               decode_scoring: DecodeScoring | None = None) -> None:
        """``soft_cap`` / ``sinks [Hq]``: the layer's softmax (``kvcompress.kernels.logits``);
        ``sliding_window``: the layer's window W (None or 0: full), see ``PlatformKernel``;
        ``kv_scales``: the layer's fp8 scales (unused on unquantized pages).
        ``decode_scoring`` (only where ``fuses_decode_scores``): the scored requests'
        layer scores into ``decode_scoring.mass[:, layer]``, from the classes' own
        launches."""
        rows = self._rows(layer)
        for number, part in enumerate(args.classes):
            target = None
            if decode_scoring is not None and args.decode.slots[number] is not None:
                # Views of the step's plan: nothing is copied or synced per layer.
                target = DecodeScoreTarget(
                    slots=args.decode.slots[number],
                    begin=decode_scoring.prompt_kept[layer],
                    reduce_codes=args.decode.reduce_codes,
                    mass=decode_scoring.mass[:, layer],
                )
            on_class_tokens(part.token_index, query, output.view(query.shape),
                            lambda part_query, part_output, part=part, target=target:
                            paged_attention(
                                part_query, pool, part.page_tables[:, rows],
                                part.kv_lens[:, rows], part.query_start_loc, scale,
                                part_output, soft_cap=soft_cap, sinks=sinks,
                                sliding_window=sliding_window,
                                max_query_len=part.max_query_len,
                                max_kv_len=part.max_kv_len[layer], kv_fp8=self.kv_fp8,
                                k_scale=kv_scales.key, v_scale=kv_scales.value,
                                use_triton=self.use_triton, decode_scores=target))

    def accumulate_window_scores(
        self,
        args: TritonStepArgs,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor | None,
        pool: torch.Tensor,
        step: StepBatch,
        scale: float,
        *,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Add this layer's window probabilities into each window's accumulator, as
        :func:`kvcompress.attention.window_scores.accumulate_window_scores` does, in one
        kernel launch for all windows of the step. The kernel sums over the GQA group:
        "mean" divides by the group; windows asking for "max" (not separable that way) take
        the torch path. fp8 pages: ``scale`` already holds the layer's K scale (as
        ``attend_layer`` passes it), so the kernels only decode the codes."""
        windows = args.windows
        if windows is None:
            return
        by_max = [window for window in step.window_queries if window.group_reduce == "max"]
        if by_max:
            accumulate_window_scores(query, pool, self.page_format,
                                     replace(step, window_queries=by_max), layer, scale,
                                     key=key, soft_cap=soft_cap, sinks=sinks)
            if len(by_max) == len(step.window_queries):
                return
        rows = self._rows(layer)
        num_keys = [keys[layer] for keys in windows.num_keys]
        scores = torch.zeros(
            (len(num_keys), self.layout.num_kv_heads, max(num_keys)),
            dtype=torch.float32, device=query.device,
        )
        window_scores(
            query.index_select(0, windows.rows), pool, windows.page_tables[:, rows],
            windows.kv_lens[:, rows], windows.query_start_loc, windows.window_start, scale,
            scores, soft_cap=soft_cap, sinks=sinks, max_window_len=windows.max_window_len,
            max_kv_len=max(num_keys), kv_fp8=self.kv_fp8, use_triton=self.use_triton,
        )
        group = query.shape[1] // self.layout.num_kv_heads
        for index, window in enumerate(step.window_queries):
            if window.group_reduce == "max":
                continue
            keys = min(num_keys[index], window.scores.shape[-1])
            summed = scores[index, :, :keys]
            if window.group_reduce == "mean":
                summed = summed / group
            window.scores[layer, :, :keys] += summed

    # ------------------------------------------------------------------ compaction
    def move(self, pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
             *, disjoint: bool = False) -> None:
        """Copy K and V of ``src_slots`` to ``dst_slots``. The native CUDA kernel, else the
        Triton one, copy in parallel and in place: only for lists the caller knows are
        disjoint (hole filling). Overlapping lists (a decode eviction of fewer tokens than
        it keeps, a resumed request) gather every source first, then scatter."""
        if src_slots.numel() == 0:
            return
        if not disjoint:
            move_kv_ref(pool, src_slots, dst_slots)
        elif self.native_move is not None and pool.is_cuda:
            self.native_move(pool, src_slots, dst_slots)
        else:
            move_kv(pool, src_slots, dst_slots, use_triton=self.use_triton)

    # ------------------------------------------------------------------ helpers
    def _rows(self, layer: int) -> slice:
        heads = self.layout.num_kv_heads
        return slice(layer * heads, (layer + 1) * heads)

    def _decode_slots(self, step: StepBatch) -> DecodeSlots | None:
        """Each class's requests' slots in the step's decode plan, copied once per step."""
        plan = step.decode_scoring
        if plan is None:
            return None
        device = plan.mass.device
        tables = step.tables
        per_class = [np.full(table.num_reqs, -1, dtype=np.int32) for table in tables.classes]
        for number, decode in enumerate(step.decode_queries):
            index = decode.batch_index
            per_class[int(tables.class_of[index])][int(tables.position[index])] = number
        slots = [torch.from_numpy(found).to(device) if (found >= 0).any() else None
                 for found in per_class]
        if plan.reduce_codes is not None:
            codes = plan.reduce_codes
        else:
            codes = torch.full((plan.mass.shape[0],), GQA_REDUCE_CODES.index(plan.group_reduce),
                               dtype=torch.int64, device=device)
        return DecodeSlots(plan, slots, codes)

    def _window_batch(self, step: StepBatch) -> WindowBatch | None:
        if not step.window_queries:
            return None
        layout = self.layout
        device = step.lengths_before.device
        indices = [window.batch_index for window in step.window_queries]
        firsts = [
            step.query_start_loc[window.batch_index] + window.first_query
            for window in step.window_queries
        ]
        counts = [window.num_queries for window in step.window_queries]
        rows = torch.cat([torch.arange(first, first + count) for first, count in
                          zip(firsts, counts)])
        # Physical length right after each window's last query, per (layer, head) row.
        lengths_before = torch.from_numpy(step.host_lengths_before[indices])
        ends = torch.tensor([w.first_query + w.num_queries for w in step.window_queries])
        kv_lens = lengths_before + ends[:, None]
        num_keys = kv_lens.view(len(indices), layout.num_layers, layout.num_kv_heads)
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        widest = max(int(step.tables.classes[int(step.tables.class_of[i])].width)
                     for i in indices)
        return WindowBatch(
            rows=rows.to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
            window_start=torch.zeros(len(indices), dtype=torch.int32, device=device),
            page_tables=step.tables.gather(indices, slice(None), widest),
            kv_lens=kv_lens.to(torch.int32).to(device),
            max_window_len=max(counts),
            num_keys=num_keys.amax(dim=2).tolist(),
        )
