"""Reconstruction passes: query-agnostic scores for a prompt about to be compressed.

After the forward in which a prompt completes, and before it is compacted, the model runs
over "repeat the previous context" followed by each chunk of that very prompt, at
the positions after it (KVzip, Kim et al., NeurIPS 2025). Each pass's queries attend to the
whole prompt in the request's own pages and to the pass's own earlier tokens, whose K/V go
to scratch slots: the tail of each row's last page and then the pool's scratch pages
(``PageLayout.scratch_pages``, outside page accounting), so nothing the request keeps is
touched and the pass's K/V are gone once the next pass or request writes there. The
attention backend turns the pass's attention into scores
(``attention.reconstruction_scores``); the plan then reads them as it reads window scores.

The scores do not depend on the question at the prompt's end, so a cache kept for reuse
answers later questions too. Cost: the prompt once more through the model, in chunks of
``--kv-reconstruct-chunk`` tokens (each chunk attends to the whole prompt), plus the
repeat instruction per chunk. The chunks are scheduled work: the prompt's step registers
them (``Reconstructor.register``), the scheduler grants some each step within its token
budget while the request waits (``engine.pass_schedule``), and the prompt is compacted in
the step its last chunk ran. No vLLM imports: the runner supplies the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcompress.engine.pass_schedule import pass_chunk
from kvcompress.engine.scoring_memory import MAX_REPEAT_TOKENS
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import HeadPageTable
from kvcompress.paging.batch_tables import PageTableCache
from kvcompress.step import StepBatch, WindowQueries


@dataclass
class ReconstructionPass:
    """One forward of the model over chunks of one or more requests (each at most once):
    ``input_ids`` / ``positions`` [T] on the device, and the batch its attention runs on."""

    request_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    step: StepBatch


@dataclass
class CompletedPasses:
    """The requests whose last pass ran in a step (none of them in its batch), as
    ``worker.compaction.compact_completed_prompts`` reads a step: each completes its prompt."""

    req_ids: list[str]
    logical_after: np.ndarray  # [R] vLLM's computed tokens at the end of each prompt
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def completing_prompt(self) -> list[int]:
        return list(range(len(self.req_ids)))

    def fail(self, request_ids: list[str], reason: str) -> None:
        for request_id in request_ids:
            self.failures.setdefault(request_id, reason)


@dataclass
class _Chunk:
    request_id: str
    tokens: list[int]
    context: np.ndarray  # [rows] slots the request's rows hold before the pass


class Reconstructor:
    """Chunks the passes of the requests whose prompt completed, and builds those the
    scheduler grants each step (``engine.pass_schedule``)."""

    def __init__(self, state: WorkerKVState, repeat_ids: Sequence[int], chunk: int,
                 budget: int | None = None) -> None:
        """``chunk``: the most prompt tokens per pass; ``budget``: the scheduler's token
        budget, which a long prompt's passes are cut to fit (``pass_schedule.pass_chunk``)."""
        layout = state.layout
        self.budget = budget
        self.state = state
        self.repeat_ids = list(repeat_ids)[:MAX_REPEAT_TOKENS]
        # Row r's scratch pages: [first + r * per_row, first + (r + 1) * per_row).
        self.pages_per_row = layout.scratch_pages // layout.num_rows
        # A small pool's scratch holds shorter passes than --kv-reconstruct-chunk asks.
        self.chunk = min(chunk, self.pages_per_row * layout.page_size - len(self.repeat_ids))
        if self.chunk < 1:
            raise ValueError(
                f"{layout.scratch_pages} scratch pages do not hold a reconstruction pass of "
                f"{len(self.repeat_ids)} instruction tokens and a prompt token per row")
        self.max_tokens = self.chunk + len(self.repeat_ids)
        self.first_scratch_page = layout.total_pages
        # Its own table cache: the step's kept class tables stay as they are.
        self.tables = PageTableCache(layout.num_rows, layout.page_size, state.to_device)
        # Registered requests' chunks not yet run, and vLLM's computed tokens at the end of
        # their prompt (what their compaction reports).
        self.pending: dict[str, list[_Chunk]] = {}
        self.logical_len: dict[str, int] = {}

    def register(self, step: StepBatch, request_ids: Sequence[str],
                 prompt_tokens: Callable[[str], Sequence[int]]) -> dict[str, list[int]]:
        """Chunk the passes of ``request_ids`` (requests of ``step`` whose prompt completed)
        and allocate their score accumulators; they run when the scheduler grants them
        (``passes``). Returns each request's chunks' token counts, in order. The prompt's new
        segment is reconstructed (an adopter's adopted context was scored when it was kept)."""
        batch_index = {request_id: index for index, request_id in enumerate(step.req_ids)}
        layout = self.state.layout
        registered: dict[str, list[int]] = {}
        for request_id in request_ids:
            request = self.state.requests[request_id]
            request.query_agnostic = True
            if request.window_scores is not None:  # hybrid: the window's, kept apart
                request.query_scores, request.window_scores = request.window_scores, None
            if request.window_scores is None:
                request.window_scores = self.state.to_device(torch.zeros(
                    layout.num_layers, layout.num_kv_heads, request.score_width(),
                    dtype=torch.float32))
            segment = list(prompt_tokens(request_id))[request.adopted_len : request.prompt_len]
            context = step.host_lengths_after[batch_index[request_id]]  # what the forward wrote
            size = self.chunk if self.budget is None else pass_chunk(
                self.chunk, self.budget, int(context.max()), len(self.repeat_ids))
            chunks = [_Chunk(request_id, self.repeat_ids + segment[s : s + size], context)
                      for s in range(0, len(segment), size)]
            self.pending[request_id] = chunks
            self.logical_len[request_id] = int(step.logical_after[batch_index[request_id]])
            registered[request_id] = [len(chunk.tokens) for chunk in chunks]
        self.state.note_scores_held()
        return registered

    def passes(self, grants: Mapping[str, int]) -> Iterator[ReconstructionPass]:
        """The passes of this step's granted chunks (request id -> how many of its next
        ones): chunks of different requests share a pass while its tokens and every row's
        scratch pages allow. Run each pass before taking the next: their page tables share
        one table. A grant for a request not registered here (dropped) is skipped."""
        granted = [self.pending[request_id][:count] for request_id, count in grants.items()
                   if request_id in self.pending]
        for request_id, count in grants.items():
            if request_id in self.pending:
                del self.pending[request_id][:count]
        while any(granted):
            yield self._pass(self._pack(granted))

    def done(self, request_id: str) -> bool:
        """Whether every pass of a registered request has run (then it is compacted)."""
        return request_id in self.logical_len and not self.pending.get(request_id)

    def completed(self, request_ids: Sequence[str]) -> CompletedPasses:
        """``request_ids`` (all ``done``) as the batch their compaction runs on."""
        return CompletedPasses(list(request_ids), np.array(
            [self.logical_len[request_id] for request_id in request_ids], dtype=np.int64))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests compacted, failed, finished or preempted: no pass of theirs runs."""
        for request_id in request_ids:
            self.pending.pop(request_id, None)
            self.logical_len.pop(request_id, None)

    def _pack(self, pending: list[list[_Chunk]]) -> list[_Chunk]:
        """The next chunk of as many requests as fit one pass (greedy, in order)."""
        picked: list[_Chunk] = []
        tokens = 0
        pages = np.zeros(self.state.layout.num_rows, dtype=np.int64)
        for chunks in pending:
            if not chunks:
                continue
            chunk = chunks[0]
            needed = self._scratch_needed(chunk)
            if picked and (tokens + len(chunk.tokens) > self.max_tokens
                           or (pages + needed).max() > self.pages_per_row):
                continue
            picked.append(chunks.pop(0))
            tokens += len(chunk.tokens)
            pages += needed
        return picked

    def _scratch_needed(self, chunk: _Chunk) -> np.ndarray:
        table = self.state.requests[chunk.request_id].table
        return table.pages_missing(chunk.context + len(chunk.tokens)).astype(np.int64)

    def _pass(self, chunks: list[_Chunk]) -> ReconstructionPass:
        layout = self.state.layout
        rows = np.arange(layout.num_rows)
        used = np.zeros(layout.num_rows, dtype=np.int64)  # scratch pages given out per row
        tables, windows, input_ids, positions, logical_after = [], [], [], [], []
        query_start_loc = [0]
        for number, chunk in enumerate(chunks):
            request = self.state.requests[chunk.request_id]
            pages = HeadPageTable(layout.num_rows, layout.page_size)
            pages.append(request.table.num_pages.astype(np.int64), request.table.all_pages())
            missing = self._scratch_needed(chunk)
            offsets = np.arange(int(missing.max(initial=0)))
            scratch = (self.first_scratch_page + rows[:, None] * self.pages_per_row
                       + used[:, None] + offsets)
            pages.append(missing, scratch[offsets[None, :] < missing[:, None]])
            used += missing
            tables.append(pages)
            num_tokens = len(chunk.tokens)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
            windows.append(WindowQueries(number, 0, num_tokens, request.prompt_len,
                                         request.window_scores, group_reduce="max"))
            input_ids += chunk.tokens
            positions += range(request.prompt_len, request.prompt_len + num_tokens)
            logical_after.append(request.prompt_len + num_tokens)
        ids = [chunk.request_id for chunk in chunks]
        widths = np.array([table.num_pages.max() for table in tables])
        batch = self.tables.build(ids, tables, query_start_loc, widths)
        lengths_before = np.stack([chunk.context for chunk in chunks]).astype(np.int64)
        num_new = np.diff(query_start_loc).astype(np.int64)
        slot_mapping = self.tables.slot_mapping(batch, lengths_before, num_new)
        to_device = self.state.to_device
        step = StepBatch(
            layout=layout,
            req_ids=ids,
            query_start_loc=query_start_loc,
            num_new_tokens=to_device(torch.from_numpy(num_new)),
            lengths_before=to_device(torch.from_numpy(lengths_before)),
            tables=batch,
            slot_mapping=to_device(slot_mapping),
            logical_after=np.array(logical_after, dtype=np.int64),
            host_lengths_before=lengths_before,
            host_lengths_after=lengths_before + num_new[:, None],
            window_queries=windows,
            reconstruction=True,
            score_timer=self.state.score_timer,
        )
        return ReconstructionPass(ids, to_device(torch.tensor(input_ids, dtype=torch.long)),
                                  to_device(torch.tensor(positions, dtype=torch.long)), step)
