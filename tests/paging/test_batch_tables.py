"""The step's page tables by width class: always what the requests' tables hold, whatever
the appends, truncations, joins, departures and batch orders between steps; class tables
bounded by the pages their requests hold; slot mapping as the padded-table formula gives."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.paging import HeadPageTable
from kvcompress.paging.batch_tables import BatchPageTables, PageTableCache, class_keys

ROWS, PAGE_SIZE = 4, 4


def padded_oracle(tables: list[HeadPageTable]) -> np.ndarray:
    """The old padded ``[requests, rows, widest row]`` table, zeros beyond each row's pages."""
    width = max(1, max(int(table.num_pages.max()) for table in tables))
    dense = np.zeros((len(tables), ROWS, width), dtype=np.int64)
    for index, table in enumerate(tables):
        for row in range(ROWS):
            count = table.num_pages[row]
            dense[index, row, :count] = table.pages[row, :count]
    return dense


def assert_matches(batch: BatchPageTables, tables: list[HeadPageTable]) -> None:
    oracle = padded_oracle(tables)
    gathered = batch.gather(range(len(tables)), slice(None), oracle.shape[2]).numpy()
    for index, table in enumerate(tables):
        for row in range(ROWS):
            count = table.num_pages[row]
            assert gathered[index, row, :count].tolist() == oracle[index, row, :count].tolist()
    for table_class in batch.classes:  # each class is dense over its own members only
        assert table_class.tables.dtype == torch.int32
        assert table_class.tables.shape[:2] == (ROWS, table_class.num_reqs)
        widest = max(int(tables[i].num_pages.max()) for i in table_class.batch_indices)
        assert widest <= table_class.width


def build(cache: PageTableCache, ids: list[str], tables: dict[str, HeadPageTable],
          num_new: list[int]) -> BatchPageTables:
    picked = [tables[r] for r in ids]
    starts = np.concatenate([[0], np.cumsum(num_new)]).tolist()
    widths = np.array([max(1, int(t.num_pages.max())) for t in picked])
    return cache.build(ids, picked, starts, widths)


