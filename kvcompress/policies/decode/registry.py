"""The decode-time eviction methods users can choose (``--kv-decode-policy``), in the order
they see them, and lookup by name. A new method is one file here plus one line below."""

from __future__ import annotations

from ..validation import check_choice
from .anchors import ANCHORS
from .base import DecodeMethod
from .h2o import H2O
from .rkv import RKV
from .snapkv import SNAPKV
from .window import WINDOW

DECODE_METHODS: tuple[DecodeMethod, ...] = (WINDOW, H2O, SNAPKV, RKV, ANCHORS)
DECODE_POLICIES: tuple[str, ...] = tuple(method.name for method in DECODE_METHODS)
_BY_NAME = {method.name: method for method in DECODE_METHODS}


def get_decode_method(name: str) -> DecodeMethod:
    """The record of decode method ``name``; ValueError naming the allowed ones otherwise."""
    check_choice("decode policy", name, DECODE_POLICIES)
    return _BY_NAME[name]
