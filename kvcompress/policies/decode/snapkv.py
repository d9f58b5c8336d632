"""SnapKV over the output: the newest tokens are the observation window that scores the rest."""

from __future__ import annotations

from .base import DecodeMethod, select_recent_and_top

# Scores: only the decode steps of the newest ``recent`` tokens before an eviction add their
# attention (those tokens are kept anyway); reset after each eviction. No pooling (the prompt
# methods' --kv-pooling does not apply here).
SNAPKV = DecodeMethod(
    name="snapkv",
    summary="keeps the newest generated tokens plus those they attended to most",
    score_collection="last_window",
    select=select_recent_and_top,
)
