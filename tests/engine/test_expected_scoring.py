"""``--kv-scoring expected`` on the worker, without vLLM: the scores read from a request's
pages equal the estimator over the same keys held densely, rows of unequal length (an
adopter's) included, and sliding-window layers stay unscored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.attention.expected_scores import expected_scores, mean_rotation
from kvcompress.engine.worker.expected import ExpectedScorer
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageTableDelta
from kvcompress.paging.page_format import CPU_PAGE_FORMAT, GPU_PAGE_FORMAT
from kvcompress.profile_model.profiles import QueryProfile

LAYERS, HEADS, GROUP, DIM, PAGE = 3, 2, 2, 16, 8


def make_profile(generator: torch.Generator) -> QueryProfile:
    factor = torch.randn(LAYERS, HEADS * GROUP, DIM, DIM, generator=generator) * 0.2
    return QueryProfile(torch.randn(LAYERS, HEADS * GROUP, DIM, generator=generator),
                        factor @ factor.transpose(-1, -2),
                        1.0 / 500.0 ** (torch.arange(0, DIM, 2).float() / DIM), DIM, 1.0,
                        DIM**-0.5, "test", 10)


@pytest.mark.parametrize("page_format", [CPU_PAGE_FORMAT, GPU_PAGE_FORMAT],
                         ids=["transposed", "row"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "middle-layer-slides"])
@pytest.mark.parametrize("max_elements", [None, 1], ids=["one-chunk", "page-chunks"])
def test_scores_from_pages_match_dense_keys(page_format, sliding, max_elements):
    """Also when the keys are read a page at a time (``max_elements``)."""
    lengths = [21, 21, 17, 30, 9, 21]
    needed = [-(-length // PAGE) for length in lengths]
    total = sum(needed) + 3
    layout = PageLayout(LAYERS, HEADS, DIM, PAGE, 4, total,
                        layer_windows=(0, 64, 0) if sliding else ())
    state = WorkerKVState(layout, torch.device("cpu"))
    ids = np.random.default_rng(0).permutation(total).astype(np.int32)[: sum(needed)]
    state.apply_deltas({"r": PageTableDelta(fresh=True,
                                            appends=[(np.array(needed, np.int32), ids)])})
    request = state.requests["r"]
    request.lengths = np.array(lengths, dtype=np.int64)
    request.adopted_len, request.adopted_rows = 10, np.array(lengths, dtype=np.int64) - 5
    request.prompt_len = 15  # 5 new tokens after each row's adopted slots
    pool = torch.full((total, 2, PAGE, DIM), 50.0)
    generator = torch.Generator().manual_seed(2)
    dense = []
    for row, length in enumerate(lengths):
        keys, values = torch.randn(2, length, DIM, generator=generator)
        positions = torch.arange(length)
        slots = torch.as_tensor(request.table.pages[row])[positions // PAGE].long() * PAGE
        page_format.write_tokens(pool, keys, values, slots + positions % PAGE)
        dense.append(keys)
    profile = make_profile(generator)
    scores = ExpectedScorer(profile, layout, torch.device("cpu")).score(
        request, pool, page_format, max_elements)
    width = request.score_width()
    assert scores.shape == (LAYERS, HEADS, width) == (LAYERS, HEADS, 30)
    rotation = mean_rotation(profile.inv_freq, request.prompt_len, DIM)
    for layer in range(LAYERS):
        if sliding and layer == 1:
            assert (scores[layer] == 0).all()
            continue
        keys = torch.zeros(HEADS, DIM, width)
        for head in range(HEADS):
            row = layer * HEADS + head
            keys[head, :, : lengths[row]] = dense[row].T
        reference = expected_scores(keys, torch.as_tensor(lengths[layer * HEADS:][:HEADS]),
                                    profile.means[layer], profile.covariances[layer],
                                    rotation, DIM**-0.5)
        torch.testing.assert_close(scores[layer], reference, atol=1e-6, rtol=1e-5)
        assert scores[layer].sum(-1).sub(1).abs().max() < 1e-4  # over each row's slots


def test_query_heads_must_group_into_kv_heads():
    profile = make_profile(torch.Generator().manual_seed(0)).heads_of_rank(0, 4)  # 1 head
    layout = PageLayout(LAYERS, HEADS, DIM, PAGE, 4, 8)
    with pytest.raises(ValueError, match="--kv-profile"):
        ExpectedScorer(profile, layout, torch.device("cpu"))
