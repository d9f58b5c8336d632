"""The page layout from vLLM's KV-cache config: hybrid (full + sliding-window) groups share
one layout in depth order, their aliased allocation is counted once, the rest is refused."""

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

from kvcompress.engine.scoring_memory import decode_reserved_bytes, reserved_bytes
from kvcompress.engine.vllm_layout import (
    ScoringReserve,
    attention_layer_names,
    kv_cache_bytes,
    page_layout,
)
from kvcompress.paging import PageLayout

SHAPE = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
SIZE = 1 << 22


def name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def gemma3_like_config(size: int = SIZE) -> KVCacheConfig:
    """vLLM's grouping of a 12-layer Gemma 3 (full at 5 and 11): one full group and five
    sliding groups of two layers, every group's tensor aliasing the same allocation."""
    full = [5, 11]
    sliding = [layer for layer in range(12) if layer not in full]
    groups = [KVCacheGroupSpec([name(i) for i in full], FullAttentionSpec(**SHAPE))]
    for start in range(5):
        layers = sliding[start::5]
        groups.append(KVCacheGroupSpec([name(i) for i in layers],
                                       SlidingWindowSpec(**SHAPE, sliding_window=512)))
    tensors = [KVCacheTensor(size=size, layers=group.layer_names, layer_stride=0,
                             block_stride=0) for group in groups]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors, kv_cache_groups=groups)


def test_hybrid_groups_share_one_layout_in_depth_order():
    config = gemma3_like_config()
    assert attention_layer_names(config) == [name(i) for i in range(12)]
    layout = page_layout(config, page_size=16)
    assert layout.layer_windows == tuple(0 if i in (5, 11) else 512 for i in range(12))
    assert layout.compressed_layers == (5, 11)
    # Six group tensors alias one allocation: its bytes count once.
    assert kv_cache_bytes(config) == SIZE
    assert layout.total_pages == SIZE // layout.page_bytes


def test_full_attention_only_model_has_no_windows():
    group = KVCacheGroupSpec([name(0), name(1)], FullAttentionSpec(**SHAPE))
    config = KVCacheConfig(num_blocks=8, kv_cache_groups=[group], kv_cache_tensors=[
        KVCacheTensor(size=SIZE, layers=group.layer_names, layer_stride=0, block_stride=0)])
    layout = page_layout(config, page_size=16)
    assert layout.layer_windows == () and not layout.has_sliding_layers


def test_unsupported_kv_cache_layouts_are_refused_with_the_reason():
    merged = KVCacheGroupSpec([name(0), name(1)], FullAttentionSpec(**SHAPE, sliding_window=8))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[merged])
    with pytest.raises(NotImplementedError, match="--disable-hybrid-kv-cache-manager"):
        attention_layer_names(config)
    mamba = KVCacheGroupSpec([name(0)], MambaSpec(block_size=16, shapes=((1,),),
                                                  dtypes=(torch.float32,)))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[mamba])
    with pytest.raises(NotImplementedError, match="MambaSpec"):
        attention_layer_names(config)
    other_shape = dict(SHAPE, head_size=128)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([name(0)], FullAttentionSpec(**SHAPE)),
        KVCacheGroupSpec([name(1)], SlidingWindowSpec(**other_shape, sliding_window=4))])
    with pytest.raises(NotImplementedError, match="same KV heads, head size"):
        attention_layer_names(config)


def test_the_decode_score_reserve_comes_out_of_the_kv_memory():
    """Every running request's decode accumulators, at the engine's capacity, are taken from
    the pages, to the page."""
    config = gemma3_like_config()
    plain = page_layout(config, 16, ScoringReserve(1000, 500))
    reserve = ScoringReserve(1000, 500, decode_requests=8, decode_capacity=96)
    with_decode = page_layout(config, 16, reserve)
    decode_bytes = decode_reserved_bytes(8, 12, 1, 96)
    assert 8 * reserve.decode_request_bytes(12, 1) == decode_bytes > 0
    window_bytes = reserved_bytes(1000, 12, 1, 500)
    assert plain.total_pages == (SIZE - window_bytes) // plain.page_bytes
    assert with_decode.total_pages == (SIZE - window_bytes - decode_bytes) // plain.page_bytes


def test_the_decode_score_reserve_covers_only_requests_the_pool_can_run():
    """max_num_seqs far above what the pool runs: decode accumulators are reserved for the
    requests that can each hold a page of every row beside its own, not for max_num_seqs
    (which would leave this pool no pages at all)."""
    config = gemma3_like_config()
    reserve = ScoringReserve(1000, 500, decode_requests=10_000, decode_capacity=96)
    layout = page_layout(config, 16, reserve)
    rows, window_bytes = 12, reserved_bytes(1000, 12, 1, 500)
    per_request = rows * layout.page_bytes + decode_reserved_bytes(1, 12, 1, 96)
    runnable = (SIZE - window_bytes) // per_request
    assert 0 < runnable < 10_000
    decode_bytes = decode_reserved_bytes(runnable, 12, 1, 96)
    assert layout.total_pages == (SIZE - window_bytes - decode_bytes) // layout.page_bytes
    assert layout.total_pages >= runnable * rows  # each of them runs, a page in every row


def test_the_decode_score_reserve_leaves_room_for_one_request_of_max_model_len():
    """Reserving decode scores for every request the pool could run would leave too few
    pages for one request of max_model_len: the reserve shrinks to the most requests that
    leave room for it (the scheduler runs no more at once) instead of refusing the start."""
    config = gemma3_like_config()
    longest, chunk = 480, 64
    reserve = ScoringReserve(1000, longest, decode_requests=10_000, decode_capacity=96,
                             max_chunk=chunk)
    layout = page_layout(config, 16, reserve)
    request_bytes = decode_reserved_bytes(1, 12, 1, 96)
    runnable = ((SIZE - reserved_bytes(1000, 12, 1, longest))
                // (12 * layout.page_bytes + request_bytes))
    needed = layout.pages_for_longest_request(longest, chunk)
    assert 0 < layout.decode_score_requests < runnable
    layout.check_holds_one_request(longest, chunk)
    # one request more would not leave room
    assert layout.total_pages - needed < -(-request_bytes // layout.page_bytes)


def test_a_pool_too_small_for_max_model_len_names_the_max_num_seqs_that_fits():
    """28 pages short, 3 pages' worth of decode scores per request: 10 requests fewer
    (--max-num-seqs 10) free 30 pages, enough."""
    page_bytes = 2 * 16 * 64 * 4
    layout = PageLayout(num_layers=2, num_kv_heads=1, head_size=64, page_size=16, dtype_bytes=4,
                        total_pages=100, decode_score_requests=20,
                        decode_score_request_bytes=3 * page_bytes)
    with pytest.raises(ValueError, match=r"needs 128 .*--max-num-seqs 10 fits, or a smaller "
                                         r"--kv-decode-budget: 60 pages' worth .* 20 running"):
        layout.check_holds_one_request(1024)
    layout.check_holds_one_request(800)  # 100 pages: fits
