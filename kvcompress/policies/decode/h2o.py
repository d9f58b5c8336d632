"""H2O: heavy hitters by the attention mass every decode query gave each generated token."""

from __future__ import annotations

from .base import DecodeMethod, select_recent_and_top

# Scores: the running sum over every decode step of each token's attention probability (GQA
# group reduced). Kept tokens carry their mass over an eviction, so old heavy hitters stay
# ahead of newcomers, as in H2O's accumulated scores.
H2O = DecodeMethod(
    name="h2o",
    summary="keeps the newest generated tokens plus those with the most attention mass so far",
    score_collection="every_step",
    select=select_recent_and_top,
)
