"""The page tables of one step's requests, grouped by width and kept between steps.

One ``[requests, rows, widest row]`` table pads every row to the widest row of the batch: a
single uncompressed 32k-token prompt among 256 compressed decoding requests makes it 2048
pages wide for all of them (1 GB as int64 at Llama-8B shapes), and it was rebuilt whenever
the batch changed. Here the step's requests fall into *width classes*: keyed by powers of
two, a class taking every narrower request within ``spread`` times its key. Each class is one
dense int32 table as wide as its widest member (rounded up to an eighth of its key, and kept
while that is at most twice as wide as needed, so tables are not rebuilt at every page a
request grows by), so its size stays within a constant factor of the pages its requests
hold, whatever the other classes hold.

Tables persist across steps: a step copies only the requests whose page table changed (a
decoding request's changes once every ``page_size`` tokens) and, when a class's members
change, carries over the columns of those that stayed. Laid out ``[rows, requests, width]``
so that one layer's block table, head-major as vLLM's CPU kernel reads its sequences, is a
view; ``TableClass.request_major`` is the ``[requests, rows, width]`` view the Triton
kernels read (they take any strides). No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.paging.page_table import HeadPageTable

MIN_CLASS_PAGES = 16  # narrower requests share this class: their tables are small anyway
CLASS_SPREAD = 4  # a class holds requests down to 1/spread of its key
WIDTH_STEPS = 8  # a class's width is a multiple of key / WIDTH_STEPS


@dataclass
class TableClass:
    """The step's requests of one width class, in batch order."""

    width: int  # pages per row in ``tables``: at least every member's widest row
    batch_indices: np.ndarray  # int64 [n]: positions in the step's batch
    tables: torch.Tensor  # int32 [rows, n, width] on the step's device
    host: np.ndarray  # the same on the host (the same memory on CPU)
    # The class's query tokens in the step's token order, on the device; None when the
    # class is the whole batch (the common case: nothing to gather).
    token_index: torch.Tensor | None
    query_start_loc: list[int]  # [n + 1] into the class's own tokens

    @property
    def num_reqs(self) -> int:
        return len(self.batch_indices)

    def request_major(self) -> torch.Tensor:
        """``[n, rows, width]`` (a view)."""
        return self.tables.transpose(0, 1)


@dataclass
class BatchPageTables:
    """Every request's page ids for one step: ``classes[class_of[i]]`` holds batch request
    ``i`` at position ``position[i]``. Beyond a row's pages a table holds zeros or ids the
    row held before: valid page ids, never read (reads stop at the row's length)."""

    classes: list[TableClass]
    class_of: np.ndarray  # int64 [R]
    position: np.ndarray  # int64 [R]

    def gather(self, batch_indices: Sequence[int], rows: slice, num_pages: int) -> torch.Tensor:
        """int32 ``[n, len(rows), num_pages]``: the first ``num_pages`` page ids of ``rows``
        of each request (zeros past its class's width)."""
        picked = np.asarray(batch_indices, dtype=np.int64)
        owners = self.class_of[picked]
        if len(picked) and (owners == owners[0]).all():
            table = self.classes[int(owners[0])]
            if num_pages <= table.width:
                return _columns(table, rows, self.position[picked], num_pages)
        device = self.classes[0].tables.device
        num_rows = len(range(*rows.indices(self.classes[0].tables.shape[0])))
        gathered = torch.zeros((len(picked), num_rows, num_pages), dtype=torch.int32,
                               device=device)
        for number in np.unique(owners):
            table = self.classes[int(number)]
            members = np.flatnonzero(owners == number)
            width = min(num_pages, table.width)
            part = _columns(table, rows, self.position[picked[members]], width)
            gathered[torch.as_tensor(members).to(device), :, :width] = part
        return gathered

    def to(self, device: torch.device) -> BatchPageTables:
        """A copy with every tensor on ``device``."""
        classes = [
            TableClass(table.width, table.batch_indices, table.tables.to(device), table.host,
                       None if table.token_index is None else table.token_index.to(device),
                       table.query_start_loc)
            for table in self.classes
        ]
        return BatchPageTables(classes, self.class_of, self.position)


