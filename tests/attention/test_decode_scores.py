"""Decode scores (h2o / snapkv decode eviction) against a dense loop reference: which requests
a step scores, the probabilities each query gives its row's generated tokens (rows of their
own lengths), the GQA reduction, and a scoring failure that stays with its request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.attention import decode_scores
from kvcompress.attention.decode_scores import (
    accumulate_decode_scores,
    accumulate_decode_scores_batch,
)
from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.layer import attend_layer
from kvcompress.config import KVCompressionConfig
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.step import UNSCALED, PagedAttentionMetadata
from tests.paged_cases import build_case, model_softmax

LAYERS, HEADS, GROUP, HEAD_SIZE = 2, 2, 2, 32
SCALE = HEAD_SIZE**-0.5
ENGINE = KVCompressionConfig.from_mapping(
    {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 4})
H2O = ENGINE.with_request_overrides(
    {"kv_decode_policy": "h2o", "kv_decode_budget": 16, "kv_decode_interval": 8})
SNAPKV = H2O.with_request_overrides({"kv_decode_policy": "snapkv"})
WINDOW = H2O.with_request_overrides({"kv_decode_policy": "window"})

# (config, per-row lengths before the step, new tokens, per-row generated tokens before it;
# None: prompt not complete). Decode budget 16 + interval 8: accumulators of 24 offsets.
REQUESTS = [
    (H2O, [30, 17, 25, 40], 1, [10, 10, 8, 10]),  # scored (rows may differ)
    (H2O, [40] * 4, 7, None),  # a prefill chunk: not scored
    (WINDOW, [20] * 4, 1, [10] * 4),  # no scores
    (SNAPKV, [26, 30, 28, 27], 1, [21] * 4),  # 22 after the step: in the last 4 -> scored
    (SNAPKV, [26, 30, 28, 27], 1, [11] * 4),  # 12 after the step: not yet
]
SCORED = [0, 3]
PROMPT_LENS = [20, 47, 10, 5, 15]


def decode_case(page_format, seed=0, page_size=16, kv_scales=UNSCALED):
    case = build_case(page_format, [lengths for _, lengths, _, _ in REQUESTS],
                      [new for _, _, new, _ in REQUESTS], num_layers=LAYERS,
                      num_kv_heads=HEADS, group=GROUP, head_size=HEAD_SIZE,
                      page_size=page_size, dtype=torch.float32, seed=seed,
                      prompt_lens=PROMPT_LENS, kv_scales=kv_scales)
    for index, (config, lengths, _, generated) in enumerate(REQUESTS):
        request = case.state.requests[f"req{index}"]
        request.config = config
        if generated is not None:
            request.prompt_kept = np.array(lengths) - np.array(generated)
    return case


def dense_decode_scores(case, index, group_reduce, soft_cap=None, sinks=None):
    """Loop reference of one request's share: [L, H, 24] added by its decode query, under the
    model's softmax (soft-capped logits; a sink logit per query head in the denominator)."""
    _, lengths, _, generated = REQUESTS[index]
    token = case.step.query_start_loc[index]
    out = torch.zeros(LAYERS, HEADS, 24, dtype=torch.float64)
    for layer in range(LAYERS):
        for head in range(HEADS):
            row = layer * HEADS + head
            keys = torch.cat([case.old_keys[index, row], case.new_keys[token:token + 1, row]])
            queries = case.query[token, head * GROUP:(head + 1) * GROUP].double()
            logits = queries @ keys.double().T * SCALE  # [G, S]
            if soft_cap is not None:
                logits = soft_cap * torch.tanh(logits / soft_cap)
            if sinks is not None:
                sink = sinks[head * GROUP:(head + 1) * GROUP].double()[:, None]
                logits = torch.cat([logits, sink], dim=-1)
            probs = torch.softmax(logits, dim=-1)[:, : keys.shape[0]]
            reduced = {"mean": probs.mean(0), "max": probs.amax(0), "sum": probs.sum(0)}
            prompt_kept = lengths[row] - generated[row]
            mass = reduced[group_reduce][prompt_kept:]  # the generated part, new token too
            out[layer, head, : len(mass)] = mass
    return out


