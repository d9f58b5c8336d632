"""The step's decode-scoring plan is ragged and kept between steps (issue 41 item 3): what
a step copies to the device is a few integers per scored row, whatever the longest row
holds (it used to pad every row of every scored request to the longest as int64 page ids,
and copy a host ``mass`` of zeros every scored step); the step's scores live in one device
buffer reused step after step; and the ragged torch pass matches the dense reference."""

from __future__ import annotations

import numpy as np
import torch

from kvcompress.attention.decode_scores import score_decode_layer
from kvcompress.kernels.decode_mass import DecodeScoreTarget, decode_scores_ref
from kvcompress.paging.page_format import GPU_PAGE_FORMAT
from kvcompress.settings.config import KVCompressionConfig
from tests.paged_cases import build_case, model_softmax

LAYERS, HEADS, GROUP, HEAD_SIZE, PAGE = 2, 2, 2, 16, 16
H2O = KVCompressionConfig.from_mapping(
    {"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 4, "kv_decode_policy": "h2o",
     "kv_decode_budget": 16, "kv_decode_interval": 8})
GENERATED = 6


def uneven_case(long_row: int = 1000, short: int = 12):
    """One request whose first row holds its whole prompt (model-wide sharing left it there)
    and ``short`` requests of 20-token rows, all decoding under h2o."""
    rows = LAYERS * HEADS
    lengths = [[long_row] + [20] * (rows - 1)] + [[20 + r % 3] * rows for r in range(short)]
    case = build_case(GPU_PAGE_FORMAT, lengths, [1] * len(lengths), num_layers=LAYERS,
                      num_kv_heads=HEADS, group=GROUP, head_size=HEAD_SIZE, page_size=PAGE,
                      dtype=torch.float32, seed=3)
    for request in case.state.requests.values():
        request.config = H2O
        request.prompt_kept = request.lengths - GENERATED
    return case


def counting_copies(state) -> list[int]:
    """Bytes of every host tensor the worker sends to its device from now on."""
    copied: list[int] = []
    send = state.to_device

    def to_device(tensor):
        copied.append(tensor.numel() * tensor.element_size())
        return send(tensor)

    state.to_device = to_device
    return copied


def next_step(case):
    """The step after ``case.step`` (finished): one more token in every request."""
    state = case.state
    state.finish_step(case.step)
    ids = list(case.step.req_ids)
    lengths = np.stack([state.requests[i].lengths for i in ids])
    # prompt lengths past the rows: no prompt completes, every row's prompt part is kept
    return state.prepare_step(ids, np.ones(len(ids), dtype=np.int64), lengths[:, 0] + 1,
                              lengths[:, 0] + 100, observation_windows=[4] * len(ids),
                              wants_compression=[False] * len(ids))


def test_a_step_copies_a_few_integers_per_scored_row_whatever_the_longest_row():
    for long_row in (40, 1000, 4000):
        case = uneven_case(long_row)
        case.state.prepare_decode_scoring(case.step)  # the accumulators: once per request
        step = next_step(case)
        copied = counting_copies(case.state)
        case.state.prepare_decode_scoring(step)
        scored = len(step.decode_queries)
        assert scored == 13
        rows = scored * LAYERS * HEADS
        # int32 lengths and prompt parts per row, a token, a class and a column per request
        assert sum(copied) <= 8 * rows + 3 * 8 * scored, (long_row, sum(copied))


def test_the_step_scores_live_in_one_device_buffer_kept_between_steps():
    case = uneven_case()
    case.state.prepare_decode_scoring(case.step)
    first = case.step.decode_scoring
    first.mass.fill_(7.0)  # a layer's scores left in the buffer
    step = next_step(case)
    case.state.prepare_decode_scoring(step)
    second = step.decode_scoring
    assert second.mass.untyped_storage().data_ptr() == first.mass.untyped_storage().data_ptr()
    assert second.mass.shape[-1] == GENERATED + 2 and not second.mass.any()  # zeroed


def test_the_ragged_pass_matches_the_dense_reference():
    """Each row's own pages, in one class or several, against the kernels' dense reference
    of the whole (the model's softmax: soft cap and sinks)."""
    case = uneven_case(long_row=300, short=5)
    case.state.prepare_decode_scoring(case.step)
    plan = case.step.decode_scoring
    softmax = model_softmax("both", HEADS * GROUP)
    step = case.step
    count = len(step.decode_queries)
    for layer in range(LAYERS):
        rows = step.layer_rows(layer)
        GPU_PAGE_FORMAT.write_tokens(case.pool, case.new_keys[:, rows].reshape(-1, HEAD_SIZE),
                                     case.new_values[:, rows].reshape(-1, HEAD_SIZE),
                                     step.slot_mapping[:, rows].reshape(-1))
        score_decode_layer(case.query, case.pool, GPU_PAGE_FORMAT, plan, layer, HEAD_SIZE**-0.5,
                           **softmax)
        width = plan.mass.shape[-1]
        target = DecodeScoreTarget(torch.arange(count, dtype=torch.int32),
                                   plan.prompt_kept[layer],
                                   torch.zeros(count, dtype=torch.int64),
                                   torch.zeros(count, HEADS, width))
        held = [case.state.requests[request_id].table.pages[rows]
                for request_id in step.req_ids]
        widest = max(pages.shape[1] for pages in held)
        tables = torch.stack([torch.as_tensor(np.pad(pages, ((0, 0), (0, widest - pages.shape[1])))
                                              .astype(np.int64)) for pages in held])
        kv_lens = torch.as_tensor(step.host_lengths_after[:, rows])
        decode_scores_ref(case.query, case.pool, tables, kv_lens,
                          torch.as_tensor(step.query_start_loc), HEAD_SIZE**-0.5, target,
                          **softmax)
        torch.testing.assert_close(plan.mass[:, layer], target.mass, atol=1e-6, rtol=1e-5)
