"""The host/device boundary of a step, checked on CPU with an emulated device (a GPU's rules:
device tensors cannot become numpy or index host tensors, and reading them on the host is a
synchronisation): the plan is made where the window scores are and comes to the host once,
so does a decode eviction's choice; preparing and finishing a step read nothing back from the
device."""

from __future__ import annotations

import pytest
import torch

from kvcompress.attention.decode_scores import score_decode_layer
from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.config import KVCompressionConfig
from kvcompress.engine import worker_compaction
from kvcompress.engine.worker_compaction import compact_completed_prompts, evict_generated_tokens
from kvcompress.engine.worker_state import WorkerKVState
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.policies import KeepPlan, plan_keep
from tests.device_emulation import DeviceTensor, is_on_device, on_device
from tests.engine.test_worker_compaction import labelled_case, token_ids_in_slots
from tests.paged_cases import build_case


@pytest.fixture
def emulated_device(monkeypatch):
    """The worker's device tensors (step batch, score accumulators) become DeviceTensors."""
    monkeypatch.setattr(WorkerKVState, "to_device", lambda self, tensor: on_device(tensor))
    DeviceTensor.syncs = 0


@pytest.mark.parametrize("method", ["pyramidkv", "snapkv", "adakv", "streamingllm"])
def test_a_plan_made_on_the_device_is_brought_to_the_host_for_the_moves(monkeypatch, method):
    # plan_keep returns its plan on the scores' device (documented); emulate that device.
    def plan_on_device(*args, **kwargs):
        plan = plan_keep(*args, **kwargs)
        return KeepPlan(*(on_device(tensor) for tensor in
                          (plan.counts, plan.indices, plan.prompt_lens, plan.compressed)))

    monkeypatch.setattr(worker_compaction, "plan_keep", plan_on_device)
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
        plan.tokens, plan.page_ids, plan.lengths, plan.key_positions, plan.prompt_kept,
        plan.offsets, plan.mass))
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
