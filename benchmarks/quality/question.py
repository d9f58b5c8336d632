"""Where the question is when the cache is compressed: inside the prompt (the suite's mode
so far) or outside it (kvpress's default evaluation: the context is compressed without the
question, which is then asked from the compressed cache).

Outside, through the engine's prefix cache (kvcompress's multi-turn reuse, docs/design.md):
request 1 is the context alone, compressed at its end by the window of its last tokens or by
the reconstruction pass, and kept as a cached entry when it ends; request 2 is the whole
prompt, an exact token extension of request 1's prompt, which adopts that entry cut at the
prompt's end and prefills only the question (the adopter's new part is planned alone: under
a budget larger than the question, the question is kept whole). Request 2's tokens are
those of the question-inside mode, so the two modes differ only in what the compression saw.

Request 1 generates two tokens, not one: kvcompress skips the compression of a request that
ends in its prefill step (``max_tokens=1``), whose cache it takes to be freed right away, and
with reuse on that cache would be filed, and adopted, whole.

Both steps are checked: the plugin's figures count the contexts compressed (request 1) and
``num_cached_tokens`` shows each request 2 adopting its whole context. A request 2 that
adopted nothing (its entry evicted, or settings that may not adopt it) compresses context and
question together, the question-inside mode again: misses are reported by sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.extension import exact_extension
from benchmarks.quality.tasks import split_question
from benchmarks.specs import CompressionSpec

POSITIONS = ("inside", "outside")
CONTEXT_MAX_TOKENS = 2  # request 1's (module doc)
CHOICES = (*POSITIONS, "both")


def positions(choice: str) -> list[str]:
    """``--question-position`` -> the modes run, in report order."""
    return list(POSITIONS) if choice == "both" else [choice]


def question_split(prompt: str, encode: Callable[[str], Sequence[int]],
                   encode_alone: Callable[[str], Sequence[int]]) -> tuple[list[int], int]:
    """The prompt's token ids and how many of them are its context (request 1).

    ``encode`` tokenizes a whole prompt as the suite does. Where the whole prompt's ids start
    with its context's own ids (SmolLM2's tokenizer, every task: the blank line before the
    question starts a token), the ids are the question-inside mode's exactly; elsewhere the
    question is tokenized alone after the context's ids (``encode_alone``: no special
    tokens), an exact extension that may differ from the inside prompt at the boundary."""
    context, _question = split_question(prompt)
    ids, head = list(encode(prompt)), list(encode(context))
    if ids[:len(head)] == head:
        return ids, len(head)
    return exact_extension(head, context, prompt, encode_alone), len(head)


# ----------------------------------------------------------------------------- worker side
def run_outside(engine: Any, prompts: Sequence[Mapping[str, Any]], params: Sequence[Any],
                figures: dict[str, int], progress: Callable[[int], None],
                ) -> tuple[list[Any], dict[str, Any]]:
    """Every context as request 1, all submitted at once and run to completion, then every
    whole prompt as request 2; returns request 2's outputs and what each phase did
    (``figures``: the engine's compression_figures_logger sink, taken per phase)."""
    from vllm import SamplingParams

    from benchmarks.engine import generate

    contexts = [p["prompt_token_ids"][:p["context_tokens"]] for p in prompts]
    # Two tokens: a request that ends in its prefill step is not compressed (module doc).
    short = SamplingParams(max_tokens=CONTEXT_MAX_TOKENS, temperature=0.0)
    _, context_s = generate(engine, contexts, [short] * len(contexts),
                            lambda finished, _tokens: progress(finished))
    context_figures = dict(figures)
    figures.clear()
    outputs, question_s = generate(engine, [p["prompt_token_ids"] for p in prompts], params,
                                   lambda finished, _tokens: progress(len(prompts) + finished))
    return outputs, {"context_s": context_s, "question_s": question_s,
                     "context_figures": context_figures, "question_figures": dict(figures)}


# ----------------------------------------------------------------------------- parent side
def resolved_scoring(spec: CompressionSpec, options: Mapping[str, Any],
                     prefix_caching: bool, model: str) -> str | None:
    """The scoring a configuration runs with on ``model`` in an engine with or without
    prefix caching (``auto`` resolved as the engine does: prefix caching off turns reuse
    off, reuse on picks the model's surrogate where it has one); None for the full cache."""
    if spec.is_vanilla:
        return None
    from kvcompress.settings.config import KVCompressionConfig
    from kvcompress.settings.resolution import resolve_auto_scoring

    config = spec.additional_config(options)
    config.setdefault("kv_reuse", "on" if prefix_caching else "off")
    return resolve_auto_scoring(KVCompressionConfig.from_mapping(config),
                                model).resolved_scoring


def compressible(spec: CompressionSpec, options: Mapping[str, Any],
                 lengths: Sequence[int]) -> int:
    """How many prompts of these lengths the configuration compresses (kvcompress's own rule:
    longer than the budget, or than ``kv_min_prompt`` with a ratio); 0 for the full cache."""
    if spec.is_vanilla:
        return 0
    from kvcompress.settings.config import KVCompressionConfig

    config = KVCompressionConfig.from_mapping(spec.additional_config(options))
    return sum(config.compresses(n) for n in lengths)


def adoption(context_tokens: Sequence[int], cached_tokens: Sequence[int],
             expected_compressions: int, context_figures: Mapping[str, int],
             question_figures: Mapping[str, int]) -> dict[str, Any]:
    """Whether the question-outside mode ran as meant: ``contexts_compressed`` (the plugin's
    count in request 1's phase) against ``expected_compressions`` (contexts longer than the
    budget), and ``hits`` of ``n`` requests 2 that adopted their whole context's cache;
    ``misses``: indices of those that did not. For the full cache (``applies`` false)
    nothing is compressed, so nothing can be missed (vLLM's block cache serves whole blocks
    only, the rest is prefilled again, exactly)."""
    hits = [cached >= context for cached, context in zip(cached_tokens, context_tokens)]
    compressed = expected_compressions > 0
    return {
        "applies": compressed,
        "n": len(hits),
        "expected_compressions": expected_compressions,
        "contexts_compressed": context_figures.get("compressed_requests", 0),
        "hits": sum(hits),
        "misses": [index for index, hit in enumerate(hits) if not hit] if compressed else [],
        "context_tokens_mean": sum(context_tokens) / max(1, len(context_tokens)),
        "cached_tokens_mean": sum(cached_tokens) / max(1, len(cached_tokens)),
        "context_figures": dict(context_figures),
        "question_figures": dict(question_figures),
    }


def adoption_problems(row: Mapping[str, Any]) -> str | None:
    """What went wrong in a question-outside row's two steps, or None."""
    figures = row.get("adoption")
    if not figures or not figures["applies"]:
        return None
    problems = []
    expected = figures.get("expected_compressions", figures["n"])
    if figures["contexts_compressed"] < expected:
        problems.append(f"{expected - figures['contexts_compressed']} of the {expected} "
                        "contexts longer than the budget not compressed")
    if figures["misses"]:
        problems.append(f"{len(figures['misses'])} of {figures['n']} questions did not adopt "
                        f"their context (asked with it inside): samples {figures['misses']}")
    return "; ".join(problems) or None


def add_vs_inside(rows: Sequence[dict[str, Any]]) -> None:
    """``vs_inside``: each question-outside row's paired difference in accuracy to the same
    configuration with the question inside, over the same prompts."""
    from benchmarks.quality.scoring import paired_difference

    inside = {row["label"]: row for row in rows
              if row.get("question", "inside") == "inside" and row.get("ok")}
    for row in rows:
        twin = inside.get(row["label"])
        if row.get("question") == "outside" and row.get("ok") and twin is not None:
            row["vs_inside"] = paired_difference(row["scores"], twin["scores"])
