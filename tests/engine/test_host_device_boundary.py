"""The host/device boundary of a step, checked on CPU with an emulated device (a GPU's rules:
device tensors cannot become numpy or index host tensors, and reading them on the host is a
synchronisation): the plan is made where the window scores are and comes to the host once,
so does a decode eviction's choice; preparing and finishing a step read nothing back from the
device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvcompress.attention.decode_scores import score_decode_layer
from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.engine.worker import compaction as worker_compaction
from kvcompress.engine.worker.compaction import compact_completed_prompts
from kvcompress.engine.worker.compression import compress_step
from kvcompress.engine.worker.decode_eviction import evict_generated_tokens
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.policies import KeepPlan, plan_keep, plan_keep_each
from kvcompress.settings.config import KVCompressionConfig
from tests.device_emulation import DeviceTensor, emulate_transfers, is_on_device, on_device
from tests.engine.test_worker_compaction import labelled_case, token_ids_in_slots
from tests.paged_cases import build_case


@pytest.fixture(autouse=True)
def emulated_transfers(monkeypatch):
    """to_host moves DeviceTensors as it moves CUDA tensors (tests.device_emulation)."""
    emulate_transfers(monkeypatch)


@pytest.fixture
def emulated_device(monkeypatch):
    """The worker's device tensors (step batch, score accumulators) become DeviceTensors."""
    monkeypatch.setattr(WorkerKVState, "to_device", lambda self, tensor: on_device(tensor))
    DeviceTensor.syncs = 0


@pytest.mark.parametrize("method", ["pyramidkv", "snapkv", "adakv", "streamingllm"])
def test_a_plan_made_on_the_device_is_brought_to_the_host_for_the_moves(monkeypatch, method):
    # plan_keep_each returns its plans on the scores' device (documented); emulate that device.
    def plan_on_device(*args, **kwargs):
        return [KeepPlan(*(on_device(tensor) for tensor in
                           (plan.counts, plan.indices, plan.prompt_lens, plan.compressed)))
                for plan in plan_keep_each(*args, **kwargs)]

    monkeypatch.setattr(worker_compaction, "plan_keep_each", plan_on_device)
    sharing = "layer" if method == "streamingllm" else "model"  # model: the harder plan
    config = KVCompressionConfig.from_mapping({"kv_compression": method, "kv_budget": 24,
                                               "kv_budget_sharing": sharing})
    case, request = labelled_case(lengths=99, prompt_len=100, settings=config)
    host_scores = request.window_scores.clone()
    request.window_scores = on_device(request.window_scores)
    case.step.completing_prompt = [0]
    compactions = compact_completed_prompts(case.state, case.step, case.pool, CPU_PAGE_FORMAT)
    plan = plan_keep(config.policy, [100], [host_scores], num_layers=2, num_kv_heads=2)
    counts = plan.counts[0].reshape(4).tolist()
    assert compactions["req0"].physical_lengths.tolist() == counts
    for row in range(4):
        kept = plan.indices[0].reshape(4, -1)[row, : counts[row]].tolist()
        assert sorted(token_ids_in_slots(case, request, row)) == kept
    assert not is_on_device(torch.as_tensor(request.prompt_kept))


def test_preparing_and_finishing_a_step_read_nothing_back_from_the_device(emulated_device):
    # Decodes, a chunk on context, a fresh prompt; two requests score their window.
    case = build_case(GPU_PAGE_FORMAT, [[5, 9, 33, 1], [40] * 4, [3, 17, 2, 60], [0] * 4],
                      [1, 7, 1, 20], num_layers=2, num_kv_heads=2, group=2, head_size=32,
                      page_size=16, dtype=torch.float32, prompt_lens=[10, 47, 70, 20],
                      window=8, wants_compression=[False, True, False, True])
    assert all(is_on_device(part.tables) for part in case.step.tables.classes)
    assert is_on_device(case.step.lengths_before)
    assert case.step.window_queries
    kernel = TritonPagedKernel(case.layout, torch.float32)
    args = kernel.prepare(case.step)
    assert args.windows is not None and len(args.classes) > 1
    assert all(is_on_device(part.kv_lens) for part in args.classes)
    case.state.finish_step(case.step)
    assert DeviceTensor.syncs == 0
    # the emulation does count host reads of device tensors
    int(case.step.lengths_before.max())
    assert DeviceTensor.syncs == 1


