"""Fused decode scores (``paged_attention(decode_scores=...)``): the Triton attention's stored
logits and the finishing kernel against a dense float64 loop and the torch reference; GQA,
soft-cap, sinks, each GQA reduction and mixed ones, rows of their own lengths, split-K; the
attention output is unchanged by scoring."""

from __future__ import annotations

import pytest
import torch

from kvcompress.kernels import (
    DecodeScoreTarget,
    decode_mass_ref,
    decode_mass_triton,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from kvcompress.kernels.decode_mass import REDUCE_MAX, REDUCE_MEAN, REDUCE_SUM
from tests.kernels.kernel_cases import (
    FP8_FORMATS,
    FP8_SCALES,
    TOLERANCES,
    fp8_case,
    head_keys_values,
    make_case,
    model_logits,
    model_softmax,
    run_attention,
)

# 2 KV heads of unequal lengths. Requests 0, 2, 3 decode and are scored (slots 2, 0, 1: not
# in batch order); request 1 is a prefill chunk and request 4 a decode, neither scored.
CASE = ([1, 6, 1, 1, 1], [[40, 21], [0, 3], [17, 30], [70, 66], [12, 9]])
SLOTS = [2, -1, 0, 1, -1]
WIDTH = 24
# [slot, head]: each row's first scored position; slot 1 head 0 holds more than WIDTH
# generated keys (only the first WIDTH count), slot 2 head 1 just its new one.
BEGIN = [[10, 25], [40, 50], [30, 21]]
NUM_SLOTS = 4  # slot 3 is named by no request: left alone
REDUCES = {"mean": [REDUCE_MEAN] * 4, "max": [REDUCE_MAX] * 4, "sum": [REDUCE_SUM] * 4,
           "mixed": [REDUCE_SUM, REDUCE_MEAN, REDUCE_MAX, REDUCE_MEAN]}
SENTINEL = -7.0


def target_for(device: torch.device, reduce: str) -> tuple[DecodeScoreTarget, torch.Tensor]:
    """A target whose mass is layer 1 of ``[n, 2 layers, H, W]``, as the engine's plan holds it
    (a strided view); the whole buffer is returned to check what stays untouched."""
    buffer = torch.full((NUM_SLOTS, 2, 2, WIDTH), SENTINEL, device=device)
    begin = torch.tensor(BEGIN + [[0, 0]], dtype=torch.int64, device=device)
    target = DecodeScoreTarget(
        slots=torch.tensor(SLOTS, dtype=torch.int32, device=device),
        begin=begin,
        reduce_codes=torch.tensor(REDUCES[reduce], dtype=torch.int64, device=device),
        mass=buffer[:, 1],
    )
    return target, buffer


def dense_mass(case, target: DecodeScoreTarget, soft_cap=None, sinks=None) -> torch.Tensor:
    """float64 [n, H, W]: each scored request's last query, head by head, slot by slot."""
    num_kv_heads = case.page_tables.shape[1]
    group = case.query.shape[1] // num_kv_heads
    ends = case.query_start_loc[1:].tolist()
    want = torch.full((NUM_SLOTS, num_kv_heads, WIDTH), SENTINEL, dtype=torch.float64)
    query = case.query.cpu()
    for request, slot in enumerate(SLOTS):
        if slot < 0:
            continue
        code = int(target.reduce_codes[slot])
        for head in range(num_kv_heads):
            keys, _ = head_keys_values(case, request, head)
            probs = []
            for hq in range(head * group, (head + 1) * group):
                scores = keys @ query[ends[request] - 1, hq].double() * case.scale
                probs.append(torch.softmax(model_logits(scores, hq, soft_cap, sinks), 0)[:-1])
            stacked = torch.stack(probs)
            combined = {REDUCE_MEAN: stacked.mean(0), REDUCE_MAX: stacked.amax(0),
                        REDUCE_SUM: stacked.sum(0)}[code]
            part = combined[BEGIN[slot][head]:][:WIDTH]
            want[slot, head] = 0.0
            want[slot, head, :part.numel()] = part
    return want


def scored_run(case, kernel, reduce: str, **kwargs):
    target, buffer = target_for(case.query.device, reduce)
    out, lse = run_attention(case, kernel, decode_scores=target, **kwargs)
    return out, lse, buffer


def check_buffer(buffer: torch.Tensor, want: torch.Tensor, tolerance: dict) -> None:
    buffer = buffer.cpu().double()
    assert (buffer[:, 0] == SENTINEL).all()  # another layer's scores
    torch.testing.assert_close(buffer[:, 1], want, **tolerance)


@pytest.mark.parametrize("kind", [None, "soft_cap", "sinks", "both"])
@pytest.mark.parametrize("reduce", ["mean", "mixed"])
def test_reference_matches_dense(kind, reduce):
    case = make_case(*CASE, group=3, head_size=32, page_size=8)
    softmax = model_softmax(kind, 6) if kind else {}
    _, _, buffer = scored_run(case, paged_attention_ref, reduce, **softmax)
    target, _ = target_for(torch.device("cpu"), reduce)
    check_buffer(buffer, dense_mass(case, target, **softmax), dict(atol=1e-6, rtol=1e-5))


@pytest.mark.parametrize(
    "kind, reduce, num_splits, group",
    [
        (None, "mixed", 1, 3),
        ("both", "mixed", 4, 3),
        ("soft_cap", "mean", 2, 4),
        ("sinks", "max", 1, 2),
        ("both", "sum", 8, 1),
    ],
)
@pytest.mark.usefixtures("needs_triton")
def test_triton_matches_dense_and_leaves_attention_unchanged(device, kind, reduce, num_splits,
                                                             group):
    case = make_case(*CASE, group=group, head_size=32, page_size=8).to(device)
    softmax = model_softmax(kind, 2 * group, device) if kind else {}
    plain_out, plain_lse = run_attention(case, paged_attention_triton, num_splits=num_splits,
                                         **softmax)
    out, lse, buffer = scored_run(case, paged_attention_triton, reduce, num_splits=num_splits,
                                  **softmax)
    torch.testing.assert_close(out, plain_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, plain_lse, atol=0, rtol=0)
    target, _ = target_for(torch.device("cpu"), reduce)
    check_buffer(buffer, dense_mass(case, target, **softmax), dict(atol=1e-6, rtol=1e-5))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_narrow_tiles_skip_the_prompt_and_keep_the_scored_range(device, num_splits):
    """16-key tiles: most lie wholly before a row's first scored position or past its last
    kept offset (skipped), others straddle either end."""
    case = make_case(*CASE, group=2, head_size=32, page_size=8).to(device)
    _, _, buffer = scored_run(case, paged_attention_triton, "mixed", num_splits=num_splits,
                              block_n=16)
    target, _ = target_for(torch.device("cpu"), "mixed")
    check_buffer(buffer, dense_mass(case, target), dict(atol=1e-6, rtol=1e-5))


@pytest.mark.usefixtures("needs_triton")
def test_triton_matches_reference_in_bfloat16(device):
    case = make_case(*CASE, group=2, head_size=64, page_size=16, dtype=torch.bfloat16)
    softmax = model_softmax("both", 4)
    _, _, want = scored_run(case, paged_attention_ref, "mixed", **softmax)
    _, _, got = scored_run(case.to(device), paged_attention_triton, "mixed", num_splits=2,
                           **model_softmax("both", 4, device))
    # Same bf16 keys and queries, fp32 logits: only summation order differs.
    torch.testing.assert_close(got.cpu(), want, **TOLERANCES[torch.float32])


@pytest.mark.usefixtures("needs_triton")
def test_dispatch_takes_the_target_without_lse_out(device):
    case = make_case(*CASE, group=2, head_size=32, page_size=8).to(device)
    target, buffer = target_for(device, "mixed")
    out = torch.empty_like(case.query)
    paged_attention(case.query, case.pool, case.page_tables, case.kv_lens,
                    case.query_start_loc, case.scale, out, decode_scores=target,
                    use_triton=True)
    check_buffer(buffer, dense_mass(case.to("cpu"), target_for(torch.device("cpu"),
                                                                 "mixed")[0]),
                 dict(atol=1e-6, rtol=1e-5))


@pytest.mark.parametrize("kernel", [paged_attention_ref, paged_attention_triton])
def test_sliding_window_layers_are_not_scored(device, kernel):
    case = make_case(*CASE, group=2, head_size=32, page_size=8).to(device)
    target, _ = target_for(device, "mean")
    with pytest.raises(ValueError, match="sliding-window"):
        kernel(case.query, case.pool, case.page_tables, case.kv_lens, case.query_start_loc,
               case.scale, torch.empty_like(case.query), sliding_window=16,
               decode_scores=target)


@pytest.mark.usefixtures("needs_triton")
def test_finishing_kernel_matches_its_reference(device):
    """The second kernel alone, on random logits (positions past a row hold NaN: unread)."""
    generator = torch.Generator().manual_seed(3)
    group, heads = 3, 2
    query_start_loc = torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32)
    kv_lens = torch.tensor([[30, 12], [9, 9], [50, 41], [5, 7]], dtype=torch.int32)
    slots = torch.tensor([1, -1, 0, 2], dtype=torch.int32)
    begin = torch.tensor([[20, 30], [10, 4], [0, 1]], dtype=torch.int64)
    logits = torch.randn(3, heads, group, WIDTH, generator=generator) * 3
    lengths_by_slot = torch.tensor([[50, 41], [30, 12], [5, 7]])  # kv_lens of slots 0, 1, 2
    outside = torch.arange(WIDTH) >= (lengths_by_slot - begin)[..., None]  # [3, H, W]
    logits = logits.masked_fill(outside[:, :, None, :], float("nan"))
    lse = torch.randn(6, heads * group, generator=generator) + 4
    codes = torch.tensor([REDUCE_MAX, REDUCE_SUM, REDUCE_MEAN])
    masses = []
    for finish, where in ((decode_mass_ref, torch.device("cpu")), (decode_mass_triton, device)):
        mass = torch.full((3, heads, WIDTH), SENTINEL, device=where)
        target = DecodeScoreTarget(slots.to(where), begin.to(where), codes.to(where), mass)
        finish(logits.to(where), lse.to(where), query_start_loc.to(where), kv_lens.to(where),
               target)
        masses.append(mass.cpu())
    want, got = masses
    assert not want.isnan().any() and (want[outside] == 0).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)



@pytest.mark.parametrize("kv_fp8", FP8_FORMATS)
@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_fp8_pages_score_the_decoded_keys(request, device, kv_fp8, kernel):
    """fp8 pages: the fused scores are those of the decoded, scaled keys (K's scale folded
    into the logits the scores come from), by the reference and the Triton kernel alike."""
    options = {**FP8_SCALES, "kv_fp8": kv_fp8}
    if kernel == "triton":
        request.getfixturevalue("needs_triton")
        run, options["num_splits"] = paged_attention_triton, 2
    else:
        run, device = paged_attention_ref, torch.device("cpu")
    quantized, decoded = fp8_case(make_case(*CASE, group=2, head_size=32, page_size=8),
                                  kv_fp8, **FP8_SCALES)
    _, _, buffer = scored_run(quantized.to(device), run, "mixed", **options)
    target, _ = target_for(torch.device("cpu"), "mixed")
    check_buffer(buffer, dense_mass(decoded, target), dict(atol=1e-6, rtol=1e-5))
