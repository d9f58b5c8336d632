"""Benchmark tests: ``benchmarks`` is a package at the repository root; tests/ and
tests/benchmarks are packages too, so pytest imports from the root and ``benchmarks`` resolves."""

from __future__ import annotations

import pytest


def words(text: str) -> int:
    """A fast stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


@pytest.fixture
def count_words():
    return words


@pytest.fixture(scope="session")
def smollm_tokenizer(embedded_model):
    """The embedded model's tokenizer (transformers), loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model)
