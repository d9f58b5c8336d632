"""Natural English on every machine, no network: the long descriptions of the installed
Python packages (each distribution's README, in its METADATA), cut into sentences. Prose
written by people, about many things, unlike the generated filler of the other documents,
and unlike the text the score surrogate is calibrated on (the standard library's docstrings
and code, ``kvcompress.profile_model.corpus``).
"""

from __future__ import annotations

import importlib.metadata
import random
import re
from collections.abc import Callable
from functools import lru_cache

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_MARKUP = re.compile(r"[`*_]{1,3}|<[^>]+>")
# Lines that are markup, code, tables or lists rather than prose.
_NOT_PROSE = ("#", "```", "|", "..", "<", "[!", "![", "===", "---", "*", "-", ">", ":", "+",
              "$", "    ", "\t")
SENTENCE_CHARS = (40, 260)


@lru_cache(maxsize=1)
def natural_sentences() -> tuple[str, ...]:
    """Every installed distribution's prose sentences, in the order of the distributions'
    names (so a seed draws the same text wherever the same packages are installed)."""
    texts = {}
    for distribution in importlib.metadata.distributions():
        name = (distribution.metadata.get("Name") or "").lower()
        if name and name not in texts:
            texts[name] = _description(distribution.read_text("METADATA") or "")
    sentences: list[str] = []
    for name in sorted(texts):
        sentences += [sentence for sentence in _sentences(texts[name])
                      if sentence not in sentences[-50:]]
    return tuple(sentences)


def sentence_source(rng: random.Random) -> Callable[[random.Random], str]:
    """A filler source for ``fill_haystack``: consecutive sentences from a random place in
    the corpus (so a document reads as passages, not as shuffled lines)."""
    sentences = natural_sentences()
    if len(sentences) < 200:
        raise RuntimeError(f"only {len(sentences)} natural sentences found in the installed "
                           "packages' descriptions; use the synthetic filler")
    cursor = rng.randrange(len(sentences))

    def next_sentence(_rng: random.Random) -> str:
        nonlocal cursor
        cursor = (cursor + 1) % len(sentences)
        return sentences[cursor]

    return next_sentence


def _description(metadata: str) -> str:
    """The body after METADATA's headers (older ones keep it in a Description header)."""
    headers, _, body = metadata.partition("\n\n")
    if body.strip():
        return body
    match = re.search(r"^Description: (.*?)(?=^\S+: |\Z)", headers, re.MULTILINE | re.DOTALL)
    return re.sub(r"\n {8}\|?", "\n", match.group(1)) if match else ""


def _sentences(text: str) -> list[str]:
    paragraphs, lines = [], []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or line.startswith(_NOT_PROSE) or stripped.startswith(_NOT_PROSE):
            if lines:
                paragraphs.append(" ".join(lines))
            lines = []
            continue
        lines.append(stripped)
    if lines:
        paragraphs.append(" ".join(lines))
    sentences = []
    for paragraph in paragraphs:
        paragraph = _MARKUP.sub("", _LINK.sub(r"\1", paragraph))
        for sentence in _SENTENCE_END.split(paragraph):
            if _is_prose(sentence):
                sentences.append(sentence)
    return sentences


def _is_prose(sentence: str) -> bool:
    low, high = SENTENCE_CHARS
    if not low <= len(sentence) <= high or not sentence[0].isupper() or sentence[-1] not in ".!?":
        return False
    if any(mark in sentence for mark in ("http", "://", "{", "}", "=", "\\", "@", ">>>")):
        return False
    letters = sum(character.isalpha() or character == " " for character in sentence)
    return letters >= 0.85 * len(sentence)
