"""The hand-off store (``engine.handoff``): a producer's rows and their description go through
a folder to one consumer, found by the prompt's tokens; an incomplete or foreign hand-off is
never taken, and a taken one leaves nothing behind."""

import os
import time

import numpy as np
import pytest
import torch

from kvcompress.engine import handoff
from kvcompress.engine.handoff import Described, Handoff
from kvcompress.engine.worker.offload import FAULT_ENV, HostTier
from kvcompress.paging import PageTableDelta
from kvcompress.paging.offload_tier import TierOrder
from kvcompress.paging.page_format import AMX_PAGE_FORMAT, CPU_PAGE_FORMAT, GPU_PAGE_FORMAT

PAGE_SHAPE = (2, 4, 8)  # (K, V) x page tokens x head size
ROWS = GPU_PAGE_FORMAT  # pages as files hold them


def describe(lengths, prompt_len=12, first_token=7):
    return Described(np.asarray(lengths, dtype=np.int64), prompt_len, first_token, "model|x",
                     {"kv_compression": "snapkv"})


def test_the_prompt_key_depends_on_every_token():
    assert handoff.prompt_key([1, 2, 3]) == handoff.prompt_key(np.array([1, 2, 3]))
    assert handoff.prompt_key([1, 2, 3]) != handoff.prompt_key([1, 2, 4])
    assert handoff.prompt_key([1, 2, 3]) != handoff.prompt_key([1, 2, 3, 0])


def test_rows_go_to_one_consumer_once_and_leave_nothing_behind(tmp_path):
    folder = str(tmp_path)
    rows = [torch.randn(3, *PAGE_SHAPE), torch.randn(2, *PAGE_SHAPE)]  # two ranks
    for rank, packed in enumerate(rows):
        assert handoff.write_rows(folder, "k", rank, packed, page_format=ROWS) == packed.numel() * 4
    assert handoff.claim(folder, "k", 2) is None  # written, not described: not yet
    handoff.publish(folder, "k", 0, describe([9, 3]))
    assert handoff.claim(folder, "k", 2) is None  # one rank of two described
    handoff.publish(folder, "k", 1, describe([4, 2]))
    first, second = handoff.claim(folder, "k", 2)
    assert first.lengths.tolist() == [9, 3] and second.lengths.tolist() == [4, 2]
    assert (first.prompt_len, first.first_token, first.settings) == (
        12, 7, {"kv_compression": "snapkv"})
    assert handoff.claim(folder, "k", 2) is None  # taken: nobody else gets it
    pool = torch.zeros(10, *PAGE_SHAPE)
    read = handoff.load(folder, "k", 1, np.array([6, 2]), pool, page_format=ROWS)
    assert read == rows[1].numel() * 4
    assert torch.equal(pool[[6, 2]], rows[1])
    handoff.discard(folder, "k", 2)
    assert os.listdir(folder) == []


def test_rows_that_do_not_fit_their_pages_fail_the_load_and_are_removed(tmp_path):
    folder = str(tmp_path)
    handoff.write_rows(folder, "k", 0, torch.randn(3, *PAGE_SHAPE), page_format=ROWS)
    pool = torch.zeros(10, *PAGE_SHAPE)
    with pytest.raises(ValueError, match="does not fit its 2 pages"):
        handoff.load(folder, "k", 0, np.array([1, 2]), pool, page_format=ROWS)
    with pytest.raises(FileNotFoundError):
        handoff.load(folder, "k", 0, np.array([1, 2, 3]), pool, page_format=ROWS)
    assert os.listdir(folder) == []


def test_a_broken_description_is_discarded(tmp_path):
    folder = str(tmp_path)
    handoff.write_rows(folder, "k", 0, torch.randn(1, *PAGE_SHAPE), page_format=ROWS)
    (tmp_path / "k.r0.json").write_text("{not json")
    assert handoff.claim(folder, "k", 1) is None
    assert os.listdir(folder) == []


