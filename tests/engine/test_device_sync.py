"""The GPU path's synchronisation rules, on CPU: the step's one device->host transfer
(``to_host``), the retry policy after an exception (``device_faults``: honest on CUDA, where
faults are asynchronous and sticky) and stage timing (``StageTimer``: CUDA events read
without waiting). The CUDA paths are emulated (fake events, a patched ``synchronize``): none
of this has run on a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcompress import device_faults
from kvcompress.attention.layer import attend_layer
from kvcompress.device_faults import is_device_fault, may_retry, raise_if_fatal
from kvcompress.device_timing import StageTimer
from kvcompress.engine.worker.host_transfer import to_host
from kvcompress.faults import InjectedFault
from tests import sync_debug
from tests.device_emulation import DeviceTensor, emulate_transfers, is_on_device, on_device
from tests.engine.test_worker_runtime import adopting_runtime

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


# ------------------------------------------------------------------ one transfer
@pytest.fixture
def emulated_transfer(monkeypatch):
    emulate_transfers(monkeypatch)


def test_to_host_brings_every_device_tensor_over_in_one_copy(emulated_transfer):
    DeviceTensor.syncs = 0
    counts = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    indices = torch.arange(24).view(2, 3, 4)
    empty = torch.zeros(0, 5, dtype=torch.long)
    on_host = torch.tensor([7, 8], dtype=torch.int16)
    odd = torch.arange(5, dtype=torch.int32)  # 20 bytes: the next tensor's offset is aligned
    narrowed = torch.arange(24).view(4, 6)[:, :3]  # not contiguous
    parts = to_host([on_device(counts), on_device(odd), on_device(indices), on_device(empty),
                     on_host, on_device(narrowed)])
    assert DeviceTensor.syncs == 1
    for part, expected in zip(parts, (counts, odd, indices, empty, on_host, narrowed)):
        assert not is_on_device(part)
        assert part.dtype == expected.dtype and torch.equal(part, expected)
    assert parts[4] is on_host  # already on the host: not copied


def test_to_host_copies_nothing_without_device_tensors(emulated_transfer):
    DeviceTensor.syncs = 0
    kept = torch.arange(6).view(2, 3)
    assert to_host([kept])[0] is kept
    assert to_host([]) == []
    assert DeviceTensor.syncs == 0


def test_to_host_carries_integers_only():
    with pytest.raises(TypeError, match="integer"):
        to_host([torch.zeros(3)])


# ------------------------------------------------------------------ retry policy
@pytest.fixture
def cuda_synchronize(monkeypatch):
    """torch.cuda.synchronize emulated: counts its calls, raises what ``sticky`` holds (a
    context broken by an earlier asynchronous fault)."""
    probe = {"calls": 0, "sticky": None}

    def synchronize(device=None):
        probe["calls"] += 1
        if probe["sticky"] is not None:
            raise probe["sticky"]

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return probe


HOST_ERRORS = [ValueError("rows hold different numbers of generated tokens"),
               IndexError("index 40 is out of bounds"), InjectedFault("injected plan fault"),
               torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")]
DEVICE_FAULTS = [RuntimeError("CUDA error: an illegal memory access was encountered"),
                 RuntimeError("CUDA error: device-side assert triggered"),
                 torch.AcceleratorError("CUDA error: unspecified launch failure")]


@pytest.mark.parametrize("error", HOST_ERRORS + DEVICE_FAULTS, ids=repr)
def test_off_cuda_every_error_may_be_retried(error, cuda_synchronize):
    assert may_retry(error, CPU)
    assert cuda_synchronize["calls"] == 0


@pytest.mark.parametrize("error", DEVICE_FAULTS, ids=repr)
def test_a_cuda_fault_is_never_retried(error, cuda_synchronize):
    assert is_device_fault(error)
    assert not may_retry(error, CUDA)


@pytest.mark.parametrize("error", HOST_ERRORS, ids=repr)
def test_a_host_error_on_cuda_is_retried_when_the_context_is_sound(error, cuda_synchronize):
    assert not is_device_fault(error)
    assert may_retry(error, CUDA)
    assert cuda_synchronize["calls"] == 1  # the probe, on the error path only


def test_a_host_error_after_an_earlier_asynchronous_fault_is_not_retried(cuda_synchronize):
    cuda_synchronize["sticky"] = RuntimeError("CUDA error: an illegal memory access was "
                                              "encountered")
    assert not may_retry(ValueError("a shape that a corrupted length produced"), CUDA)


def test_raise_if_fatal_reraises_the_fault_and_says_why(cuda_synchronize, caplog):
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    with caplog.at_level(logging.CRITICAL, logger=device_faults.logger.name), \
            pytest.raises(RuntimeError) as raised:
        raise_if_fatal(fault, CUDA, "moving the kept tokens")
    assert raised.value is fault
    assert "moving the kept tokens" in caplog.text and "worker stops" in caplog.text
    raise_if_fatal(ValueError("synchronous"), CUDA, "moving the kept tokens")  # returns
    raise_if_fatal(fault, CPU, "moving the kept tokens")  # CPU: retried as before


# ------------------------------------------------------------------ timing
class FakeEvent:
    """torch.cuda.Event emulated: ``clock`` orders the records, ``done`` says how far the
    device got; waiting or reading an unfinished one counts a sync."""

    clock = 0
    done = 0
    syncs = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: int | None = None

    def record(self, stream=None) -> None:
        FakeEvent.clock += 1
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.done

    def synchronize(self) -> None:
        if not self.query():
            FakeEvent.syncs += 1
            FakeEvent.done = max(FakeEvent.done, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of unfinished events waits"
        return 250.0 * (end.at - self.at)  # milliseconds


@pytest.fixture
def fake_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.clock = FakeEvent.done = FakeEvent.syncs = 0


def test_on_cpu_a_stage_is_timed_by_the_clock():
    timer = StageTimer(CPU)
    with timer.measure():
        sum(range(10_000))
    with timer.measure() as measurement:
        measurement.discard()
    seconds = timer.take()
    assert 0 < seconds < 1
    assert timer.take() == 0.0


def test_on_cuda_a_stage_is_read_once_the_device_finished_it(fake_events):
    timer = StageTimer(CUDA)
    with timer.measure():
        pass  # start at 1, end at 2
    with timer.measure():
        pass  # 3, 4
    assert timer.take() == 0.0  # nothing finished: nothing read, nothing waited for
    FakeEvent.done = 2
    assert timer.take() == pytest.approx(0.25)
    with timer.measure() as measurement:
        measurement.discard()  # 5, 6
    assert timer.take(wait=True) == pytest.approx(0.25)  # the second; the third discarded
    assert FakeEvent.syncs == 1  # only take(wait=True) waited
    assert timer.take() == 0.0


def run_adopters_step(runtime, common):
    metadata = runtime.build_attention_metadata(common)
    generator = torch.Generator().manual_seed(4)
    tokens, layout = metadata.num_actual_tokens, runtime.layout
    for layer in range(layout.num_layers):
        query = torch.randn(tokens, 2 * layout.num_kv_heads, layout.head_size,
                            generator=generator)
        key, value = (torch.randn(tokens, layout.num_kv_heads, layout.head_size,
                                  generator=generator) for _ in range(2))
        attend_layer(metadata, layer, query, key, value, runtime.pool, torch.empty_like(query),
                     layout.head_size**-0.5)
    return runtime.end_step()


def test_the_runtime_reports_the_compaction_time_by_the_clock_on_cpu():
    runtime, _, _, common = adopting_runtime()
    report = run_adopters_step(runtime, common)
    assert list(report.compactions) == ["long"]
    assert report.compaction_seconds > 0
    assert runtime.collect_stats().seconds == report.compaction_seconds


def test_on_cuda_the_runtime_reports_the_compaction_time_once_the_device_finished(
        fake_events):
    runtime, _, _, common = adopting_runtime()
    runtime.compaction_timer = StageTimer(CUDA)
    report = run_adopters_step(runtime, common)
    assert list(report.compactions) == ["long"]
    assert report.compaction_seconds == 0.0  # not waited for in the step
    assert runtime.collect_stats().seconds == pytest.approx(0.25)  # collected: waited for
    assert FakeEvent.syncs == 1


# ------------------------------------------------------------------ the no-sync region
@pytest.fixture
def sync_debug_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", calls.append)
    return calls


@pytest.mark.parametrize(("env", "device", "expected"), [
    (None, CUDA, []), ("error", CPU, []), ("error", CUDA, ["error", 0]),
    ("warn", CUDA, ["warn", 0]),
])
def test_the_no_sync_region_sets_the_debug_mode_on_cuda_only(monkeypatch, sync_debug_calls,
                                                             env, device, expected):
    if env is None:
        monkeypatch.delenv(sync_debug.ENV, raising=False)
    else:
        monkeypatch.setenv(sync_debug.ENV, env)
    with sync_debug.no_sync_region(device):
        assert sync_debug_calls == expected[:1]  # on inside
    assert sync_debug_calls == expected  # restored after


def test_the_no_sync_region_refuses_an_unknown_mode(monkeypatch):
    monkeypatch.setenv(sync_debug.ENV, "loud")
    with pytest.raises(ValueError, match=sync_debug.ENV), sync_debug.no_sync_region(CPU):
        pass
