"""How K and V sit inside a page of the pool ``[num_pages, 2, page_size, head_size]``.

Index 0 of dim 1 holds K, index 1 holds V, ``page_size`` tokens of one KV head each, in one
of three layouts (``PageFormat.key_layout``):

- ``"row"`` (GPU, Triton kernels): K and V row-major ``[page_size, head_size]``.
- ``"transposed"`` (CPU, vLLM's vec / vec16 attention ISA): K transposed
  ``[head_size, page_size]``, V row-major.
- ``"amx"`` (CPU with AMX tiles, bf16, pages and heads multiples of 32: vLLM's amx ISA, about
  3x faster prefill attention): K in groups of 16 tokens, each ``[head_size / 2, 16, 2]``
  (pairs of dimensions, token, dimension in the pair); V in blocks of 16 dimensions, each
  ``[page_size / 2, 16, 2]`` (pairs of tokens, dimension, token in the pair). Checked against
  vLLM's own cache write in tests/paging/test_page_format.py where the CPU has AMX.

The CPU kernel reads and writes pages in its ISA's layout, so it runs over our pages
unchanged; everything else (moves, score reads) goes through this class. No vLLM imports:
plain torch, shared by engine and tests.

fp8 pages (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``) hold one byte per element
(the pool is uint8, as vLLM allocates it) in the same layouts; an element is the fp8 code of
``x / scale`` with the layer's K or V scale. Moves copy the bytes; score reads decode them to
fp32 without the scale, which the caller folds into its logit scale once
(``PageFormat.fp8_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEY_LAYOUTS = ("row", "transposed", "amx")
AMX_TILE = 16  # tokens per K group and dimensions per V block in the amx layout
# vLLM's --kv-cache-dtype values for fp8 pages and the fp8 format their bytes encode ("fp8"
# is e4m3, as in vLLM).
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def fp8_dtype_of(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The fp8 format of pages of vLLM's ``--kv-cache-dtype`` (None: pages in the model's
    dtype, ``auto``). Any other value is refused, naming the flag and what it allows."""
    if kv_cache_dtype in (None, "auto"):
        return None
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: kvcompress pages support auto, "
                         f"{', '.join(FP8_KV_CACHE_DTYPES)}")
    return FP8_KV_CACHE_DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class PageFormat:
    key_layout: str
    # The fp8 format of the pool's bytes (None: the pool holds K/V in the model's dtype).
    fp8_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.key_layout not in KEY_LAYOUTS:
            raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {self.key_layout!r}")
        if self.fp8_dtype is not None and self.fp8_dtype not in FP8_KV_CACHE_DTYPES.values():
            raise ValueError(f"fp8_dtype must be an fp8 format, got {self.fp8_dtype}")

    def decode(self, elements: torch.Tensor) -> torch.Tensor:
        """Elements read from the pool as numbers: fp8 bytes as their fp32 values, unscaled
        (the caller applies the layer's scale once, to its logits); otherwise unchanged."""
        if self.fp8_dtype is None:
            return elements
        return elements.view(self.fp8_dtype).float()

    def _key_slots(self, pool: torch.Tensor, pages: torch.Tensor,
                   offsets: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple[int, ...]]:
        """A view of the K part, the index that picks tokens (page, offset) from it, and the
        shape of one token there: ``view[index]`` is ``[N, head_size]`` (amx: ``[N,
        head_size / 2, 2]``)."""
        num_pages, _, page_size, head_size = pool.shape
        keys = pool[:, 0]
        if self.key_layout == "row":
            return keys, (pages, offsets), (head_size,)
        if self.key_layout == "transposed":
            by_token = keys.reshape(num_pages, head_size, page_size).transpose(1, 2)
            return by_token, (pages, offsets), (head_size,)
        tiles = keys.reshape(num_pages, page_size // AMX_TILE, head_size // 2, AMX_TILE, 2)
        index = (pages, offsets // AMX_TILE, slice(None), offsets % AMX_TILE)
        return tiles, index, (head_size // 2, 2)

    def _value_slots(self, pool: torch.Tensor, pages: torch.Tensor,
                     offsets: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple[int, ...]]:
        """As ``_key_slots`` for V (amx: ``[N, head_size / 16, 16]``)."""
        num_pages, _, page_size, head_size = pool.shape
        values = pool[:, 1]
        if self.key_layout != "amx":
            return values, (pages, offsets), (head_size,)
        tiles = values.reshape(num_pages, head_size // AMX_TILE, page_size // 2, AMX_TILE, 2)
        index = (pages, slice(None), offsets // 2, slice(None), offsets % 2)
        return tiles, index, (head_size // AMX_TILE, AMX_TILE)

    def write_tokens(
        self, pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store ``keys/values [N, D]`` at flat ``slots [N]`` (page * page_size + offset)."""
        page_size = pool.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        for (view, index, shape), tokens in ((self._key_slots(pool, pages, offsets), keys),
                                             (self._value_slots(pool, pages, offsets), values)):
            view[index] = tokens.to(pool.dtype).reshape(len(slots), *shape)

    def read_tokens(
        self, pool: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys, values [N, D]`` of flat ``slots [N]``."""
        page_size = pool.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        key_view, key_index, _ = self._key_slots(pool, pages, offsets)
        value_view, value_index, _ = self._value_slots(pool, pages, offsets)
        head_size = pool.shape[3]
        return (key_view[key_index].reshape(len(slots), head_size),
                value_view[value_index].reshape(len(slots), head_size))

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

    def to_row_layout(self, pages: torch.Tensor) -> torch.Tensor:
        """Packed pages ``[N, 2, page_size, head_size]`` of this format in the ``row`` layout:
        what a hand-off file holds, so instances whose kernels lay pages out differently (an
        AMX machine and one without, a GPU) read each other's pages."""
        if self.key_layout == "row":
            return pages
        count, _, page_size, head_size = pages.shape
        keys, values = pages[:, 0], pages[:, 1]
        if self.key_layout == "transposed":
            keys = keys.reshape(count, head_size, page_size).transpose(1, 2)
        else:  # amx: K [group, pair, token, 2], V [block, token pair, dimension, 2]
            keys = keys.reshape(count, page_size // AMX_TILE, head_size // 2, AMX_TILE, 2)
            keys = keys.permute(0, 1, 3, 2, 4).reshape(count, page_size, head_size)
            values = values.reshape(count, head_size // AMX_TILE, page_size // 2, AMX_TILE, 2)
            values = values.permute(0, 2, 4, 1, 3).reshape(count, page_size, head_size)
        return torch.stack((keys, values), dim=1)

    def from_row_layout(self, pages: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_row_layout``: ``row``-layout pages in this format."""
        if self.key_layout == "row":
            return pages
        count, _, page_size, head_size = pages.shape
        keys, values = pages[:, 0], pages[:, 1]
        if self.key_layout == "transposed":
            keys = keys.transpose(1, 2).reshape(count, page_size, head_size)
        else:
            keys = keys.reshape(count, page_size // AMX_TILE, AMX_TILE, head_size // 2, 2)
            keys = keys.permute(0, 1, 3, 2, 4).reshape(count, page_size, head_size)
            values = values.reshape(count, page_size // 2, 2, head_size // AMX_TILE, AMX_TILE)
            values = values.permute(0, 3, 1, 4, 2).reshape(count, page_size, head_size)
        return torch.stack((keys, values), dim=1)

    def gather_key_pages(self, pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """K of ``pages [...]`` as ``[..., head_size, page_size]`` (dimension-major): one
        contiguous gather on CPU, where pages already hold K transposed (the amx layout is
        reordered after the gather), so scoring can multiply queries by whole pages without
        first transposing every key. fp8 pages come back decoded (``decode``)."""
        num_pages, _, page_size, head_size = pool.shape
        # index_select over whole K pages is several times faster than advanced indexing
        key_pages = pool.view(num_pages, 2, page_size * head_size)[:, 0]
        keys = self.decode(key_pages.index_select(0, pages.reshape(-1)))
        if self.key_layout == "transposed":
            return keys.view(*pages.shape, head_size, page_size)
        if self.key_layout == "amx":  # [group, pair, token, 2] -> [pair, 2, group, token]
            tiles = keys.view(-1, page_size // AMX_TILE, head_size // 2, AMX_TILE, 2)
            keys = tiles.permute(0, 2, 4, 1, 3).reshape(-1, head_size, page_size)
            return keys.view(*pages.shape, head_size, page_size)
        return keys.view(*pages.shape, page_size, head_size).transpose(-1, -2)

    def gather_keys(
        self, pool: torch.Tensor, page_tables: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """K of the first ``num_tokens`` positions of each row of ``page_tables [...,
        max_pages]``, dimension-major: ``[..., head_size, num_tokens]``, ready to multiply
        queries by (V is not read: scores need none). fp8 pages come back decoded."""
        page_size, head_size = pool.shape[2], pool.shape[3]
        pages = page_tables[..., : -(-num_tokens // page_size)]
        keys = self.gather_key_pages(pool, pages)  # [..., P, D, page]
        keys = keys.transpose(-3, -2).reshape(*pages.shape[:-1], head_size, -1)
        return keys[..., :num_tokens]


CPU_PAGE_FORMAT = PageFormat("transposed")
AMX_PAGE_FORMAT = PageFormat("amx")
GPU_PAGE_FORMAT = PageFormat("row")
