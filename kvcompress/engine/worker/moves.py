"""Which tokens move where when a request's rows shrink, and the one batched move per step.

Planners work on one request's rows, on the host, in positions: ``plan_prompt_moves`` (after
prefill: the policy's kept prompt tokens, plus the generated tail of a resumed request) and
``plan_generated_keep`` (``--kv-decode-budget``: the decode policy's kept generated tokens
shifted down, in order) and ``plan_segment_compaction`` (a shared prefix compacted in place,
whole pages at a time, later).
``MoveBatch`` turns the moves of all requests of a step into pool slots and runs them in one
call of the platform's mover (or request by request, to isolate a failure). ``copy_pages``
copies whole pages (an adopted cached context onto the adopter's own pages).

Moves have parallel-move semantics: every token is read before any is written. A mover that
copies in parallel (the Triton and CUDA kernels) honours that only when no destination is also
a source; ``MoveBatch`` checks this on the host and tells the mover (``disjoint``), so lists
that overlap (a decode eviction of fewer tokens than it keeps, a resumed request) take the
gather-then-scatter path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvcompress.kernels.hole_filling import plan_hole_filling_moves
from kvcompress.step import KVMover


@dataclass
class RowMoves:
    """Moves inside one request: the token at ``src_positions[i]`` of row ``rows[i]`` goes
    to ``dst_positions[i]`` of the same row (int64 numpy arrays of equal length)."""

    rows: np.ndarray
    src_positions: np.ndarray
    dst_positions: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def plan_prompt_moves(
    counts: torch.Tensor, indices: torch.Tensor, lengths: np.ndarray,
    prompt_end: int | np.ndarray,
) -> tuple[RowMoves, np.ndarray]:
    """Moves that leave each row holding its kept prompt positions (``indices[row,
    :counts[row]]``, ascending, host tensors) and then, for a request resumed after
    preemption (rows longer than the prompt), its whole generated tail in order.

    ``prompt_end``: where the prompt part of the rows ends, one for all or per row (an
    adopter of a cached context: its adopted slots plus its new prompt tokens); the tail is
    ``[prompt_end, lengths)``. Returns the moves and the new per-row lengths. Without a
    tail, kept tokens above the new length fill the holes below it (only those move); with
    one, the compaction preserves order (the decode window relies on generated tokens sitting
    after the prompt part).
    """
    ends = torch.as_tensor(np.broadcast_to(np.asarray(prompt_end, dtype=np.int64),
                                           (len(lengths),)).copy())
    tail = torch.as_tensor(lengths) - ends  # equal in every row
    if int(tail.min()) < 0:
        raise ValueError(f"rows of {np.asarray(lengths).tolist()} tokens end before their "
                         f"prompt part ({ends.tolist()})")
    max_tail = int(tail.max())
    if not max_tail:
        rows, src, dst = plan_hole_filling_moves(indices, counts).flat_moves()
        return _row_moves(rows, src, dst), counts.numpy().astype(np.int64)
    width = int(counts.max()) + max_tail
    column = torch.arange(width)[None, :]
    prompt_part = torch.zeros(len(lengths), width, dtype=indices.dtype)
    prompt_part[:, : indices.shape[1]] = indices[:, :width]
    # Each row: its kept prompt positions, then the whole tail after them.
    tail_values = ends[:, None] + (column - counts[:, None])
    is_tail = (column >= counts[:, None]) & (column < (counts + tail)[:, None])
    sources = torch.where(column < counts[:, None], prompt_part,
                          torch.where(is_tail, tail_values, 0))
    new_lengths = counts + tail
    moving = (column < new_lengths[:, None]) & (sources != column)
    rows, dst = moving.nonzero(as_tuple=True)
    return _row_moves(rows, sources[rows, dst], dst), new_lengths.numpy().astype(np.int64)


def plan_generated_keep(
    lengths: np.ndarray, prompt_kept: np.ndarray, kept_offsets: np.ndarray
) -> tuple[RowMoves, np.ndarray]:
    """Each row keeps its ``prompt_kept`` prompt part and, of the generated tokens after it,
    those at ``kept_offsets[row]`` (``[rows, K]``, strictly ascending offsets into the row's
    generated part), shifted down in order to ``prompt_kept[row] + arange(K)``: generated
    tokens stay in generation order, which the next eviction relies on. Only tokens that
    change place move. Returns the moves and the new per-row lengths."""
    kept = np.asarray(kept_offsets, dtype=np.int64)
    generated = lengths - prompt_kept
    if kept.ndim != 2 or kept.shape[0] != len(lengths):
        raise ValueError(f"kept offsets must be [{len(lengths)}, K], got {list(kept.shape)}")
    if kept.size and ((kept[:, 0] < 0).any() or (kept[:, -1] >= generated).any()
                      or (np.diff(kept, axis=1) <= 0).any()):
        raise ValueError("kept offsets must be strictly ascending within each row's "
                         "generated part")
    src = prompt_kept[:, None] + kept
    dst = prompt_kept[:, None] + np.arange(kept.shape[1])
    moving = src != dst
    rows, _ = np.nonzero(moving)
    return RowMoves(rows, src[moving], dst[moving]), prompt_kept + kept.shape[1]


def plan_segment_compaction(
    counts: torch.Tensor, indices: torch.Tensor, lengths: np.ndarray, shared_pages: np.ndarray,
    page_size: int,
) -> tuple[RowMoves, np.ndarray]:
    """A shared prefix's segment compacted in place, page-aligned, while readers read its
    pages: per row, of the whole pages past its shared run (``[shared_pages[row] *
    page_size, whole pages)``) the kept positions (``indices[row, :counts[row]]``) are
    padded to whole pages with the latest positions not kept (the last kept page is then
    full, so the rounding costs no page) and move in order to the front of that span; the
    pages after them are dropped from every reader's rows and the row's partial last page
    stays as it is (each reader has its own copy of it). Returns the moves and the per-row
    lengths after."""
    counts_host = counts.numpy()
    indices_host = indices.numpy()
    lengths = np.asarray(lengths, dtype=np.int64)
    new_lengths = lengths.copy()
    rows, sources, destinations = [], [], []
    for row, length in enumerate(lengths):
        first = int(shared_pages[row]) * page_size
        end = int(length) // page_size * page_size
        if end <= first:
            continue
        kept = indices_host[row, : counts_host[row]].astype(np.int64)
        kept = kept[(kept >= first) & (kept < end)]
        pages = -(-len(kept) // page_size)
        spare = pages * page_size - len(kept)
        if spare:
            free = np.ones(end - first, dtype=bool)
            free[kept - first] = False
            kept = np.concatenate([kept, np.flatnonzero(free)[-spare:] + first])
        kept = np.sort(kept)
        target = first + np.arange(len(kept))
        moving = kept != target
        rows.append(np.full(int(moving.sum()), row, dtype=np.int64))
        sources.append(kept[moving])
        destinations.append(target[moving])
        new_lengths[row] = length - (end - first - pages * page_size)
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return RowMoves(empty, empty, empty), new_lengths
    return (RowMoves(np.concatenate(rows), np.concatenate(sources),
                     np.concatenate(destinations)), new_lengths)


# Bytes of pages gathered at once by ``copy_pages``: the gathered copy is memory vLLM's
# profiling never saw, so a long adopted context is copied in slices.
COPY_SLICE_BYTES = 64 << 20


def copy_pages(pool: torch.Tensor, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """``pool[dst[i]] = pool[src[i]]``, whole pages (K and V, every page format: a page is the
    pool's first dimension). No destination may be a source (an adopter's new pages, a
    cached entry's): the copy runs in slices."""
    if not len(src_pages):
        return
    src = torch.from_numpy(np.asarray(src_pages, dtype=np.int64)).to(pool.device)
    dst = torch.from_numpy(np.asarray(dst_pages, dtype=np.int64)).to(pool.device)
    page_bytes = pool[0].numel() * pool.element_size()
    step = max(1, COPY_SLICE_BYTES // page_bytes)
    for first in range(0, len(src), step):
        pool.index_copy_(0, dst[first : first + step],
                         pool.index_select(0, src[first : first + step]))


@dataclass
class MoveBatch:
    """The slot moves of every request compacted in one step, run as one mover call."""

    page_size: int
    _by_request: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def add(self, request_id: str, pages: np.ndarray, moves: RowMoves) -> None:
        """``pages``: the request's page table ``[rows, max_pages]`` (before any truncation)."""
        self._by_request[request_id] = (
            _slots(pages, moves.rows, moves.src_positions, self.page_size),
            _slots(pages, moves.rows, moves.dst_positions, self.page_size),
        )

    def destination_pages(self, request_id: str) -> np.ndarray:
        """The pages the request's moves write."""
        return self._by_request[request_id][1] // self.page_size

    def run(self, pool: torch.Tensor, mover: KVMover,
            request_ids: list[str] | None = None) -> None:
        """Every request's moves (or only those of ``request_ids``) in one mover call."""
        parts = [self._by_request[request_id]
                 for request_id in (request_ids or self._by_request)]
        if not parts:
            return
        src = np.concatenate([part[0] for part in parts])
        dst = np.concatenate([part[1] for part in parts])
        if not len(src):
            return
        # Pages are owned by one request each, so only a request's own moves can overlap.
        disjoint = not np.isin(dst, src).any()
        mover.move(pool, torch.from_numpy(src).to(pool.device),
                   torch.from_numpy(dst).to(pool.device), disjoint=disjoint)


def _row_moves(rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> RowMoves:
    return RowMoves(*(np.asarray(t.numpy(), dtype=np.int64) for t in (rows, src, dst)))


def _slots(pages: np.ndarray, rows: np.ndarray, positions: np.ndarray,
           page_size: int) -> np.ndarray:
    """Pool slots of positions in one request's rows.

    Indexes the page table directly instead of kernels.positions_to_slots, which would first
    gather a whole page-table row for every one of the (many) moves.
    """
    return pages[rows, positions // page_size].astype(np.int64) * page_size + positions % page_size
