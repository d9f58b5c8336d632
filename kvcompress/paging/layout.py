"""Shape of the unified page pool: which (layer, KV head) rows exist and how many pages."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageLayout:
    """One page holds ``page_size`` tokens (K and V) of one KV head of one layer.

    Rows of every per-request page table are (layer, kv_head) pairs in layer-major order:
    ``row = layer * num_kv_heads + head``.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    page_size: int
    dtype_bytes: int
    total_pages: int

    @property
    def num_rows(self) -> int:
        return self.num_layers * self.num_kv_heads

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
    ) -> PageLayout:
        """Fit as many pages as the bytes vanilla vLLM would give its KV cache, less
        ``reserved_bytes`` kept for other per-request buffers (window scores)."""
        page_bytes = 2 * page_size * head_size * dtype_bytes
        total_pages = max(0, kv_cache_bytes - reserved_bytes) // page_bytes
        if total_pages < num_layers * num_kv_heads:
            raise ValueError(
                f"KV-cache memory ({kv_cache_bytes} bytes, {reserved_bytes} of them reserved "
                f"for window scores) holds {total_pages} pages of "
                f"{page_size} tokens, fewer than one page per (layer, KV head) "
                f"({num_layers * num_kv_heads}); give the KV cache more memory or use a "
                "smaller --kv-page-size"
            )
        return cls(num_layers, num_kv_heads, head_size, page_size, dtype_bytes, total_pages)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages one request of ``num_tokens`` uncompressed tokens occupies."""
        return self.num_rows * (-(-num_tokens // self.page_size))

    def check_holds_one_request(self, max_model_len: int) -> None:
        """A request of ``max_model_len`` tokens must fit uncompressed (prefill comes before
        compression), or it would wait forever: every row rounds up to whole pages."""
        needed = self.pages_for_tokens(max_model_len)
        if needed > self.total_pages:
            raise ValueError(
                f"the KV-cache pool holds {self.total_pages} pages of {self.page_size} tokens, "
                f"but one request of --max-model-len {max_model_len} needs {needed} "
                f"({self.num_rows} (layer, KV head) rows x ceil({max_model_len} / "
                f"{self.page_size}) pages, each row rounded up to whole pages); use a smaller "
                "--kv-page-size or --max-model-len, or give the KV cache more memory"
            )

    @property
    def token_capacity(self) -> int:
        """Uncompressed tokens the pool holds (all rows of a token together)."""
        return (self.total_pages // self.num_rows) * self.page_size
