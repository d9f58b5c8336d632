"""The compression methods users can choose, in the order they see them, and lookup by name.

Adding a method: write ``methods/<name>.py`` with its ``CompressionMethod`` record and add that
record to COMPRESSION_METHODS. The --kv-compression choices and help (settings/flags.py), the
``budgets`` command, the benchmarks (they iterate METHODS), PolicySettings and plan_keep all read
this list.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .methods.adakv import ADAKV
from .methods.base import CompressionMethod
from .methods.pyramidkv import PYRAMIDKV
from .methods.snapkv import SNAPKV
from .methods.streamingllm import STREAMINGLLM
from .validation import check_choice

COMPRESSION_METHODS: tuple[CompressionMethod, ...] = (PYRAMIDKV, SNAPKV, STREAMINGLLM, ADAKV)
METHODS: tuple[str, ...] = tuple(method.name for method in COMPRESSION_METHODS)

_BY_NAME = {method.name: method for method in COMPRESSION_METHODS}
# Known only inside a ``temporarily_registered`` block.
_temporary: dict[str, CompressionMethod] = {}


def get_method(name: str) -> CompressionMethod:
    """The record of method ``name``; ValueError naming the allowed methods otherwise."""
    known = {**_BY_NAME, **_temporary}
    check_choice("method", name, tuple(known))
    return known[name]


@contextmanager
def temporarily_registered(method: CompressionMethod) -> Iterator[CompressionMethod]:
    """Make ``method`` known to get_method, hence PolicySettings, plan_keep and layer_budgets,
    inside the with-block: for tests and experiments.

    The user-facing choices (METHODS, --kv-compression, the ``budgets`` command) are fixed at
    import and list COMPRESSION_METHODS only; a method meant for users gets a line there.
    """
    if method.name in _BY_NAME or method.name in _temporary:
        raise ValueError(f"method {method.name!r} is already registered")
    _temporary[method.name] = method
    try:
        yield method
    finally:
        del _temporary[method.name]
