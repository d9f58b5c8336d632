"""Decode scores (h2o / snapkv decode eviction) against a dense loop reference: which requests
a step scores, the probabilities each query gives its row's generated tokens (rows of their
own lengths), the GQA reduction, and a scoring failure that stays with its request."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvcompress.attention import decode_scores
from kvcompress.attention import layer as layer_module
from kvcompress.attention.decode_scores import score_decode_layer
from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.layer import attend_layer
from kvcompress.kernels import has_triton_gpu
from kvcompress.kernels.decode_mass import REDUCE_MAX, REDUCE_MEAN, REDUCE_SUM
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import GQA_REDUCE_CODES, UNSCALED, PagedAttentionMetadata
from tests.paged_cases import build_case, model_softmax
from tests.triton_interpreter import use_interpreter

LAYERS, HEADS, GROUP, HEAD_SIZE = 2, 2, 2, 32
SCALE = HEAD_SIZE**-0.5
# The engine's decode budget + interval bound what requests may score (its reserve), and its
# decode policy what each may hold (anchors: two accumulators, room for every policy).
ENGINE = KVCompressionConfig.from_mapping(
    {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 4, "kv_decode_budget": 16,
     "kv_decode_interval": 8, "kv_decode_policy": "anchors"})
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


def decode_case(page_format, seed=0, group_reduces=("mean",), page_size=16,
                kv_scales=UNSCALED):
    """The case with its decode scoring prepared; scored request i combines its query
    heads as ``group_reduces[i % len]`` says."""
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
    for number, index in enumerate(SCORED):
        request = case.state.requests[f"req{index}"]
        # "sum" is no flag value: set past validation (the scores support it)
        request.config = replace(request.config,
                                 gqa_reduce=group_reduces[number % len(group_reduces)])
    case.state.prepare_decode_scoring(case.step)
    return case


def write_layer(case, page_format, layer):
    rows = case.step.layer_rows(layer)
    page_format.write_tokens(case.pool, case.new_keys[:, rows].reshape(-1, HEAD_SIZE),
                             case.new_values[:, rows].reshape(-1, HEAD_SIZE),
                             case.step.slot_mapping[:, rows].reshape(-1))


def dense_decode_scores(case, index, group_reduce, soft_cap=None, sinks=None, prompt_shift=0):
    """Loop reference of one request's share: [L, H, 24] added by its decode query, under the
    model's softmax (soft-capped logits; a sink logit per query head in the denominator).
    ``prompt_shift``: the prompt part is that much longer (the generated one shorter)."""
    _, lengths, _, generated = REQUESTS[index]
    generated = [count - prompt_shift for count in generated]
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
    decodes = case.step.decode_queries
    assert [decode.batch_index for decode in decodes] == SCORED
    assert [decode.num_generated for decode in decodes] == [11, 22]
    assert [decode.prompt_len for decode in decodes] == [PROMPT_LENS[i] for i in SCORED]
    for decode in decodes:
        request = case.state.requests[f"req{decode.batch_index}"]
        assert decode.scores is request.decode_scores
        assert decode.scores.shape == (LAYERS, HEADS, 24) and not decode.scores.any()
    plan = case.step.decode_scoring
    assert plan.tokens.tolist() == [case.step.query_start_loc[i] for i in SCORED]
    assert plan.mass.shape == (2, LAYERS, HEADS, 22) and not plan.mass.any()
    assert plan.group_reduce == "mean" and plan.reduce_codes is None
    for number, index in enumerate(SCORED):
        request = case.state.requests[f"req{index}"]
        lengths = case.step.host_lengths_after[index].reshape(LAYERS, HEADS)
        kept = request.prompt_kept.reshape(LAYERS, HEADS)
        assert (plan.prompt_kept[:, number].numpy() == kept).all()
        assert (plan.lengths[:, number].numpy() == lengths).all()
    # by page-table class (every width its own here, narrowest first): request 3's widest
    # row 31 keys (2 pages), request 0's 41 (3); the pages each holds per layer, its own
    # rows only (no row padded to another's)
    assert [group.host_numbers.tolist() for group in plan.groups] == [[1], [0]]
    assert [group.host_pages.tolist() for group in plan.groups] == [[[4], [4]], [[4], [5]]]
    unscored = [case.state.requests[f"req{i}"].decode_scores for i in (1, 2, 4)]
    assert unscored == [None, None, None]


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT])
@pytest.mark.parametrize("group_reduce", ["mean", "max", "sum"])
def test_decode_scores_match_dense_probabilities_over_the_generated_part(page_format,
                                                                        group_reduce):
    case = decode_case(page_format, seed=1, group_reduces=[group_reduce])
    # h2o carries mass from earlier steps: this step adds to it
    earlier = torch.rand(LAYERS, HEADS, 24, generator=torch.Generator().manual_seed(2))
    case.step.decode_queries[0].scores += earlier
    for layer in range(LAYERS):
        write_layer(case, page_format, layer)
        score_decode_layer(case.query, case.pool, page_format, case.step.decode_scoring,
                           layer, SCALE)
    case.step.decode_scoring.commit(case.step.decode_queries)
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
    query heads differently, and the dense reference's."""
    monkeypatch.setattr(decode_scores, "MAX_GATHERED_ELEMENTS", max_gathered)
    alone, batched = (decode_case(page_format, seed=6, group_reduces=group_reduces)
                      for _ in range(2))
    softmax = model_softmax("both", HEADS * GROUP)
    for layer in range(LAYERS):
        for case in (alone, batched):
            write_layer(case, page_format, layer)
        for number in range(len(SCORED)):
            score_decode_layer(alone.query, alone.pool, page_format, alone.step.decode_scoring,
                               layer, SCALE, requests=slice(number, number + 1), **softmax)
        score_decode_layer(batched.query, batched.pool, page_format,
                           batched.step.decode_scoring, layer, SCALE, **softmax)
    for case in (alone, batched):
        case.step.decode_scoring.commit(case.step.decode_queries)
    for number, (one, other) in enumerate(zip(alone.step.decode_queries,
                                              batched.step.decode_queries)):
        torch.testing.assert_close(other.scores, one.scores, atol=1e-6, rtol=1e-5)
        want = dense_decode_scores(batched, other.batch_index,
                                   group_reduces[number % len(group_reduces)], **softmax)
        torch.testing.assert_close(other.scores.double(), want, atol=1e-5, rtol=1e-5)