def test_decode_scoring_is_prepared_without_reading_the_device(emulated_device):
    case = build_case(GPU_PAGE_FORMAT, [[30, 17, 25, 40], [20] * 4], [1, 1], num_layers=2,
                      num_kv_heads=2, group=2, head_size=32, page_size=16,
                      dtype=torch.float32, prompt_lens=[10, 10])
    config = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 4,
         "kv_decode_policy": "h2o", "kv_decode_budget": 16, "kv_decode_interval": 8})
    for request in case.state.requests.values():
        request.config = config
        request.prompt_kept = request.lengths - 5
    case.state.prepare_decode_scoring(case.step)
    assert [decode.batch_index for decode in case.step.decode_queries] == [0, 1]
    for decode in case.step.decode_queries:
        assert is_on_device(decode.scores)
    plan = case.step.decode_scoring
    assert all(is_on_device(tensor) for tensor in (
        plan.tokens, plan.lengths, plan.prompt_kept,
        *(tensor for group in plan.groups for tensor in (group.numbers, group.positions))))
    # the step's scores: a buffer the worker made on its device, never copied from the host
    assert plan.mass.device == case.state.device and not is_on_device(plan.mass)
    assert DeviceTensor.syncs == 0


def test_a_layer_scores_decode_queries_without_host_data_or_syncs(emulated_device, monkeypatch):
    """Every index a layer's decode scoring reads was built for the step: the layers make no
    tensor from host data (no host->device copy), read nothing back, and the step's scores
    reach the accumulators once, when the step finishes."""
    case = build_case(GPU_PAGE_FORMAT, [[30, 17, 25, 40], [20] * 4], [1, 1], num_layers=2,
                      num_kv_heads=2, group=2, head_size=32, page_size=16,
                      dtype=torch.float32, prompt_lens=[10, 10])
    config = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 4,
         "kv_decode_policy": "h2o", "kv_decode_budget": 16, "kv_decode_interval": 8})
    for request in case.state.requests.values():
        request.config = config
        request.prompt_kept = request.lengths - 5
    case.state.prepare_decode_scoring(case.step)
    pool, query = on_device(case.pool), on_device(case.query)

    def from_host(*args, **kwargs):
        raise AssertionError("a layer built a tensor from host data")

    with monkeypatch.context() as patched:
        for name in ("tensor", "as_tensor", "from_numpy"):
            patched.setattr(torch, name, from_host)
        for layer in range(2):
            score_decode_layer(query, pool, GPU_PAGE_FORMAT, case.step.decode_scoring, layer,
                               32**-0.5)
    assert DeviceTensor.syncs == 0
    assert not any(decode.scores.any() for decode in case.step.decode_queries)
    case.state.finish_step(case.step)
    assert all(decode.scores.any() for decode in case.step.decode_queries)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_a_decode_eviction_chooses_on_the_device_and_brings_the_choice_over_once(policy):
    config = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 200, "kv_window": 4,
         "kv_decode_policy": policy, "kv_decode_budget": 10, "kv_decode_interval": 5})
    case, request = labelled_case(lengths=134, prompt_len=120, settings=config)
    request.decode_scores = on_device(
        torch.rand(2, 2, 15, generator=torch.Generator().manual_seed(0)))
    DeviceTensor.syncs = 0
    compactions = evict_generated_tokens(case.state, case.step, case.pool, CPU_PAGE_FORMAT)
    assert compactions["req0"].physical_lengths.tolist() == [130] * 4
    assert DeviceTensor.syncs == 1
    assert not is_on_device(torch.as_tensor(request.lengths))
    if policy == "h2o":
        assert is_on_device(request.decode_scores)  # carried on the device


def step_of_many(monkeypatch):
    """A step with three prompts completing under two configs (snapkv 24, pyramidkv 16
    model-wide: two plan groups) and three decodes over their decode budget (two h2o with
    scores on the device, one window: nothing to bring over). Plans are made on the
    emulated device; returns the case, the host scores and the plan groups seen."""
    groups = []

    def plan_on_device(policy, prompt_lens, scores, **kwargs):
        # The policy's own device work is the policies' (the emulation cannot tell its
        # .to(scores' device) from a copy to the host): it runs on host copies here.
        groups.append(list(prompt_lens))
        scores = None if scores is None else [score.as_subclass(torch.Tensor)
                                              for score in scores]
        return [KeepPlan(*(on_device(tensor) for tensor in
                           (plan.counts, plan.indices, plan.prompt_lens, plan.compressed)))
                for plan in plan_keep_each(policy, prompt_lens, scores, **kwargs)]

    monkeypatch.setattr(worker_compaction, "plan_keep_each", plan_on_device)
    prompts = [100, 80, 90]
    case = build_case(CPU_PAGE_FORMAT, [[n - 1] * 4 for n in prompts] + [[134] * 4] * 3,
                      [1] * 6, num_layers=2, num_kv_heads=2, group=1, head_size=32,
                      page_size=16, dtype=torch.float32, prompt_lens=prompts + [120] * 3,
                      wants_compression=[True] * 3 + [False] * 3)
    case.state.finish_step(case.step)
    snapkv = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 24})
    pyramid = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_budget": 16,
                                                "kv_budget_sharing": "model"})
    decode = {policy: KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget": 200, "kv_decode_policy": policy,
         "kv_decode_budget": 10, "kv_decode_interval": 5}) for policy in ("h2o", "window")}
    configs = [snapkv, pyramid, snapkv, decode["h2o"], decode["h2o"], decode["window"]]
    generator = torch.Generator().manual_seed(3)
    host_scores = {}
    for number, (request_id, config) in enumerate(zip(case.step.req_ids, configs)):
        request = case.state.requests[request_id]
        request.config = config
        if number < 3:
            host_scores[request_id] = torch.rand(2, 2, prompts[number], generator=generator)
            request.window_scores = on_device(host_scores[request_id])
        elif number < 5:
            request.decode_scores = on_device(torch.rand(2, 2, 15, generator=generator))
    case.step.completing_prompt = [0, 1, 2]
    return case, host_scores, groups