def test_an_import_order_fails_as_a_load_for_its_adopters(tmp_path, monkeypatch):
    """The worker's import: rows onto the entry's pages; a failed one loses the entry and
    fails this step's adopters of its pages (they prefill again, like a failed load)."""
    folder = str(tmp_path)
    packed = torch.randn(2, *PAGE_SHAPE)
    handoff.write_rows(folder, "k", 1, packed, page_format=ROWS)
    tier, pool = HostTier(folder, rank=1), torch.zeros(8, *PAGE_SHAPE)
    assert tier.run([TierOrder("import", 5, np.array([3, 4]), source="k")], pool, {}) == (
        [], [], {})
    assert torch.equal(pool[[3, 4]], packed) and tier.imported_bytes == packed.numel() * 4
    handoff.write_rows(folder, "j", 1, packed, page_format=ROWS)
    monkeypatch.setenv(FAULT_ENV, "import")

    adopter = PageTableDelta(fresh=True, appends=[(np.array([1]), np.array([4]))],
                             adopted_len=12, adopted_lengths=np.array([4]))
    bystander = PageTableDelta(fresh=True, appends=[(np.array([1]), np.array([7]))],
                               adopted_len=12, adopted_lengths=np.array([4]))
    lost_chunks, lost_entries, failed = tier.run(
        [TierOrder("import", 6, np.array([3, 4]), source="j")], pool,
        {"adopter": adopter, "bystander": bystander})
    assert (lost_chunks, lost_entries, list(failed)) == ([], [6], ["adopter"])
    assert "hand-off" in failed["adopter"]


def test_pages_cross_between_kernels_that_lay_them_out_differently(tmp_path):
    """A producer on a CPU with AMX and a consumer without it (or on a GPU): the file holds
    rows, so the consumer's pages hold the producer's tokens in its own layout."""
    folder = str(tmp_path)
    page_shape = (2, 32, 64)  # the amx layout needs multiples of 32
    producer_pool = torch.randn(6, *page_shape, generator=torch.Generator().manual_seed(4))
    slots = torch.arange(2 * 32)
    sent = AMX_PAGE_FORMAT.read_tokens(producer_pool[[4, 1]], slots)
    for consumer_format in (CPU_PAGE_FORMAT, GPU_PAGE_FORMAT):  # (a load removes the file)
        handoff.write_rows(folder, "k", 0, producer_pool[[4, 1]], page_format=AMX_PAGE_FORMAT)
        tier = HostTier(folder, page_format=consumer_format)
        pool = torch.zeros(5, *page_shape)
        tier.run([TierOrder("import", 1, np.array([3, 0]), source="k")], pool, {})
        for theirs, mine in zip(sent, consumer_format.read_tokens(pool[[3, 0]], slots),
                                strict=True):
            assert torch.equal(theirs, mine)


def test_a_hand_off_of_another_format_is_not_taken(tmp_path):
    folder = str(tmp_path)
    handoff.write_rows(folder, "k", 0, torch.randn(1, *PAGE_SHAPE), page_format=ROWS)
    handoff.publish(folder, "k", 0, describe([4, 1]))
    path = tmp_path / "k.r0.json"
    path.write_text(path.read_text().replace('"format": 2', '"format": 1'))
    assert handoff.claim(folder, "k", 1) is None
    assert os.listdir(folder) == []


