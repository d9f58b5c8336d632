"""Observation-window scores: reference vs dense naive loops, Triton vs reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcompress.kernels import (
    paged_attention_ref,
    window_scores,
    window_scores_ref,
    window_scores_triton,
)
from tests.kernels.kernel_cases import (
    MODEL_SOFTMAXES,
    PagedCase,
    dense_window_scores,
    make_case,
    model_softmax,
)

# Last prefill chunks (with prior context, unequal heads), a request without window rows in this
# chunk (window_start == query_len) and a decode row (H2O-style).
SCENARIO = ([9, 4, 12, 1], [[20, 6], [11, 11], [0, 0], [30, 9]])
WINDOW_START = [3, 4, 2, 0]
SCORE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def run_scores(case: PagedCase, kernel, window_start: list[int], max_len: int, **kwargs):
    device = case.query.device
    scores = torch.full((len(window_start), case.page_tables.shape[1], max_len), 0.5, device=device)
    kernel(
        case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
        torch.tensor(window_start, dtype=torch.int32, device=device), case.scale, scores, **kwargs,
    )
    return scores - 0.5  # the kernels accumulate: remove the initial content


@pytest.mark.parametrize(
    "page_size, head_size, group, dtype",
    list(itertools.product([8, 32], [64, 128], [1, 3, 8], [torch.float32, torch.bfloat16])),
)
def test_reference_matches_dense(page_size, head_size, group, dtype):
    case = make_case(*SCENARIO, group=group, head_size=head_size, page_size=page_size, dtype=dtype)
    max_len = int(case.kv_lens.max()) + 5
    expected = dense_window_scores(case, WINDOW_START, max_len)
    scores = run_scores(case, window_scores_ref, WINDOW_START, max_len)
    torch.testing.assert_close(scores.double(), expected, **SCORE_TOLERANCE)
    # Each window row contributes probability mass 1 per query head of the group.
    rows = sum(q - w for q, w in zip(case.query_lens, WINDOW_START, strict=True))
    assert abs(float(scores.sum()) - rows * group * case.page_tables.shape[1]) < 1e-3


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    "page_size, head_size, group, dtype",
    list(itertools.product([8, 16, 32], [64, 128], [1, 3, 8], [torch.float32, torch.bfloat16]))
    + [(16, 64, 3, torch.float16), (16, 128, 8, torch.float16)],
)
def test_triton_matches_reference(device, page_size, head_size, group, dtype):
    case = make_case(*SCENARIO, group=group, head_size=head_size, page_size=page_size, dtype=dtype)
    case = case.to(device)
    max_len = int(case.kv_lens.max()) + 5
    expected = run_scores(case, window_scores_ref, WINDOW_START, max_len)
    scores = run_scores(case, window_scores_triton, WINDOW_START, max_len)
    torch.testing.assert_close(scores, expected, **SCORE_TOLERANCE)
    assert torch.all(scores[:, :, int(case.kv_lens.max()) :] == 0)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_with_attention_lse_and_hints(device, dtype):
    """The LSE from paged attention replaces the statistics pass; hints give the same result."""
    case = make_case(*SCENARIO, group=3, head_size=64, page_size=16, dtype=dtype).to(device)
    max_len = int(case.kv_lens.max())
    lse = torch.empty(case.query.shape[:2], device=device)
    paged_attention_ref(
        case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc, case.scale,
        torch.empty_like(case.query), lse_out=lse,
    )
    expected = run_scores(case, window_scores_ref, WINDOW_START, max_len)
    scores = run_scores(
        case, window_scores_triton, WINDOW_START, max_len,
        softmax_lse=lse, max_window_len=10, max_kv_len=max_len,
    )
    torch.testing.assert_close(scores, expected, **SCORE_TOLERANCE)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_reference_matches_dense_with_model_softmax(kind, group):
    case = make_case(*SCENARIO, group=group, head_size=64, page_size=8)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    max_len = int(case.kv_lens.max()) + 5
    expected = dense_window_scores(case, WINDOW_START, max_len, **softmax)
    assert (expected - dense_window_scores(case, WINDOW_START, max_len)).abs().max() > 0.05
    scores = run_scores(case, window_scores_ref, WINDOW_START, max_len, **softmax)
    torch.testing.assert_close(scores.double(), expected, **SCORE_TOLERANCE)
    # With sinks the real keys get less than each row's whole mass: the sink takes the rest.
    rows = sum(q - w for q, w in zip(case.query_lens, WINDOW_START, strict=True))
    full_mass = rows * group * case.page_tables.shape[1]
    if "sinks" in softmax:
        assert float(scores.sum()) < full_mass - 1
    else:
        assert abs(float(scores.sum()) - full_mass) < 1e-3


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_triton_matches_reference_with_model_softmax(device, kind, dtype):
    case = make_case(*SCENARIO, group=3, head_size=64, page_size=8, dtype=dtype).to(device)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    max_len = int(case.kv_lens.max()) + 5
    expected = run_scores(case, window_scores_ref, WINDOW_START, max_len, **softmax)
    scores = run_scores(case, window_scores_triton, WINDOW_START, max_len, **softmax)
    torch.testing.assert_close(scores, expected, **SCORE_TOLERANCE)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("kind", MODEL_SOFTMAXES)
def test_triton_with_the_lse_of_attention_under_the_same_softmax(device, kind):
    """Paged attention's LSE includes the sink and the cap: it replaces the statistics pass."""
    case = make_case(*SCENARIO, group=3, head_size=64, page_size=16).to(device)
    softmax = model_softmax(kind, case.query.shape[1], device=case.query.device)
    max_len = int(case.kv_lens.max())
    lse = torch.empty(case.query.shape[:2], device=device)
    paged_attention_ref(
        case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc, case.scale,
        torch.empty_like(case.query), lse_out=lse, **softmax,
    )
    expected = run_scores(case, window_scores_ref, WINDOW_START, max_len, **softmax)
    scores = run_scores(case, window_scores_triton, WINDOW_START, max_len, softmax_lse=lse,
                        **softmax)
    torch.testing.assert_close(scores, expected, **SCORE_TOLERANCE)


@pytest.mark.usefixtures("needs_triton")
def test_h2o_decode_accumulation(device):
    """Decode batch, window = the decode token; repeated calls accumulate."""
    case = make_case([1, 1, 1], [[40, 3], [7, 19], [0, 25]], group=8, head_size=64, page_size=8)
    case = case.to(device)
    dense = dense_window_scores(case, [0, 0, 0], 41)
    scores = torch.zeros(3, 2, 41, device=device)
    window = torch.zeros(3, dtype=torch.int32, device=device)
    for _ in range(2):
        window_scores(
            case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc, window,
            case.scale, scores, use_triton=True,
        )
    torch.testing.assert_close(scores.cpu().double(), 2 * dense, **SCORE_TOLERANCE)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("kernel", [window_scores_ref, window_scores_triton])
def test_no_window_rows_leaves_scores_untouched(device, kernel):
    case = make_case([5, 2], [[3, 4], [8, 1]], group=2, head_size=64, page_size=8).to(device)
    scores = run_scores(case, kernel, [5, 2], 20)
    assert torch.all(scores == 0)