def test_a_step_brings_every_plan_and_eviction_over_in_one_transfer(emulated_device,
                                                                    monkeypatch):
    case, host_scores, groups = step_of_many(monkeypatch)
    syncs_before = DeviceTensor.syncs
    compactions = compress_step(case.state, case.step, case.pool, CPU_PAGE_FORMAT)
    assert DeviceTensor.syncs - syncs_before == 1
    assert sorted(map(sorted, groups)) == [[80], [90, 100]]  # two config groups
    assert case.step.failures == {}
    assert sorted(compactions) == sorted(case.step.req_ids)
    for request_id, prompt in zip(case.step.req_ids[:3], (100, 80, 90)):
        config = case.state.requests[request_id].config
        policy = config.policy
        if config.budget_sharing == "auto":  # a window scored it: shared per layer
            policy = replace(policy, budget_sharing="layer")
        plan = plan_keep(policy, [prompt], [host_scores[request_id]], num_layers=2,
                         num_kv_heads=2)
        assert compactions[request_id].physical_lengths.tolist() == plan.counts[0].reshape(
            4).tolist()
    for request_id in case.step.req_ids[3:]:
        assert compactions[request_id].physical_lengths.tolist() == [130] * 4
        assert compactions[request_id].kind == "decode"
    assert is_on_device(case.state.requests[case.step.req_ids[3]].decode_scores)  # carried


def test_on_cuda_the_retry_policy_and_a_sound_step_add_no_sync(emulated_device, monkeypatch):
    """With the worker's device reported as CUDA, a step without errors never probes the
    context (the probe is a synchronisation): still one transfer. A step whose planning
    raises on the host probes once, then retries request by request as on CPU."""
    probes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: probes.append(device))
    case, _, _ = step_of_many(monkeypatch)
    case.state.device = torch.device("cuda")
    syncs_before = DeviceTensor.syncs
    compress_step(case.state, case.step, case.pool, CPU_PAGE_FORMAT)
    assert (DeviceTensor.syncs - syncs_before, probes) == (1, [])

    case, _, _ = step_of_many(monkeypatch)
    case.state.device = torch.device("cuda")
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", "plan:90")  # with 100: a group of two
    compactions = compress_step(case.state, case.step, case.pool, CPU_PAGE_FORMAT)
    assert list(case.step.failures) == [case.step.req_ids[2]]
    assert len(compactions) == 5 and len(probes) == 2  # the group's call, then req2's alone


def test_on_cuda_a_device_fault_in_the_moves_stops_the_worker(emulated_device, monkeypatch):
    """A CUDA fault is not retried request by request nor blamed on a request: it is raised
    again (the worker fails, vLLM fails the engine). A host error in the moves is retried."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    class FailingMover:
        def __init__(self, error: Exception) -> None:
            self.error, self.calls = error, 0

        def move(self, pool, src, dst, disjoint=False):
            self.calls += 1
            raise self.error

    case, _, _ = step_of_many(monkeypatch)
    case.state.device = torch.device("cuda")
    mover = FailingMover(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError) as raised:
        compress_step(case.state, case.step, case.pool, mover)
    assert raised.value is mover.error and mover.calls == 1
    assert case.step.failures == {}  # no request blamed for it

    case, _, _ = step_of_many(monkeypatch)
    case.state.device = torch.device("cuda")
    mover = FailingMover(ValueError("a bad slot list, refused on the host"))
    assert compress_step(case.state, case.step, case.pool, mover) == {}
    assert sorted(case.step.failures) == sorted(case.step.req_ids)
    assert mover.calls == 2 + 6  # each batch, then each request alone