def run_layers(case, kernel=None, **attend_kwargs):
    """Every layer's attention over ``case`` through ``kernel`` (default: the Triton adapter
    in torch), then the step's end; ``attend_kwargs``: the softmax, the fp8 scales."""
    if kernel is None:
        kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=False)
    total = case.query.shape[0]
    metadata = PagedAttentionMetadata(case.step, total, kernel, kernel.prepare(case.step), {})
    for layer in range(LAYERS):
        rows = case.step.layer_rows(layer)
        attend_layer(metadata, layer, case.query, case.new_keys[:, rows],
                     case.new_values[:, rows], case.pool, torch.empty_like(case.query), SCALE,
                     **attend_kwargs)
    case.state.finish_step(case.step)  # the step's scores reach the accumulators


def test_attention_layers_collect_decode_scores():
    case = decode_case(GPU_PAGE_FORMAT, seed=3)
    run_layers(case)
    assert not case.step.failures
    for index in SCORED:
        torch.testing.assert_close(case.state.requests[f"req{index}"].decode_scores.double(),
                                   dense_decode_scores(case, index, "mean"),
                                   atol=1e-5, rtol=1e-5)


def test_anchors_collect_the_mass_of_the_newest_window_offsets_apart():
    case = decode_case(GPU_PAGE_FORMAT, seed=7)
    request = case.state.requests["req0"]
    request.config = ENGINE.with_request_overrides({"kv_decode_policy": "anchors"})
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
    softmax = model_softmax(kind, HEADS * GROUP)
    run_layers(case, **softmax)
    assert not case.step.failures
    for index in SCORED:
        want = dense_decode_scores(case, index, "mean", **softmax)
        torch.testing.assert_close(case.state.requests[f"req{index}"].decode_scores.double(),
                                   want, atol=1e-5, rtol=1e-5)


def test_a_decode_scoring_failure_fails_only_its_request(monkeypatch):
    case = decode_case(GPU_PAGE_FORMAT, seed=4)
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", f"score:{PROMPT_LENS[3]}")
    run_layers(case)
    assert set(case.step.failures) == {"req3"}
    assert "decode scoring failed" in case.step.failures["req3"]
    assert [decode.batch_index for decode in case.step.decode_queries] == [0]
    assert not case.state.requests["req3"].decode_scores.any()
    torch.testing.assert_close(case.state.requests["req0"].decode_scores.double(),
                               dense_decode_scores(case, 0, "mean"), atol=1e-5, rtol=1e-5)