def test_a_step_scores_only_decoding_requests_whose_policy_scores_it():
    case = decode_case(GPU_PAGE_FORMAT)
    case.state.prepare_decode_scoring(case.step)
    decodes = case.step.decode_queries
    assert [decode.batch_index for decode in decodes] == SCORED
    assert [decode.num_generated for decode in decodes] == [11, 22]
    assert [decode.prompt_len for decode in decodes] == [PROMPT_LENS[i] for i in SCORED]
    for decode in decodes:
        request = case.state.requests[f"req{decode.batch_index}"]
        assert decode.scores is request.decode_scores
        assert decode.scores.shape == (LAYERS, HEADS, 24) and not decode.scores.any()
        assert decode.prompt_kept.tolist() == request.prompt_kept.tolist()
    unscored = [case.state.requests[f"req{i}"].decode_scores for i in (1, 2, 4)]
    assert unscored == [None, None, None]


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT])
@pytest.mark.parametrize("group_reduce", ["mean", "max", "sum"])
def test_decode_scores_match_dense_probabilities_over_the_generated_part(page_format,
                                                                        group_reduce):
    case = decode_case(page_format, seed=1)
    case.state.prepare_decode_scoring(case.step)
    # h2o carries mass from earlier steps: this step adds to it
    earlier = torch.rand(LAYERS, HEADS, 24, generator=torch.Generator().manual_seed(2))
    case.step.decode_queries[0].scores += earlier
    for decode in case.step.decode_queries:
        decode.group_reduce = group_reduce
    for layer in range(LAYERS):
        rows = case.step.layer_rows(layer)
        page_format.write_tokens(case.pool, case.new_keys[:, rows].reshape(-1, HEAD_SIZE),
                                 case.new_values[:, rows].reshape(-1, HEAD_SIZE),
                                 case.step.slot_mapping[:, rows].reshape(-1))
        for decode in case.step.decode_queries:
            accumulate_decode_scores(case.query, case.pool, page_format, case.step, decode,
                                     layer, SCALE)
    for decode in case.step.decode_queries:
        want = dense_decode_scores(case, decode.batch_index, group_reduce)
        if decode.batch_index == 0:
            want += earlier.double()
        torch.testing.assert_close(decode.scores.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT])
@pytest.mark.parametrize("max_gathered", [1, 1 << 24])
@pytest.mark.parametrize("group_reduces", [["max"], ["mean", "max", "sum"]],
                         ids=["max", "mixed"])
def test_batched_decode_scores_match_one_request_at_a_time(monkeypatch, page_format,
                                                           max_gathered, group_reduces):
    """All requests in one gather (or in chunks of one: ``max_gathered``), rows padded to the
    longest, give each request the scores it gets alone, also when requests combine their
    query heads differently."""
    monkeypatch.setattr(decode_scores, "MAX_GATHERED_ELEMENTS", max_gathered)
    alone, batched = (decode_case(page_format, seed=6) for _ in range(2))
    softmax = model_softmax("both", HEADS * GROUP)
    for case in (alone, batched):
        case.state.prepare_decode_scoring(case.step)
        for number, decode in enumerate(case.step.decode_queries):
            decode.group_reduce = group_reduces[number % len(group_reduces)]
    for layer in range(LAYERS):
        for case in (alone, batched):
            rows = case.step.layer_rows(layer)
            page_format.write_tokens(case.pool, case.new_keys[:, rows].reshape(-1, HEAD_SIZE),
                                     case.new_values[:, rows].reshape(-1, HEAD_SIZE),
                                     case.step.slot_mapping[:, rows].reshape(-1))
        for decode in alone.step.decode_queries:
            accumulate_decode_scores(alone.query, alone.pool, page_format, alone.step, decode,
                                     layer, SCALE, **softmax)
        accumulate_decode_scores_batch(batched.query, batched.pool, page_format, batched.step,
                                       batched.step.decode_queries, layer, SCALE, **softmax)
    for one, other in zip(alone.step.decode_queries, batched.step.decode_queries):
        torch.testing.assert_close(other.scores, one.scores, atol=1e-6, rtol=1e-5)


