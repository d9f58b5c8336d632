"""The model's softmax in torch (kvcompress.kernels.logits) against the definition written out."""

from __future__ import annotations

import pytest
import torch

from kvcompress.kernels import attention_lse, attention_probs, soft_cap_logits
from kvcompress.kernels.logits import soft_cap_logits_

NEG_INF = float("-inf")


def _logits() -> torch.Tensor:
    """[kv_heads 2, group 3, queries 4, keys 6] with a causal mask."""
    logits = 3 * torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    future = torch.arange(6)[None, :] > torch.arange(4)[:, None] + 2
    return logits.masked_fill(future, NEG_INF)


def _by_definition(logits: torch.Tensor, soft_cap: float | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over [cap * tanh(logit / cap) for every visible key] + [sink], sink dropped."""
    logits = logits.double()
    visible = logits > NEG_INF
    if soft_cap:
        logits = torch.where(visible, soft_cap * torch.tanh(logits / soft_cap), logits)
    sink = torch.full(logits.shape[:-1], NEG_INF, dtype=torch.float64)
    if sinks is not None:
        sink = sinks.double().view(2, 3, 1).expand(sink.shape)
    return torch.softmax(torch.cat([logits, sink[..., None]], dim=-1), dim=-1)[..., :-1]


@pytest.mark.parametrize("soft_cap", [None, 0.0, 2.0])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_probabilities_and_lse_follow_the_definition(soft_cap, with_sinks):
    logits = _logits()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -2.0]) if with_sinks else None
    sink_view = None if sinks is None else sinks.view(2, 3, 1)
    probs = attention_probs(logits, soft_cap, sink_view)
    torch.testing.assert_close(probs.double(), _by_definition(logits, soft_cap, sinks))
    assert (probs[..., 5][..., :2] == 0).all()  # masked keys stay masked under the cap
    row_sums = probs.sum(-1)
    if with_sinks:
        assert (row_sums < 1).all()
    else:
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums))
    lse = attention_lse(logits, soft_cap, sink_view)
    torch.testing.assert_close(torch.exp(soft_cap_logits(logits, soft_cap) - lse[..., None]),
                               probs)


def test_a_row_that_sees_nothing_gives_its_whole_mass_to_the_sink():
    logits = torch.full((2, 5), NEG_INF)
    probs = attention_probs(logits, 3.0, torch.tensor([1.0, -4.0]))
    assert torch.equal(probs, torch.zeros(2, 5))
    torch.testing.assert_close(attention_lse(logits, sinks=torch.tensor([1.0, -4.0])),
                               torch.tensor([1.0, -4.0]))


@pytest.mark.parametrize("soft_cap", [None, 0.0, 5.0])
def test_soft_cap_in_place_equals_the_definition(soft_cap):
    """The in-place soft cap (reconstruction scoring's bounded blocks) is the same
    function, masked logits staying masked."""
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0)) * 20
    logits[1, 2] = float("-inf")
    expected = soft_cap_logits(logits, soft_cap)
    assert soft_cap_logits_(logits.clone(), soft_cap).equal(expected)
