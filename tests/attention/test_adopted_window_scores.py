"""Window scores of a request that adopted a cached context (multi-turn reuse): its rows hold
different numbers of adopted tokens, its observation window lies in its new prompt tokens,
and every window query's probabilities are the model's softmax over exactly its row's keys
(adopted and new), accumulated by physical slot. Torch path on both page formats and the
Triton kernel under the interpreter, each against a dense reference; a plain request in the
same step is scored as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.attention.gpu_kernel import TritonPagedKernel
from kvcompress.attention.window_scores import accumulate_window_scores
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT, PageFormat
from kvcompress.policies import aggregate_window_probs
from tests.paged_cases import PagedCase, build_case, model_softmax

LAYERS, HEADS, GROUP, HEAD_SIZE, PAGE_SIZE = 2, 2, 3, 32, 8
ADOPTED_ROWS = [7, 19, 3, 12]  # per (layer, head) row: each head kept its own share
ADOPTED_LEN, NEW_TOKENS = 20, 10  # logical tokens adopted, new prompt tokens prefilled
PLAIN_PROMPT = 18  # a second request, its whole prompt in the step
SCALE = HEAD_SIZE**-0.5


def adopter_case(page_format: PageFormat, window: int) -> PagedCase:
    """req0 adopted ``ADOPTED_ROWS`` and prefills its new tokens, req1 a plain prompt; both
    score their windows. The pool is loud garbage (50) outside the rows' tokens."""
    prompt_lens = [ADOPTED_LEN + NEW_TOKENS, PLAIN_PROMPT]
    case = build_case(page_format, [ADOPTED_ROWS, [0] * 4], [NEW_TOKENS, PLAIN_PROMPT],
                      num_layers=LAYERS, num_kv_heads=HEADS, group=GROUP,
                      head_size=HEAD_SIZE, page_size=PAGE_SIZE, dtype=torch.float32,
                      prompt_lens=prompt_lens, window=window)
    # As an adopting page delta leaves it (WorkerKVState._adopt), then vLLM's step from
    # logical position ADOPTED_LEN on.
    request = case.state.requests["req0"]
    request.adopted_len, request.adopted_rows = ADOPTED_LEN, request.lengths.copy()
    case.step = case.state.prepare_step(
        ["req0", "req1"], np.array([NEW_TOKENS, PLAIN_PROMPT]), np.array([ADOPTED_LEN, 0]),
        np.array(prompt_lens), observation_windows=[window, window],
        wants_compression=[True, True])
    for row in range(LAYERS * HEADS):
        page_format.write_tokens(case.pool, case.new_keys[:, row], case.new_values[:, row],
                                 case.step.slot_mapping[:, row])
    return case


