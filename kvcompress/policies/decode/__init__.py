"""Decode-time eviction: which generated tokens each KV head keeps once a long generation
outgrows its decode budget. One module per method (``window``, ``h2o``, ``snapkv``, ``rkv``,
``anchors``), each defining its ``DecodeMethod`` record; ``registry`` lists them. Pure torch."""

from .base import (
    DecodeEviction,
    DecodeMethod,
    GeneratedSignals,
    newest_offsets,
    recent_and_top_offsets,
)
from .registry import DECODE_METHODS, DECODE_POLICIES, get_decode_method

__all__ = [
    "DECODE_METHODS",
    "DECODE_POLICIES",
    "DecodeEviction",
    "DecodeMethod",
    "GeneratedSignals",
    "get_decode_method",
    "newest_offsets",
    "recent_and_top_offsets",
]
