"""Quality guard on the embedded model: passkey retrieval that the full cache solves still
succeeds with half of the prompt's cache evicted (PyramidKV)."""

import random

import pytest
from vllm import SamplingParams

from .harness import EngineHarness

pytestmark = pytest.mark.slow

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    "There and back again. "
)


def passkey_prompt(seed: int, num_fillers: int = 20) -> tuple[str, str]:
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle_at = rng.randint(1, num_fillers - 1)
    parts = ["There is an important info hidden inside a lot of irrelevant text. Find it and "
             "memorize it. I will quiz you about the important information there. "]
    for index in range(num_fillers):
        if index == needle_at:
            parts.append(f"The pass key is {key}. Remember it. {key} is the pass key. ")
        parts.append(FILLER)
    parts.append("What is the pass key? The pass key is")
    return "".join(parts), key


def test_passkey_survives_half_the_cache_evicted(embedded_model):
    cases = [passkey_prompt(seed) for seed in range(5)]
    harness = EngineHarness(
        embedded_model, {"kv_compression": "pyramidkv", "kv_compression_ratio": 0.5},
        dtype="float32", max_model_len=2048, kv_cache_memory_bytes=512 << 20, max_num_seqs=32,
    )
    settings = {
        "full": {"kv_compression": "none"},
        "pyramidkv": {},
        # Sinks + recent tokens cannot keep a needle from the middle: the task can fail.
        "streamingllm": {"kv_compression": "streamingllm"},
    }
    try:
        tokenizer = harness.engine.get_tokenizer()
        for name, extra_args in settings.items():
            params = SamplingParams(temperature=0, max_tokens=8, extra_args=extra_args)
            for number, (prompt, _) in enumerate(cases):
                harness.add(f"{name}-{number}", tokenizer(prompt).input_ids, params)
        harness.run_until_done()
        solved = {
            name: {number for number, (_, key) in enumerate(cases)
                   if key in tokenizer.decode(harness.outputs[f"{name}-{number}"])}
            for name in settings
        }
    finally:
        harness.shutdown()
    print("passkeys solved:", solved)
    assert len(solved["full"]) >= 4, solved
    assert solved["full"] <= solved["pyramidkv"], solved
    assert len(solved["streamingllm"]) < len(solved["pyramidkv"]), solved
