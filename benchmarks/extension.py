"""Prompts that continue an earlier request token for token, so that the engine's prefix
cache hands the later request the earlier one's cache (kvcompress: multi-turn reuse, the
compressed cache as it was kept; docs/design.md).

Entries are found by their token ids, not their text: tokenizing the whole longer text again
may merge tokens across the boundary and find nothing. An exact extension is the earlier
request's ids followed by the new text tokenized alone, which is what a client that keeps
token ids sends (benchmarks.shared_context's chat turns, benchmarks.quality's question asked
after its context was compressed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def exact_extension(head_ids: Sequence[int], head_text: str, text: str,
                    encode: Callable[[str], Sequence[int]]) -> list[int]:
    """``head_ids`` (the earlier request's tokens, which ``head_text`` renders) followed by the
    rest of ``text`` after ``head_text``, tokenized alone. ValueError when ``text`` does not
    start with ``head_text``."""
    if not text.startswith(head_text):
        cut = next((i for i, (a, b) in enumerate(zip(head_text, text)) if a != b),
                   min(len(head_text), len(text)))
        raise ValueError(f"the longer text does not start with the earlier one (they differ at "
                         f"character {cut}: {head_text[cut:cut + 20]!r} / {text[cut:cut + 20]!r})")
    return [*head_ids, *encode(text[len(head_text):])]