def run_layers(case, **softmax):
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=False)
    total = case.query.shape[0]
    metadata = PagedAttentionMetadata(case.step, total, kernel, kernel.prepare(case.step), {})
    for layer in range(LAYERS):
        rows = case.step.layer_rows(layer)
        attend_layer(metadata, layer, case.query, case.new_keys[:, rows],
                     case.new_values[:, rows], case.pool, torch.empty_like(case.query), SCALE,
                     **softmax)


def test_attention_layers_collect_decode_scores():
    case = decode_case(GPU_PAGE_FORMAT, seed=3)
    case.state.prepare_decode_scoring(case.step)
    run_layers(case)
    assert not case.step.failures
    for index in SCORED:
        torch.testing.assert_close(case.state.requests[f"req{index}"].decode_scores.double(),
                                   dense_decode_scores(case, index, "mean"),
                                   atol=1e-5, rtol=1e-5)


def test_anchors_collect_the_mass_of_the_newest_window_offsets_apart():
    case = decode_case(GPU_PAGE_FORMAT, seed=7)
    request = case.state.requests["req0"]
    request.config = H2O.with_request_overrides({"kv_decode_policy": "anchors"})
    case.state.prepare_decode_scoring(case.step)
    assert request.anchor_scores is not None and not request.anchor_scores.any()
    earlier = torch.rand(LAYERS, HEADS, 24, generator=torch.Generator().manual_seed(8))
    request.anchor_scores += earlier  # carried from earlier steps: this step adds to it
    run_layers(case)
    assert not case.step.failures
    dense = dense_decode_scores(case, 0, "mean")
    torch.testing.assert_close(request.decode_scores.double(), dense, atol=1e-5, rtol=1e-5)
    # 11 generated offsets after this step, window 4: only offsets 7..10 are young enough
    young = torch.zeros(24, dtype=torch.bool)
    young[7:11] = True
    torch.testing.assert_close(request.anchor_scores.double(),
                               earlier.double() + torch.where(young, dense, 0.0),
                               atol=1e-5, rtol=1e-5)
    assert case.state.requests["req3"].anchor_scores is None  # snapkv collects none


@pytest.mark.parametrize("kind", ["soft_cap", "sinks", "both"])
def test_decode_scores_use_the_model_softmax(kind):
    case = decode_case(GPU_PAGE_FORMAT, seed=5)
    case.state.prepare_decode_scoring(case.step)
    softmax = model_softmax(kind, HEADS * GROUP)
    run_layers(case, **softmax)
    assert not case.step.failures
    for index in SCORED:
        want = dense_decode_scores(case, index, "mean", **softmax)
        torch.testing.assert_close(case.state.requests[f"req{index}"].decode_scores.double(),
                                   want, atol=1e-5, rtol=1e-5)


def test_a_decode_scoring_failure_fails_only_its_request(monkeypatch):
    case = decode_case(GPU_PAGE_FORMAT, seed=4)
    case.state.prepare_decode_scoring(case.step)
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", f"score:{PROMPT_LENS[3]}")
    run_layers(case)
    assert set(case.step.failures) == {"req3"}
    assert "decode scoring failed" in case.step.failures["req3"]
    assert [decode.batch_index for decode in case.step.decode_queries] == [0]
    assert not case.state.requests["req3"].decode_scores.any()
    torch.testing.assert_close(case.state.requests["req0"].decode_scores.double(),
                               dense_decode_scores(case, 0, "mean"), atol=1e-5, rtol=1e-5)
