"""How a model turns scaled attention logits into probabilities (pure torch, any device).

Besides the plain softmax, two model features change the probabilities:

* logit soft-capping (Gemma 2): every scaled logit ``x`` becomes ``cap * tanh(x / cap)``
  before the softmax;
* attention sinks (gpt-oss): a learned logit per query head joins the softmax denominator
  and carries no value, so the probabilities of the real keys sum to less than 1. A sink is
  not soft-capped.

This is the one definition the torch paths share (the kernels' references, the observation-
window scores, decode-time scores); the Triton kernels do the same arithmetic inline and are
tested against it. ``logits`` are ``q . k * scale`` with the keys a query must not see at
``-inf``; ``sinks`` broadcast against ``logits.shape[:-1]`` (one value per query head, viewed
to match the caller's layout, e.g. ``sinks.view(kv_heads, group, 1)`` for logits
``[kv_heads, group, queries, keys]``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def soft_cap_logits(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """``soft_cap * tanh(logits / soft_cap)``; masked logits (-inf) stay masked. No cap (None
    or 0, vLLM's two spellings of "off") returns ``logits`` unchanged."""
    if not soft_cap:
        return logits
    capped = torch.tanh(logits / soft_cap) * soft_cap
    # tanh would turn a masked key into a visible one at -cap.
    return capped.masked_fill(logits == NEG_INF, NEG_INF)


def soft_cap_logits_(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """``soft_cap_logits`` in place (fp32 ``logits``), for scoring loops whose blocks are
    bounded by their temporaries: a byte per logit for the mask instead of three copies."""
    if not soft_cap:
        return logits
    masked = logits == NEG_INF
    return logits.div_(soft_cap).tanh_().mul_(soft_cap).masked_fill_(masked, NEG_INF)


def attention_probs(logits: torch.Tensor, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention probabilities over the last dimension, as the model computes them.

    Without sinks each row sums to 1 (a row that sees no key is NaN, as ``torch.softmax``);
    with sinks a row sums to ``1 - p(sink)`` and a row that sees no key is all zeros.
    """
    logits = soft_cap_logits(logits.float(), soft_cap)
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.float().expand(logits.shape[:-1])
    top = torch.maximum(logits.amax(dim=-1), sink)  # finite: the sink always is
    weights = torch.exp(logits - top[..., None])
    denominator = weights.sum(dim=-1) + torch.exp(sink - top)
    return weights / denominator[..., None]


def attention_lse(logits: torch.Tensor, soft_cap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Natural log of the softmax denominator of every row (sink included), fp32, so that
    ``exp(capped logit - lse)`` is a key's probability; -inf for a row with no key and no
    sink."""
    logits = soft_cap_logits(logits.float(), soft_cap)
    lse = torch.logsumexp(logits, dim=-1)
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.float().expand(lse.shape))
