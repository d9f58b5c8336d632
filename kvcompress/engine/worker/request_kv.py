"""What the worker holds of one request (``RequestKV``: its page table, row lengths and
scores) and of a segment request's kept plan (``ParkedSegment``); ``state.WorkerKVState``
keeps them by request id. No vLLM imports."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.engine.worker.moves import RowMoves
from kvcompress.paging import HeadPageTable
from kvcompress.settings.config import KVCompressionConfig


@dataclass
class RequestKV:
    table: HeadPageTable
    # Per row: tokens physically stored (K and V written).
    lengths: np.ndarray
    prompt_len: int = 0
    # Compression already happened since the request was (re)admitted.
    compressed: bool = False
    # [num_layers, num_kv_heads, score_width()] summed window probabilities by physical slot
    # of the row, fp32.
    window_scores: torch.Tensor | None = None
    # Hybrid scoring: the window's scores, kept apart while reconstruction passes fill
    # ``window_scores`` (the plan ranks by both).
    query_scores: torch.Tensor | None = None
    # A reconstruction pass or a score surrogate scored this prompt: query-agnostic scores
    # (``--kv-budget-sharing auto`` shares only such scores model-wide: a prompt scored by
    # its window instead keeps the method's split).
    query_agnostic: bool = False
    # This request's compression config (engine config + its own overrides).
    config: KVCompressionConfig | None = None
    # Per row: slots [0, prompt_kept) hold prompt tokens, the rest generated tokens in
    # generation order (None until the prompt completes: then it is ``prompt_end()`` or
    # what compaction kept).
    prompt_kept: np.ndarray | None = None
    # [num_layers, num_kv_heads, decode budget + interval] fp32 scores of the generated
    # tokens by offset (h2o / snapkv decode eviction), from the first scored decode step.
    decode_scores: torch.Tensor | None = None
    # Decode policy 'anchors': the same shape, the mass each token got while among the newest
    # --kv-window generated tokens (see DecodeQueries.anchor_scores).
    anchor_scores: torch.Tensor | None = None
    # Multi-turn reuse: logical tokens of a cached context the request started from (vLLM
    # computed them before this request), and per row the physical slots [0, adopted_rows)
    # that hold them (rows differ: each head kept its own). None / 0: no adoption.
    adopted_len: int = 0
    adopted_rows: np.ndarray | None = None
    # A shared prefix's segment request: the tokens its (median) reader has after it. The
    # score surrogate's place features count a token's distance from the end of the prompt
    # (where the questions are): a segment's tokens are placed as in its readers' prompts.
    readers_after: int = 0
    # It is such a segment request: its plan is kept (``ParkedSegment``) and run later.
    is_segment: bool = False

    def new_prompt_tokens(self, prompt_len: int) -> int:
        """Prompt tokens the request prefills itself: all of them, or those after the adopted
        context. Compression decisions (compress? score?) are about these."""
        return max(0, prompt_len - self.adopted_len)

    def prompt_end(self) -> np.ndarray:
        """Per row: where the prompt part ends before any compaction of it (int64): the
        prompt length, or for an adopter its adopted slots plus the new prompt tokens."""
        if self.adopted_rows is None:
            return np.full_like(self.lengths, self.prompt_len)
        return self.adopted_rows + self.new_prompt_tokens(self.prompt_len)

    def score_width(self) -> int:
        """Physical slots the window-score accumulator covers: every slot a prompt key can
        sit in (the adopted ones too: the softmax runs over them)."""
        return int(self.prompt_end().max())


@dataclass
class ParkedSegment:
    """A segment request's plan, kept after it ended until the scheduler orders it run (its
    first readers prefilled over the whole prefix) or forgotten: its page table then, the
    moves (positions in its rows) and the whole pages each row drops."""

    pages: np.ndarray
    moves: RowMoves
    drops: np.ndarray