def on_class_tokens(token_index: torch.Tensor | None, query: torch.Tensor,
                    output: torch.Tensor,
                    run: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """``run(query, output)`` over one class's tokens (``TableClass.token_index``): gathered
    first and scattered back into ``output`` after, or in place when the class is the whole
    batch (``token_index`` None)."""
    if token_index is None:
        run(query, output)
        return
    part_output = output.new_empty((token_index.numel(), *output.shape[1:]))
    run(query.index_select(0, token_index), part_output)
    output.index_copy_(0, token_index, part_output)


def _columns(table: TableClass, rows: slice, positions: np.ndarray,
             num_pages: int) -> torch.Tensor:
    index = torch.as_tensor(positions).to(table.tables.device)
    return table.tables[rows].index_select(1, index)[..., :num_pages].transpose(0, 1)


def class_keys(widths: np.ndarray, min_pages: int = MIN_CLASS_PAGES,
               spread: int = CLASS_SPREAD) -> np.ndarray:
    """Per request (its widest row in pages), the key of its class: its power of two (at
    least ``min_pages``), or that of a wider class within ``spread`` times it."""
    widths = np.maximum(np.asarray(widths, dtype=np.int64), 1)
    buckets = np.maximum(min_pages, 1 << np.ceil(np.log2(widths)).astype(np.int64))
    class_of_bucket: dict[int, int] = {}
    current = 0
    for bucket in sorted(set(buckets.tolist()), reverse=True):
        if not current or current > spread * bucket:
            current = bucket
        class_of_bucket[bucket] = current
    return np.array([class_of_bucket[int(bucket)] for bucket in buckets], dtype=np.int64)


def _split_positions(positions: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(page index, offset in the page) of each position: shifts for a power-of-two page
    size (what the engine uses; int64 division costs several times more)."""
    if page_size & (page_size - 1):
        return np.divmod(positions, page_size)
    return positions >> (page_size.bit_length() - 1), positions & (page_size - 1)


@dataclass
class _KeptClass:
    """A class's table as the last step that had this class left it."""

    req_ids: list[str]
    versions: list[int]  # HeadPageTable.version copied into each column
    host: np.ndarray  # int32 [rows, n, width]
    device: torch.Tensor  # the same on the device (a view of ``host`` on CPU)


class PageTableCache:
    """Builds each step's ``BatchPageTables`` from the requests' ``HeadPageTable``, keeping
    the class tables between steps. ``to_device`` is the worker's one host->device path."""

    def __init__(self, num_rows: int, page_size: int,
                 to_device: Callable[[torch.Tensor], torch.Tensor], *,
                 min_class_pages: int = MIN_CLASS_PAGES, class_spread: int = CLASS_SPREAD) -> None:
        self.num_rows = num_rows
        self.page_size = page_size
        self.to_device = to_device
        self.min_class_pages = min_class_pages
        self.class_spread = class_spread
        self._kept: dict[int, _KeptClass] = {}
        self.copied_requests = 0  # request tables copied since creation (benchmarks read it)

    def build(self, req_ids: Sequence[str], tables: Sequence[HeadPageTable],
              query_start_loc: Sequence[int], widths: np.ndarray) -> BatchPageTables:
        """``widths[i]``: pages in the widest row of request i's table."""
        widths = np.asarray(widths, dtype=np.int64)
        per_request = class_keys(widths, self.min_class_pages, self.class_spread)
        starts = np.asarray(query_start_loc, dtype=np.int64)
        classes: list[TableClass] = []
        class_of = np.zeros(len(req_ids), dtype=np.int64)
        position = np.zeros(len(req_ids), dtype=np.int64)
        kept: dict[int, _KeptClass] = {}
        for key in sorted(set(per_request.tolist())):
            members = np.flatnonzero(per_request == key)
            class_of[members] = len(classes)
            position[members] = np.arange(len(members))
            width = self._fitted_width(key, int(widths[members].max()))
            entry = self._refresh(key, width, [req_ids[i] for i in members],
                                  [tables[i] for i in members])
            kept[key] = entry
            counts = starts[members + 1] - starts[members]
            token_index = None
            if len(members) < len(req_ids):
                token_index = self.to_device(torch.from_numpy(np.concatenate(
                    [np.arange(starts[i], starts[i + 1]) for i in members]
                ).astype(np.int64)))
            classes.append(TableClass(width, members, entry.device, entry.host, token_index,
                                      np.concatenate([[0], np.cumsum(counts)]).tolist()))
        self._kept = kept  # classes absent from this step are let go
        return BatchPageTables(classes, class_of, position)

    def slot_mapping(self, batch: BatchPageTables, lengths_before: np.ndarray,
                     num_new: np.ndarray) -> torch.Tensor:
        """int64 ``[T, rows]`` on the host: the slot of every new token in every row (the
        row's next free positions), from the kept host tables."""
        page_size = self.page_size
        starts = np.concatenate([[0], np.cumsum(num_new)])
        slots = np.empty((int(starts[-1]), self.num_rows), dtype=np.int64)
        rows = np.arange(self.num_rows)
        for table in batch.classes:
            host = table.host
            members = table.batch_indices
            single = members[num_new[members] == 1]
            if len(single):  # decoding requests: one token each, rows of any lengths
                page_index, offset = _split_positions(lengths_before[single], page_size)
                # flat index into [rows, n, width]: one take, far cheaper than 3-array indexing
                flat = (rows[None, :] * (table.num_reqs * table.width)
                        + (batch.position[single] * table.width)[:, None])
                flat += page_index
                found = host.reshape(-1).take(flat).astype(np.int64)
                found *= page_size
                found += offset
                slots[starts[single]] = found
            for index in members[num_new[members] > 1]:
                tokens = np.arange(num_new[index])
                page_ids = host[:, batch.position[index]]  # [rows, width]
                before = lengths_before[index]
                if (before == before[0]).all():  # every row as long: one page per token
                    positions = before[0] + tokens
                    pages = page_ids[:, positions // page_size].T
                    offsets = (positions % page_size)[:, None]
                else:
                    positions = before[None, :] + tokens[:, None]  # [t, rows]
                    pages = page_ids[rows[None, :], positions // page_size]
                    offsets = positions % page_size
                pages = pages.astype(np.int64)
                slots[starts[index] : starts[index + 1]] = pages * page_size + offsets
        return torch.from_numpy(slots)

    def _fitted_width(self, key: int, needed: int) -> int:
        """The class's width for members ``needed`` pages wide at most: the kept one while
        it fits and is at most twice that, else ``needed`` rounded up to key / WIDTH_STEPS."""
        quantum = max(1, key // WIDTH_STEPS)
        rounded = -(-needed // quantum) * quantum
        old = self._kept.get(key)
        if old is not None and needed <= old.host.shape[2] <= 2 * rounded:
            return old.host.shape[2]
        return rounded

    def _refresh(self, key: int, width: int, req_ids: list[str],
                 tables: list[HeadPageTable]) -> _KeptClass:
        """The class's table with every member's current pages, from the kept one."""
        old = self._kept.get(key)
        if old is not None and old.req_ids == req_ids and old.host.shape[2] == width:
            changed = [i for i, table in enumerate(tables) if old.versions[i] != table.version]
            for i in changed:
                self._copy(old, i, tables[i])
            if changed and old.device.data_ptr() != old.host.ctypes.data:
                index = torch.as_tensor(changed)
                old.device[:, index] = self.to_device(torch.from_numpy(old.host[:, changed]))
            return old
        versions = [0] * len(req_ids)
        if old is None or not old.req_ids:
            host = np.zeros((self.num_rows, len(req_ids), width), dtype=np.int32)
        else:  # members that stayed keep their columns: one gather (np.take), in any order
            previous = {request_id: i for i, request_id in enumerate(old.req_ids)}
            source = [previous.get(request_id, -1) for request_id in req_ids]
            kept_width = min(width, old.host.shape[2])  # past it: beyond every member's pages
            host = np.take(old.host[:, :, :kept_width], np.maximum(source, 0), axis=1)
            if kept_width < width:
                host = np.pad(host, ((0, 0), (0, 0), (0, width - kept_width)))
            versions = [old.versions[j] if j >= 0 else 0 for j in source]  # joiners: below
        entry = _KeptClass(list(req_ids), versions, host, torch.empty(0))
        for i, table in enumerate(tables):
            if entry.versions[i] != table.version:
                self._copy(entry, i, table)
        entry.device = self.to_device(torch.from_numpy(host))
        return entry

    def _copy(self, entry: _KeptClass, column: int, table: HeadPageTable) -> None:
        width = entry.host.shape[2]
        copied = min(width, table.pages.shape[1])
        entry.host[:, column, :copied] = table.pages[:, :copied]
        entry.host[:, column, copied:] = 0
        entry.versions[column] = table.version
        self.copied_requests += 1