def dense_scores(case: PagedCase, index: int, layer: int, group_reduce: str,
                 soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Expected accumulator ``[H, width]`` of request ``index`` for ``layer``, written out:
    each window query of each head against its own row's keys (old and new), soft-capped,
    causal, the sink in the denominator; nothing past the row's keys."""
    window = case.step.window_queries[[w.batch_index for w in case.step.window_queries]
                                      .index(index)]
    first, last = case.step.query_start_loc[index], case.step.query_start_loc[index + 1]
    expected = torch.zeros(HEADS, window.scores.shape[-1], dtype=torch.float64)
    for head in range(HEADS):
        row = layer * HEADS + head
        keys = torch.cat([case.old_keys[index, row], case.new_keys[first:last, row]]).double()
        before = case.old_keys[index, row].shape[0]
        offsets = window.first_query + torch.arange(window.num_queries)
        queries = case.query[first + offsets, head * GROUP:(head + 1) * GROUP].double()
        logits = torch.einsum("wgd,sd->gws", queries, keys) * SCALE  # [G, w, S_row]
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        future = torch.arange(keys.shape[0])[None, :] > (before + offsets)[:, None]
        logits = logits.masked_fill(future, -torch.inf)
        sink = torch.full((GROUP, window.num_queries, 1), -torch.inf, dtype=torch.float64)
        if sinks is not None:
            sink = sinks[head * GROUP:(head + 1) * GROUP].double().view(GROUP, 1, 1)
            sink = sink.expand(GROUP, window.num_queries, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        expected[head, : keys.shape[0]] = aggregate_window_probs(probs[None], group_reduce)[0]
    return expected


def check_against_dense(case: PagedCase, group_reduce: str, softmax: dict) -> None:
    adopter, plain = case.step.window_queries
    for layer in range(LAYERS):
        for index, window in ((0, adopter), (1, plain)):
            want = dense_scores(case, index, layer, group_reduce, **softmax)
            torch.testing.assert_close(window.scores[layer].double(), want, atol=2e-5,
                                       rtol=2e-5)
    # every adopted key is scored (the window sees the whole context), in its own row
    for row, adopted in enumerate(ADOPTED_ROWS):
        layer, head = divmod(row, HEADS)
        assert (adopter.scores[layer, head, :adopted] > 0).all()
        assert not adopter.scores[layer, head, adopted + NEW_TOKENS:].any()


def score(case: PagedCase, page_format: PageFormat, group_reduce: str, softmax: dict,
          kernel: TritonPagedKernel | None = None) -> None:
    """Every layer's window scores: the torch path, or the GPU kernel adapter's."""
    for window in case.step.window_queries:
        window.group_reduce = group_reduce
    args = None if kernel is None else kernel.prepare(case.step)
    for layer in range(LAYERS):
        keys = case.new_keys[:, case.step.layer_rows(layer)]
        if kernel is None:
            accumulate_window_scores(case.query, case.pool, page_format, case.step, layer,
                                     SCALE, key=keys, **softmax)
        else:
            kernel.accumulate_window_scores(args, layer, case.query, keys, case.pool,
                                            case.step, SCALE, **softmax)


@pytest.mark.parametrize("window", [6, 16], ids=["window_in_segment", "window_over_segment"])
def test_an_adopters_window_is_in_its_new_prompt_tokens(window):
    case = adopter_case(CPU_PAGE_FORMAT, window)
    adopter, plain = case.step.window_queries
    num_queries = min(window, NEW_TOKENS)
    assert (adopter.first_query, adopter.num_queries) == (NEW_TOKENS - num_queries,
                                                          num_queries)
    assert adopter.scores.shape == (LAYERS, HEADS, max(ADOPTED_ROWS) + NEW_TOKENS)
    assert plain.scores.shape == (LAYERS, HEADS, PLAIN_PROMPT)


@pytest.mark.parametrize("softmax_kind", [None, "both"])
@pytest.mark.parametrize("group_reduce", ["mean", "max"])
@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT], ids=["cpu", "gpu"])
@pytest.mark.parametrize("window", [6, 16])
def test_torch_path_scores_ragged_rows_like_the_dense_reference(page_format, group_reduce,
                                                                softmax_kind, window):
    case = adopter_case(page_format, window)
    softmax = {} if softmax_kind is None else model_softmax(softmax_kind, HEADS * GROUP)
    score(case, page_format, group_reduce, softmax)
    check_against_dense(case, group_reduce, softmax)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("softmax_kind", [None, "both"])
@pytest.mark.parametrize("group_reduce", ["mean", "sum", "max"])
def test_triton_path_scores_ragged_rows_like_the_dense_reference(group_reduce, softmax_kind):
    # "mean" / "sum": the Triton kernel with per-row lengths; "max": the torch fallback.
    case = adopter_case(GPU_PAGE_FORMAT, 6)
    softmax = {} if softmax_kind is None else model_softmax(softmax_kind, HEADS * GROUP)
    kernel = TritonPagedKernel(case.layout, torch.float32, use_triton=True)
    score(case, GPU_PAGE_FORMAT, group_reduce, softmax, kernel)
    check_against_dense(case, group_reduce, softmax)
