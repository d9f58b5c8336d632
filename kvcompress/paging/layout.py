"""Shape of the unified page pool: which (layer, KV head) rows exist and how many pages."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class PageLayout:
    """One page holds ``page_size`` tokens (K and V) of one KV head of one layer.

    Rows of every per-request page table are (layer, kv_head) pairs in layer-major order:
    ``row = layer * num_kv_heads + head``.

    ``layer_windows[layer]``: the layer's sliding window W (a query sees only the W newest
    positions, itself included), 0 for full attention; empty: every layer full. Sliding
    layers are never compressed by a policy: their rows lose only the tokens that fell out
    of the window, as whole leading pages (``PageManager.drop_outside_window``).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    page_size: int
    dtype_bytes: int
    total_pages: int
    layer_windows: tuple[int, ...] = ()
    # Pages past ``total_pages`` that only reconstruction passes write (their own K/V,
    # dropped after the pass): the worker's pool holds them, the scheduler never hands
    # them out, so they are outside page accounting.
    scratch_pages: int = 0
    # Decode-score accumulators reserved out of the same memory: for this many running
    # requests, this many bytes each (named when a request of max_model_len does not fit).
    decode_score_requests: int = 0
    decode_score_request_bytes: int = 0
    # Largest logits block a reconstruction pass's scoring builds (elements; 0: its
    # default): smaller where the pool's memory affords less workspace.
    scoring_elements: int = 0

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for "
                             f"{self.num_layers} layers")
        if any(window < 0 for window in self.layer_windows):
            raise ValueError(f"layer windows must be >= 0, got {self.layer_windows}")

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_kv_heads

    def window_of(self, layer: int) -> int:
        """The layer's sliding window, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.layer_windows)

    @cached_property
    def compressed_layers(self) -> tuple[int, ...]:
        """Layers a compression policy compresses (full attention), in depth order."""
        return tuple(layer for layer in range(self.num_layers) if not self.window_of(layer))

    @cached_property
    def compressed_rows(self) -> np.ndarray:
        """Rows of the compressed layers, ascending (int64)."""
        heads = np.arange(self.num_kv_heads)
        layers = np.asarray(self.compressed_layers, dtype=np.int64)
        return (layers[:, None] * self.num_kv_heads + heads[None, :]).reshape(-1)

    @cached_property
    def row_windows(self) -> np.ndarray:
        """Per row: its layer's sliding window, 0 for full attention (int64)."""
        windows = np.asarray(self.layer_windows or (0,) * self.num_layers, dtype=np.int64)
        return np.repeat(windows, self.num_kv_heads)

    def row_tokens_bound(self, num_tokens: int, max_chunk: int) -> np.ndarray:
        """Per row: the most tokens a request of ``num_tokens`` ever holds at once, with
        prefill chunks of at most ``max_chunk`` tokens. A sliding row keeps the W - 1 newest
        processed tokens, up to a page of dead slack, and the chunk being written."""
        windows = self.row_windows
        sliding_bound = windows - 1 + (self.page_size - 1) + max_chunk
        return np.where(windows > 0, np.minimum(num_tokens, sliding_bound), num_tokens)

    @property
    def page_bytes(self) -> int:
        return 2 * self.page_size * self.head_size * self.dtype_bytes

    @classmethod
    def for_memory(
        cls,
        kv_cache_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        page_size: int,
        dtype_bytes: int,
        reserved_bytes: int = 0,
        layer_windows: tuple[int, ...] = (),
        scratch_tokens: int = 0,
        decode_score_requests: int = 0,
        decode_score_request_bytes: int = 0,
        scoring_elements: int = 0,
    ) -> PageLayout:
        """Fit as many pages as the bytes vanilla vLLM would give its KV cache, less
        ``reserved_bytes`` kept for other per-request buffers (window scores), the decode
        scores of ``decode_score_requests`` running requests and the scratch pages of every
        row for ``scratch_tokens`` reconstruction tokens."""
        page_bytes = 2 * page_size * head_size * dtype_bytes
        scratch_pages = num_layers * num_kv_heads * (-(-scratch_tokens // page_size))
        reserved_bytes += (scratch_pages * page_bytes
                           + decode_score_requests * decode_score_request_bytes)
        total_pages = max(0, kv_cache_bytes - reserved_bytes) // page_bytes
        if total_pages < num_layers * num_kv_heads:
            raise ValueError(
                f"KV-cache memory ({kv_cache_bytes} bytes, {reserved_bytes} of them reserved "
                f"for scores and reconstruction scratch; --kv-scoring window reserves less) "
                f"holds {total_pages} pages of "
                f"{page_size} tokens, fewer than one page per (layer, KV head) "
                f"({num_layers * num_kv_heads}); give the KV cache more memory or use a "
                "smaller --kv-page-size"
            )
        return cls(num_layers, num_kv_heads, head_size, page_size, dtype_bytes, total_pages,
                   layer_windows, scratch_pages, decode_score_requests,
                   decode_score_request_bytes, scoring_elements)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages one request of ``num_tokens`` uncompressed tokens occupies."""
        return self.num_rows * (-(-num_tokens // self.page_size))

    def check_holds_one_request(self, max_model_len: int, max_chunk: int | None = None) -> None:
        """A request of ``max_model_len`` tokens must fit uncompressed (prefill comes before
        compression), or it would wait forever: every row rounds up to whole pages, a
        sliding row holds at most its window plus a chunk (``row_tokens_bound``)."""
        needed = self.pages_for_longest_request(max_model_len, max_chunk)
        if needed > self.total_pages:
            sliding = (" (sliding-window rows: their window plus a prefill chunk)"
                       if self.has_sliding_layers else "")
            raise ValueError(
                f"the KV-cache pool holds {self.total_pages} pages of {self.page_size} tokens, "
                f"but one request of --max-model-len {max_model_len} needs {needed} "
                f"({self.num_rows} (layer, KV head) rows x ceil({max_model_len} / "
                f"{self.page_size}) pages{sliding}, each row rounded up to whole pages); use "
                "a smaller --kv-page-size or --max-model-len, or give the KV cache more memory"
                + (f" (or --kv-scoring window: {self.scratch_pages} pages are reconstruction "
                   "scratch)" if self.scratch_pages else "")
                + self._decode_reserve_hint(needed - self.total_pages)
            )

    def pages_for_longest_request(self, max_model_len: int, max_chunk: int | None = None) -> int:
        """Pages one uncompressed request of ``max_model_len`` tokens holds at its peak."""
        rows = self.row_tokens_bound(max_model_len, max_chunk or max_model_len)
        return int((-(-rows // self.page_size)).sum())

    def decode_requests_fitting(self, missing_pages: int) -> int:
        """Requests whose decode scores may be reserved once ``missing_pages`` more pages are
        needed (0: none, even at one request)."""
        freed_per_request = self.decode_score_request_bytes / self.page_bytes
        return max(0, self.decode_score_requests
                   - int(np.ceil(missing_pages / freed_per_request)))

    def _decode_reserve_hint(self, missing_pages: int) -> str:
        """What the decode-score reserve takes, and the --max-num-seqs that frees enough."""
        if not self.decode_score_requests:
            return ""
        reserved = self.decode_score_requests * self.decode_score_request_bytes
        fitting = self.decode_requests_fitting(missing_pages)
        fix = (f"--max-num-seqs {fitting} fits, or a smaller --kv-decode-budget"
               if fitting >= 1 else "a smaller --kv-decode-budget")
        return (f" (or {fix}: {reserved // self.page_bytes} pages' worth are decode scores of "
                f"up to {self.decode_score_requests} running requests)")

    @property
    def token_capacity(self) -> int:
        """Uncompressed tokens the pool holds (all rows of a token together)."""
        return (self.total_pages // self.num_rows) * self.page_size
