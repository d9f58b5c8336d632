"""Query-agnostic scoring end to end (--kv-scoring reconstruct, the default): a cache
compressed 4x while turn 1 asked one fact still answers turn 2's question about another
fact, through multi-turn reuse, on the embedded model."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from vllm import SamplingParams

from benchmarks.documents import Prompts, make_documents, score_answer

from .harness import EngineHarness

pytestmark = pytest.mark.slow

DOCUMENTS = 4


def run_two_turns(model: str, scoring: str) -> tuple[list[float], list[int], list[int]]:
    """Turn 1 (the document and its first question) then turn 2 (another fact) of every
    document; (turn 2 scores, turn 1 prompt lengths, turn 2 cached tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    documents = make_documents(
        DOCUMENTS, 750, seed=0, count=lambda text: len(tokenizer.encode(text)))
    prompts = Prompts(tokenizer)
    stops = sorted(set(tokenizer.all_special_ids))
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=stops)
    harness = EngineHarness(
        model, {"kv_compression": "pyramidkv", "kv_compression_ratio": 0.75,
                "kv_scoring": scoring},
        dtype="float32", max_model_len=2048, max_num_batched_tokens=2048,
        enable_prefix_caching=True, kv_cache_memory_bytes=1 << 29)
    try:
        first = {f"d{d.index}": prompts.chat_turn(d, 0, [], []) for d in documents}
        answers = harness.generate(first, params)
        second = {}
        for document in documents:
            name = f"d{document.index}"
            ids = [token for token in answers[name] if token not in stops]
            history = [(tokenizer.decode(ids), ids)]
            second[f"{name}t2"] = prompts.chat_turn(document, 1, history, first[name])
        outputs = harness.generate(second, params)
        scores = [score_answer(tokenizer.decode(outputs[f"d{d.index}t2"]), d.questions[1])
                  for d in documents]
        cached = [harness.cached_tokens[f"d{d.index}t2"] for d in documents]
        manager = harness.page_manager
        assert not manager.request_ids()
        assert manager.num_available == manager.total_pages
        return scores, [len(first[f"d{d.index}"]) for d in documents], cached
    finally:
        harness.shutdown()


def test_turn_two_finds_a_fact_turn_one_never_asked_about(embedded_model):
    scores, first_lens, cached = run_two_turns(embedded_model, "reconstruct")
    # Turn 2 adopted turn 1's compressed cache (prompt and answer): reuse really happened.
    assert all(hit >= length for hit, length in zip(cached, first_lens)), (cached, first_lens)
    assert sum(scores) >= DOCUMENTS - 1, scores
