"""How K and V sit inside a page of the pool ``[num_pages, 2, page_size, head_size]``.

Index 0 of dim 1 holds K, index 1 holds V, ``page_size`` tokens of one KV head each.
V is always stored row-major ``[page_size, head_size]``. K is row-major on GPU, and
transposed ``[head_size, page_size]`` on CPU, the layout vLLM's CPU attention kernel
(vec / vec16 ISA) reads and writes, so that kernel can run over our pages unchanged.

No vLLM imports: moves and reads here are plain torch, shared by engine and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageFormat:
    keys_transposed: bool

    def key_view(self, pool: torch.Tensor) -> torch.Tensor:
        """K part indexed as ``[page, token, dim]`` (a strided view when transposed)."""
        num_pages, _, page_size, head_size = pool.shape
        keys = pool[:, 0]
        if self.keys_transposed:
            return keys.reshape(num_pages, head_size, page_size).transpose(1, 2)
        return keys

    @staticmethod
    def value_view(pool: torch.Tensor) -> torch.Tensor:
        return pool[:, 1]

    def write_tokens(
        self, pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store ``keys/values [N, D]`` at flat ``slots [N]`` (page * page_size + offset)."""
        page_size = pool.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        self.key_view(pool)[pages, offsets] = keys.to(pool.dtype)
        self.value_view(pool)[pages, offsets] = values.to(pool.dtype)

    def read_tokens(
        self, pool: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        page_size = pool.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        return self.key_view(pool)[pages, offsets], self.value_view(pool)[pages, offsets]

    def move(
        self, pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
        *, disjoint: bool = False,
    ) -> None:
        """Copy K and V of ``src_slots`` to ``dst_slots``: a gather, then a scatter, so every
        read happens before any write whatever the overlap (``disjoint`` changes nothing)."""
        if src_slots.numel() == 0:
            return
        keys, values = self.read_tokens(pool, src_slots)
        self.write_tokens(pool, keys, values, dst_slots)

    def gather_key_pages(self, pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """K of ``pages [...]`` as ``[..., head_size, page_size]`` (dimension-major): one
        contiguous gather on CPU, where pages already hold K transposed, so scoring can multiply
        queries by whole pages without first transposing every key."""
        num_pages, _, page_size, head_size = pool.shape
        # index_select over whole K pages is several times faster than advanced indexing
        key_pages = pool.view(num_pages, 2, page_size * head_size)[:, 0]
        keys = key_pages.index_select(0, pages.reshape(-1))
        if self.keys_transposed:
            return keys.view(*pages.shape, head_size, page_size)
        return keys.view(*pages.shape, page_size, head_size).transpose(-1, -2)

    def gather_keys(
        self, pool: torch.Tensor, page_tables: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """K of the first ``num_tokens`` positions of each row of ``page_tables [...,
        max_pages]``, dimension-major: ``[..., head_size, num_tokens]``, ready to multiply
        queries by (V is not read: scores need none)."""
        page_size, head_size = pool.shape[2], pool.shape[3]
        pages = page_tables[..., : -(-num_tokens // page_size)]
        keys = self.gather_key_pages(pool, pages)  # [..., P, D, page]
        keys = keys.transpose(-3, -2).reshape(*pages.shape[:-1], head_size, -1)
        return keys[..., :num_tokens]


CPU_PAGE_FORMAT = PageFormat(keys_transposed=True)
GPU_PAGE_FORMAT = PageFormat(keys_transposed=False)