def test_the_transfer_config_names_what_is_wrong(tmp_path):
    good = {"kv_connector": "KVCompressConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"path": str(tmp_path / "a")}}
    assert Handoff.from_transfer_config(good) == Handoff("kv_producer", str(tmp_path / "a"))
    assert os.path.isdir(tmp_path / "a")
    with pytest.raises(ValueError, match="kv_connector 'LMCacheConnectorV1' cannot carry"):
        Handoff.from_transfer_config({**good, "kv_connector": "LMCacheConnectorV1"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        Handoff.from_transfer_config({**good, "kv_role": "decode"})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.path"):
        Handoff.from_transfer_config({**good, "kv_connector_extra_config": {"path": ""}})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.timeout_s must be a "
                                         r"number > 0, got 0"):
        Handoff.from_transfer_config(
            {**good, "kv_connector_extra_config": {"path": str(tmp_path), "timeout_s": 0}})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.max_gib must be"):
        Handoff.from_transfer_config(
            {**good, "kv_connector_extra_config": {"path": str(tmp_path), "max_gib": "1"}})
    with pytest.raises(ValueError, match="has no field 'ttl'"):
        Handoff.from_transfer_config(
            {**good, "kv_connector_extra_config": {"path": str(tmp_path), "ttl": 5}})
    bounded = Handoff.from_transfer_config(
        {**good, "kv_connector_extra_config": {"path": str(tmp_path), "timeout_s": 30,
                                               "max_gib": 0.5}})
    assert (bounded.timeout_s, bounded.max_bytes) == (30.0, 1 << 29)
    # What the workers get back from the engine's settings, each rank its share.
    again = Handoff.from_additional_config({handoff.HANDOFF_KEY: bounded.to_mapping()})
    assert again == bounded and again.per_rank(2).max_bytes == 1 << 28


def write_handoff(folder, key, rank, pages, written_at):
    handoff.write_rows(folder, key, rank, torch.zeros(pages, *PAGE_SHAPE), page_format=ROWS)
    handoff.publish(folder, key, rank, describe([pages * 4, 1]))
    for name in os.listdir(folder):
        if name.startswith(f"{key}.r{rank}."):
            os.utime(os.path.join(folder, name), (written_at, written_at))


def test_the_folder_keeps_no_hand_off_past_its_timeout_or_bound(tmp_path):
    folder = str(tmp_path)
    now = 10_000.0
    for index, key in enumerate(["old", "a", "b", "c"]):
        write_handoff(folder, key, 0, pages=2, written_at=now - 100 + 10 * index)
    write_handoff(folder, "other-rank", 1, pages=2, written_at=now - 1000)
    with open(os.path.join(folder, "a.r0.pt.123.tmp"), "w") as half_done:
        half_done.write("x")
    os.utime(os.path.join(folder, "a.r0.pt.123.tmp"), (now - 1000, now - 1000))

    # Nothing is old enough, no bound: nothing goes.
    assert handoff.sweep(folder, 0, timeout_s=500, max_bytes=None, now=now) == 0
    # Older than 95 s: "old" (written 100 s ago) and the half-done write; rank 1's stay.
    assert handoff.sweep(folder, 0, timeout_s=95, max_bytes=None, now=now) == 1
    names = sorted(os.listdir(folder))
    assert not any(name.startswith("old.") or name.endswith(".tmp") for name in names)
    assert {name.split(".")[0] for name in names} == {"a", "b", "c", "other-rank"}
    # A bound of two hand-offs' bytes: the oldest ("a") goes, the claimable ones stay whole.
    one = sum(os.path.getsize(os.path.join(folder, name)) for name in names
              if name.startswith("b."))
    assert handoff.sweep(folder, 0, timeout_s=500, max_bytes=2 * one, now=now) == 1
    assert handoff.claim(folder, "a", 1) is None
    for key in ("b", "c"):
        assert handoff.claim(folder, key, 1) is not None
    assert handoff.claim(folder, "other-rank", 2) is None  # rank 0's half never existed
    assert handoff.sweep(folder, 1, timeout_s=500, max_bytes=None, now=now + 10_000) == 1


def test_an_idle_producer_still_removes_what_nobody_took(tmp_path):
    """The sweeper thread bounds the folder with no step to call it: an old hand-off goes
    within a few intervals, a new one stays, and stopping ends the thread."""
    folder = str(tmp_path)
    write_handoff(folder, "old", 0, pages=1, written_at=time.time() - 60)
    write_handoff(folder, "new", 0, pages=1, written_at=time.time())
    sweeper = handoff.Sweeper(Handoff("kv_producer", folder, timeout_s=30), rank=0,
                              interval_s=0.02)
    try:
        deadline = time.monotonic() + 10
        while any(name.startswith("old.") for name in os.listdir(folder)):
            assert time.monotonic() < deadline, "the old hand-off was never removed"
            time.sleep(0.02)
        assert {name.split(".")[0] for name in os.listdir(folder)} == {"new"}
    finally:
        sweeper.stop()
    assert not sweeper._thread.is_alive()