def test_sampled_h2o_scores_every_kth_step_and_counts_it_k_times():
    """--kv-decode-score-every 4: a step is scored only when its request's generated part
    reaches a multiple of 4, and then adds 4x the dense probabilities; snapkv's window steps
    are never sampled."""
    case = decode_case(GPU_PAGE_FORMAT, seed=7)
    for index in SCORED:  # h2o at 11 generated tokens after the step, snapkv at 22
        request = case.state.requests[f"req{index}"]
        request.config = request.config.with_request_overrides({"kv_decode_score_every": 4})
    case.step.decode_queries, case.step.decode_scoring = [], None
    case.state.prepare_decode_scoring(case.step)
    assert [decode.batch_index for decode in case.step.decode_queries] == [3]  # 11 % 4 != 0
    assert case.step.decode_queries[0].weight == 1  # snapkv: every window step
    h2o = case.state.requests["req0"]
    h2o.prompt_kept = h2o.prompt_kept + 3  # now 8 generated after the step: sampled
    h2o.decode_scores = None
    case.step.decode_queries, case.step.decode_scoring = [], None
    case.state.prepare_decode_scoring(case.step)
    assert [decode.weight for decode in case.step.decode_queries] == [4, 1]
    run_layers(case)
    want = 4 * dense_decode_scores(case, 0, "mean", prompt_shift=3)
    torch.testing.assert_close(h2o.decode_scores.double(), want, atol=1e-5, rtol=1e-5)


def test_anchors_are_scored_every_step_whatever_the_sampling():
    """--kv-decode-score-every samples h2o only: anchors add each step's mass over the newest
    --kv-window offsets, so steps sampled every K > window would leave offsets that never
    get any anchor mass."""
    case = decode_case(GPU_PAGE_FORMAT, seed=7)
    anchors = case.state.requests["req0"]
    anchors.config = ENGINE.with_request_overrides({"kv_decode_policy": "anchors",
                                                    "kv_decode_score_every": 4})
    case.step.decode_queries, case.step.decode_scoring = [], None
    case.state.prepare_decode_scoring(case.step)
    # 11 generated tokens after this step (not a multiple of 4): scored, counting once
    assert [(decode.batch_index, decode.weight) for decode in case.step.decode_queries] == [
        (0, 1), (3, 1)]


@pytest.mark.parametrize(("every", "min_overlap"), [(1, 1.0), (4, 0.93), (16, 0.88)])
def test_sampled_mass_keeps_nearly_what_the_summed_mass_keeps(every, min_overlap):
    """How far sampling takes h2o from its exact sums, on a synthetic generation of 192 steps
    (budget 128 + interval 64, 8 recent) whose attention favours a few heavy hitters, as
    h2o assumes: the share of the exact choice that the sampled mass keeps too."""
    generator = torch.Generator().manual_seed(11)
    steps, budget, recent, rows = 192, 128, 8, 64
    importance = torch.randn(rows, steps, generator=generator) * 2
    exact = torch.zeros(rows, steps, dtype=torch.float64)
    sampled = torch.zeros_like(exact)
    for step in range(1, steps + 1):  # the query of a step sees the tokens generated so far
        noise = torch.randn(rows, step, generator=generator)
        probs = torch.softmax(importance[:, :step] + noise, dim=-1).double()
        exact[:, :step] += probs
        if step % every == 0:
            sampled[:, :step] += every * probs
    older = steps - recent
    chosen = [torch.topk(scores[:, :older], budget - recent).indices for scores in (exact,
                                                                                    sampled)]
    overlap = [len(set(a.tolist()) & set(b.tolist())) / (budget - recent)
               for a, b in zip(*chosen)]
    assert min(overlap) >= min_overlap, (every, min(overlap))


# ----------------------------------------------------------------- fused into Triton attention


def no_torch_pass(monkeypatch):
    """Fail any decode scoring through the torch second pass."""
    def second_pass(*args, **kwargs):
        raise AssertionError("decode scores took the torch pass")
    monkeypatch.setattr(layer_module, "score_decode_layer", second_pass)


def test_gqa_reduce_codes_are_the_kernels_codes():
    assert [GQA_REDUCE_CODES.index(name) for name in ("mean", "max", "sum")] == \
        [REDUCE_MEAN, REDUCE_MAX, REDUCE_SUM]


@pytest.mark.parametrize("kind", [None, "both"])
@pytest.mark.parametrize("group_reduces", [["sum"], ["mean", "max", "sum"]],
                         ids=["sum", "mixed"])
def test_triton_attention_writes_the_decode_scores_itself(interpreter, monkeypatch, kind,
                                                          group_reduces):
    """The Triton adapter's attention launches give the dense probabilities (and the torch
    pass's scores) with no second pass; the scored requests sit in different width classes
    next to a prefill chunk and unscored decodes."""
    fused, torch_pass = (decode_case(GPU_PAGE_FORMAT, seed=9, group_reduces=group_reduces)
                         for _ in range(2))
    tables = fused.step.tables
    assert len({int(tables.class_of[index]) for index in SCORED}) > 1
    softmax = model_softmax(kind, HEADS * GROUP) if kind else {}
    run_layers(torch_pass, **softmax)
    no_torch_pass(monkeypatch)
    run_layers(fused, TritonPagedKernel(fused.layout, torch.float32, use_triton=True),
               **softmax)
    assert not fused.step.failures
    for number, index in enumerate(SCORED):
        got = fused.state.requests[f"req{index}"].decode_scores
        want = dense_decode_scores(fused, index, group_reduces[number % len(group_reduces)],
                                   **softmax)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, torch_pass.state.requests[f"req{index}"].decode_scores,
                                   atol=1e-6, rtol=1e-5)


