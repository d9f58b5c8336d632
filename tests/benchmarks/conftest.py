"""Benchmark-script tests: the scripts live in benchmarks/ (not a package), import them by path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


def words(text: str) -> int:
    """A fast stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


@pytest.fixture
def count_words():
    return words
