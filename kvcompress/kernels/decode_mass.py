"""Decode-time attention mass of chosen requests, fused into paged attention.

For decode-time scored eviction (h2o / snapkv / rkv / anchors decode policies) a scored
request's newest query gives every key of each (request, KV head) row a probability, the
model's softmax (soft-capped, sinks in the denominator), combined over the query heads of the
KV head (mean / max / sum per request). Only the keys from ``begin[slot, head]`` up to the
row's length are wanted, at offsets ``0 ..`` of ``mass[slot, head]``.

:class:`DecodeScoreTarget` names them; :func:`kvcompress.kernels.paged_attention` fills it
while it attends (``decode_scores=``). In Triton the attention kernel stores each scored
query row's base-2 logits of the wanted keys into a scratch ``[n, H_kv, GROUP, W]`` fp32
as its key loop meets them (every split its own tiles), and stores the LSE; once the splits
are merged, :func:`decode_mass_triton` turns scratch and LSE into probabilities, combines the
group and writes ``mass``. Keys are read once: the second kernel reads only the scratch.

Semantics shared by every implementation here:

* ``slots: int32 [R]`` per request of the attention call: its row in ``begin`` / ``mass``
  (``0 <= slot < n``, each at most once), or -1: not scored. A scored request's newest query
  (its last token) is the one scored; decode requests have only that one.
* ``begin: int [n, H_kv]`` (any strides): the first scored position of each row.
* ``reduce_codes: int [n]``: 0 mean, 1 max, 2 sum over the GQA group
  (``kvcompress.step.GQA_REDUCE_CODES``'s order).
* ``mass: float32 [n, H_kv, W]`` (unit last stride): overwritten for the scored slots,
  ``mass[slot, h, w]`` the probability of position ``begin + w``, 0 where that is not below
  the row's length; slots no request names are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import gather_head_tokens
from ._triton_support import (
    LOG2E,
    can_run_triton,
    check_triton_device,
    load_kernel_module,
    next_power_of_2,
)
from .logits import attention_probs

# Indices into kvcompress.step.GQA_REDUCE_CODES (kernels may not import kvcompress.step).
REDUCE_MEAN, REDUCE_MAX, REDUCE_SUM = 0, 1, 2
# Offsets one program of the finishing kernel handles per iteration.
_BLOCK_W = 64


@dataclass
class DecodeScoreTarget:
    """Where the fused attention puts the decode mass of one call (see the module doc)."""

    slots: torch.Tensor  # int32 [R]: row in begin / mass, -1: not scored
    begin: torch.Tensor  # int [n, H_kv]: first scored position of each row
    reduce_codes: torch.Tensor  # int [n]: 0 mean, 1 max, 2 sum
    mass: torch.Tensor  # float32 [n, H_kv, W], overwritten for the scored slots

    @property
    def width(self) -> int:
        return self.mass.shape[-1]

    def check(self, num_requests: int, num_kv_heads: int) -> None:
        if self.slots.shape != (num_requests,) or self.slots.dtype != torch.int32:
            raise ValueError(f"slots must be int32 [{num_requests}]")
        count = self.mass.shape[0]
        if self.mass.dim() != 3 or self.mass.shape[1] != num_kv_heads \
                or self.mass.dtype != torch.float32 or self.mass.stride(-1) != 1:
            raise ValueError(f"mass must be float32 [n, {num_kv_heads}, W] with a unit last "
                             f"stride, got {self.mass.dtype} {tuple(self.mass.shape)}")
        if self.begin.shape != (count, num_kv_heads) or self.reduce_codes.shape != (count,):
            raise ValueError("begin must be [n, H_kv] and reduce_codes [n], n = mass.shape[0]")


# --------------------------------------------------------------------------- dense reference


def decode_scores_ref(query: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor,
                      kv_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                      target: DecodeScoreTarget, *, soft_cap: float | None = None,
                      sinks: torch.Tensor | None = None, kv_fp8: torch.dtype | None = None,
                      k_scale: float = 1.0) -> None:
    """Torch reference of the whole: each scored request's last query against its rows' keys,
    gathered from the pool (any device; syncs, a reference only). fp8 pages (``kv_fp8``):
    the keys are the decoded codes times ``k_scale``."""
    num_kv_heads = page_tables.shape[1]
    group = query.shape[1] // num_kv_heads
    width = target.width
    ends = query_start_loc[1:].tolist()
    for request, slot in enumerate(target.slots.tolist()):
        if slot < 0:
            continue
        lengths = kv_lens[request].long().cpu()
        max_len = max(1, int(lengths.max()))
        keys, _, valid = gather_head_tokens(pool, page_tables[request], lengths, max_len)
        if kv_fp8 is not None:
            keys = keys.view(kv_fp8).float() * k_scale
        grouped = query[ends[request] - 1].float().view(num_kv_heads, group, -1)
        logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale  # [H, G, S]
        logits = logits.masked_fill(~valid[:, None, :].to(logits.device), float("-inf"))
        row_sinks = None if sinks is None else sinks.view(num_kv_heads, group)
        probs = attention_probs(logits, soft_cap, row_sinks)
        code = int(target.reduce_codes[slot])
        combined = {REDUCE_MEAN: probs.mean(dim=1), REDUCE_MAX: probs.amax(dim=1),
                    REDUCE_SUM: probs.sum(dim=1)}[code]  # [H, S]
        for head in range(num_kv_heads):
            first = int(target.begin[slot, head])
            part = combined[head, first:int(lengths[head])][:width]
            target.mass[slot, head] = 0.0
            target.mass[slot, head, :part.numel()] = part


# --------------------------------------------------------------------------- second pass


def decode_mass(score_logits: torch.Tensor, lse: torch.Tensor, query_start_loc: torch.Tensor,
                kv_lens: torch.Tensor, target: DecodeScoreTarget, *,
                use_triton: bool | None = None) -> None:
    """The finishing step: ``score_logits [n, H_kv, GROUP, W]`` fp32, the scored queries'
    base-2 logits (``log2(e) * capped scaled logit``) of positions ``begin + w`` (only those
    below the row's length are read), and ``lse [T, H_q]`` fp32 (natural log, sink included)
    -> ``target.mass``. Dispatch as every kernel here."""
    if use_triton is None:
        use_triton = score_logits.is_cuda and can_run_triton(score_logits)
    if use_triton:
        decode_mass_triton(score_logits, lse, query_start_loc, kv_lens, target)
    else:
        decode_mass_ref(score_logits, lse, query_start_loc, kv_lens, target)


def decode_mass_ref(score_logits: torch.Tensor, lse: torch.Tensor,
                    query_start_loc: torch.Tensor, kv_lens: torch.Tensor,
                    target: DecodeScoreTarget) -> None:
    """Torch reference of :func:`decode_mass` (any device; syncs)."""
    count, num_kv_heads, group, width = score_logits.shape
    scored = (target.slots >= 0).nonzero().flatten()
    if scored.numel() == 0:
        return
    slots = target.slots[scored].long()
    tokens = query_start_loc[scored + 1].long() - 1
    row_lse = lse[tokens].view(-1, num_kv_heads, group, 1) * LOG2E
    offsets = torch.arange(width, device=score_logits.device)
    held = offsets < (kv_lens[scored].long() - target.begin[slots].long())[..., None]
    logits = score_logits[slots].masked_fill(~held[:, :, None, :], float("-inf"))
    probs = torch.exp2(logits - row_lse)  # [m, H, G, W]
    codes = target.reduce_codes[slots].view(-1, 1, 1)
    summed = probs.sum(dim=2)
    combined = torch.where(codes == REDUCE_MEAN, summed / group, summed)
    combined = torch.where(codes == REDUCE_MAX, probs.amax(dim=2), combined)
    target.mass[slots] = torch.where(held, combined, 0.0)


def decode_mass_triton(score_logits: torch.Tensor, lse: torch.Tensor,
                       query_start_loc: torch.Tensor, kv_lens: torch.Tensor,
                       target: DecodeScoreTarget) -> None:
    """One program per (request of the call, KV head); unscored requests return at once.
    No host syncs."""
    check_triton_device(score_logits, lse, query_start_loc, kv_lens, target.mass)
    count, num_kv_heads, group, width = score_logits.shape
    num_requests = query_start_loc.numel() - 1
    if num_requests == 0 or count == 0 or width == 0:
        return
    if not score_logits.is_contiguous():
        raise ValueError("score_logits must be contiguous")
    kernels = load_kernel_module("_decode_mass_triton")
    kernels.decode_mass_kernel[(num_requests, num_kv_heads)](
        score_logits, lse, query_start_loc, kv_lens, target.slots, target.begin,
        target.reduce_codes, target.mass,
        width,
        lse.stride(0), lse.stride(1),
        kv_lens.stride(0), kv_lens.stride(1),
        target.begin.stride(0), target.begin.stride(1),
        target.mass.stride(0), target.mass.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=next_power_of_2(group),
        BLOCK_W=min(_BLOCK_W, next_power_of_2(width)),
        num_warps=4,
    )