def test_sliding_window_layers_stay_unscored_with_the_fused_kernel(interpreter, monkeypatch):
    case = decode_case(GPU_PAGE_FORMAT, seed=10)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    no_torch_pass(monkeypatch)
    metadata = PagedAttentionMetadata(case.step, case.query.shape[0], kernel,
                                      kernel.prepare(case.step), {})
    plan = case.step.decode_scoring
    for layer, window in ((0, 8), (1, None)):  # layer 0 slides: never compressed
        rows = case.step.layer_rows(layer)
        attend_layer(metadata, layer, case.query, case.new_keys[:, rows],
                     case.new_values[:, rows], case.pool, torch.empty_like(case.query), SCALE,
                     sliding_window=window)
    assert not plan.mass[:, 0].any()
    for number, index in enumerate(SCORED):
        want = dense_decode_scores(case, index, "mean")[1, :, :plan.mass.shape[-1]]
        torch.testing.assert_close(plan.mass[number, 1].double(), want, atol=1e-5, rtol=1e-5)


def test_an_injected_scoring_fault_takes_the_torch_pass_and_fails_its_request(interpreter,
                                                                               monkeypatch):
    case = decode_case(GPU_PAGE_FORMAT, seed=4)
    monkeypatch.setenv("KVCOMPRESS_FAULT_INJECTION", f"score:{PROMPT_LENS[3]}")
    run_layers(case, TritonPagedKernel(case.layout, torch.float32, use_triton=True))
    assert set(case.step.failures) == {"req3"}
    torch.testing.assert_close(case.state.requests["req0"].decode_scores.double(),
                               dense_decode_scores(case, 0, "mean"), atol=1e-5, rtol=1e-5)


def test_the_torch_references_keep_the_torch_pass():
    case = decode_case(GPU_PAGE_FORMAT)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=False)
    assert not kernel.fuses_decode_scores(kernel.prepare(case.step), case.step.decode_scoring)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fused_decode_scores_on_the_step_device_match_the_torch_pass(monkeypatch, device):
    """The adapter's own dispatch on CUDA tensors (Triton compiled for the GPU), against the
    torch pass on CPU; "cpu" runs the same test under the interpreter (Triton forced)."""
    if device == "cuda" and not (torch.cuda.is_available() and has_triton_gpu()):
        pytest.skip("no CUDA device with a GPU-enabled Triton")
    if device == "cpu":
        use_interpreter(monkeypatch)
    case = decode_case(GPU_PAGE_FORMAT, seed=12, group_reduces=["max", "mean"])
    softmax = model_softmax("both", HEADS * GROUP)
    kernel = TritonPagedKernel(case.layout, torch.float32,
                               use_triton=True if device == "cpu" else None)
    step = case.step
    tables = step.tables.to(torch.device(device))
    plan = replace(step.decode_scoring, tables=tables, **{
        name: getattr(step.decode_scoring, name).to(device)
        for name in ("tokens", "lengths", "prompt_kept", "mass")})
    moved = replace(step, num_new_tokens=step.num_new_tokens.to(device),
                    lengths_before=step.lengths_before.to(device),
                    slot_mapping=step.slot_mapping.to(device),
                    tables=tables, decode_scoring=plan)
    args = kernel.prepare(moved)
    assert kernel.fuses_decode_scores(args, plan)
    pool, query = case.pool.to(device), case.query.to(device)
    sinks = softmax["sinks"].to(device)
    for layer in range(LAYERS):
        rows = step.layer_rows(layer)
        kernel.write(pool, case.new_keys[:, rows].to(device), case.new_values[:, rows].to(device),
                     moved.slot_mapping[:, rows])
        write_layer(case, GPU_PAGE_FORMAT, layer)
        kernel.attend(args, layer, query, pool, torch.empty_like(query), SCALE,
                      soft_cap=softmax["soft_cap"], sinks=sinks, decode_scoring=plan)
        score_decode_layer(case.query, case.pool, GPU_PAGE_FORMAT, step.decode_scoring, layer,
                           SCALE, **softmax)
    assert step.decode_scoring.mass.abs().sum() > 0
    torch.testing.assert_close(plan.mass.cpu(), step.decode_scoring.mass, atol=1e-5, rtol=1e-4)