operations = st.lists(
    st.tuples(st.sampled_from(["grow", "truncate", "join", "leave", "shuffle"]),
              st.integers(0, 10**6)),
    min_size=1, max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(operations, st.sampled_from([(1, 1), (2, 2), (16, 4)]))
def test_class_tables_follow_every_change_of_the_request_tables(ops, classing):
    min_pages, spread = classing
    cache = PageTableCache(ROWS, PAGE_SIZE, lambda tensor: tensor, min_class_pages=min_pages,
                           class_spread=spread)
    rng = np.random.default_rng(len(ops))
    tables = {"r0": HeadPageTable(ROWS, PAGE_SIZE)}
    order = ["r0"]
    next_id, next_page = 1, 0
    for op, seed in ops:
        local = np.random.default_rng(seed)
        if op == "join" or not order:
            tables[f"r{next_id}"] = HeadPageTable(ROWS, PAGE_SIZE)
            order.insert(int(local.integers(0, len(order) + 1)), f"r{next_id}")
            next_id += 1
        elif op == "leave" and len(order) > 1:
            order.remove(order[int(local.integers(0, len(order)))])
        elif op == "shuffle":
            order = list(rng.permutation(order))
        target = tables[order[int(local.integers(0, len(order)))]]
        if op == "truncate":
            target.truncate(local.integers(0, 3 * PAGE_SIZE, ROWS))
        else:  # rows grow unevenly: some wide, some narrow
            counts = local.integers(0, 1 + int(local.choice([1, 4, 40])), ROWS).astype(np.int32)
            target.append(counts, np.arange(next_page, next_page + counts.sum(), dtype=np.int32))
            next_page += int(counts.sum())
        batch = build(cache, order, tables, [1] * len(order))
        assert_matches(batch, [tables[r] for r in order])
        owners = sorted(i for c in batch.classes for i in c.batch_indices.tolist())
        assert owners == list(range(len(order)))


def test_slot_mapping_is_the_padded_formula_for_decodes_chunks_and_uneven_rows():
    cache = PageTableCache(ROWS, PAGE_SIZE, lambda tensor: tensor, min_class_pages=1,
                           class_spread=1)
    rng = np.random.default_rng(3)
    tables, lengths, num_new = {}, [], [1, 5, 1, 9, 3]
    next_page = 0
    for index, new in enumerate(num_new):
        before = rng.integers(0, 60, ROWS)
        if index == 1:
            before[:] = 21  # a prompt chunk: every row as long (the fast path)
        counts = -(-(before + new) // PAGE_SIZE)
        table = HeadPageTable(ROWS, PAGE_SIZE)
        table.append(counts.astype(np.int32),
                     rng.permutation(1000)[: counts.sum()].astype(np.int32) + next_page)
        next_page += 1000
        tables[f"r{index}"] = table
        lengths.append(before)
    ids = list(tables)
    batch = build(cache, ids, tables, num_new)
    assert len(batch.classes) > 1
    slots = cache.slot_mapping(batch, np.stack(lengths), np.array(num_new))
    oracle = padded_oracle([tables[r] for r in ids])
    token = 0
    for index, new in enumerate(num_new):
        for offset in range(new):
            positions = lengths[index] + offset
            expected = (oracle[index, np.arange(ROWS), positions // PAGE_SIZE] * PAGE_SIZE
                        + positions % PAGE_SIZE)
            assert slots[token].tolist() == expected.tolist()
            token += 1


def test_classes_group_widths_within_the_spread_and_tables_fit_their_members():
    widths = np.array([3, 65, 70, 2048, 600, 130, 16, 17])
    classes = class_keys(widths, min_pages=16, spread=4)
    # 2048 takes 1024 (600); 256 (130) starts a class taking 128; 32 (17) takes 16
    assert classes.tolist() == [32, 256, 256, 2048, 2048, 256, 32, 32]
    buckets = np.maximum(16, 2 ** np.ceil(np.log2(widths)))
    assert (classes >= widths).all() and (classes <= 4 * buckets).all()
    cache = PageTableCache(ROWS, PAGE_SIZE, lambda tensor: tensor)
    tables = {}
    for i, width in enumerate([65, 3, 70]):
        tables[f"r{i}"] = HeadPageTable(ROWS, PAGE_SIZE)
        tables[f"r{i}"].append(np.full(ROWS, width, dtype=np.int32),
                               np.zeros(ROWS * width, dtype=np.int32))
    batch = build(cache, list(tables), tables, [1, 1, 1])
    assert [c.width for c in batch.classes] == [4, 80]  # 3 up to 16 / 8, 70 up to 128 / 8
    tables["r2"].append(np.full(ROWS, 12, dtype=np.int32), np.zeros(ROWS * 12, dtype=np.int32))
    assert [c.width for c in build(cache, list(tables), tables, [1] * 3).classes] == [4, 96]
    tables["r2"].truncate(np.full(ROWS, 40 * PAGE_SIZE))  # kept while at most twice as wide
    assert [c.width for c in build(cache, list(tables), tables, [1] * 3).classes] == [4, 96]
    batch = build(cache, ["r1", "r0"], tables, [1, 1])  # r2 leaves; 96 still fits r0's 65
    assert [c.width for c in batch.classes] == [4, 96]
    assert_matches(batch, [tables["r1"], tables["r0"]])


def test_a_decode_step_copies_only_the_tables_that_changed():
    cache = PageTableCache(ROWS, PAGE_SIZE, lambda tensor: tensor)
    tables = {f"r{i}": HeadPageTable(ROWS, PAGE_SIZE) for i in range(8)}
    for i, table in enumerate(tables.values()):
        table.append(np.full(ROWS, 2, dtype=np.int32), np.arange(2 * ROWS, dtype=np.int32) + i)
    ids = list(tables)
    build(cache, ids, tables, [1] * 8)
    copied = cache.copied_requests
    tables["r5"].append(np.ones(ROWS, dtype=np.int32), np.arange(ROWS, dtype=np.int32))
    batch = build(cache, ids, tables, [1] * 8)
    assert cache.copied_requests == copied + 1
    # one leaves, one joins, order changes: only the joiner is copied from its table
    tables["new"] = HeadPageTable(ROWS, PAGE_SIZE)
    tables["new"].append(np.ones(ROWS, dtype=np.int32), np.arange(ROWS, dtype=np.int32))
    ids = ["new", *reversed(ids[1:])]
    batch = build(cache, ids, tables, [1] * 8)
    assert cache.copied_requests == copied + 2
    assert_matches(batch, [tables[r] for r in ids])
