"""Models with sliding-window layers under vanilla vLLM (kvcompress off): the KV-cache spec
vLLM gives each layer, and greedy tokens equal to transformers' (eager attention) for prompts
longer than the window, prefilled in chunks. The reference for kvcompress's sliding-window
support."""

import gc
import inspect
import re
import textwrap

import pytest

from .harness import greedy, random_prompts

pytestmark = pytest.mark.slow


def vanilla_vllm(model: str, prompts: list[dict], max_tokens: int, **engine_kwargs):
    """Per prompt, its token ids and vLLM's greedy continuation; the KV-cache spec per layer."""
    from vllm import LLM

    llm = LLM(model, dtype="float32", enforce_eager=True, seed=0, **engine_kwargs)
    try:
        assert not llm.llm_engine.vllm_config.additional_config.get("kv_compression")
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        specs = {
            int(re.search(r"layers\.(\d+)\.", name).group(1)): group.kv_cache_spec
            for group in groups for name in group.layer_names
        }
        outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    prompt_ids = [list(output.prompt_token_ids) for output in outputs]
    return prompt_ids, [list(output.outputs[0].token_ids) for output in outputs], specs


def spec_windows(specs) -> list[int | None]:
    """Per layer: the window of a SlidingWindowSpec, None for a FullAttentionSpec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    windows = []
    for layer in range(len(specs)):
        spec = specs[layer]
        assert type(spec) in (FullAttentionSpec, SlidingWindowSpec), (layer, spec)
        windows.append(spec.sliding_window if type(spec) is SlidingWindowSpec else None)
    return windows


def transformers_model(model: str, **config_overrides):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager", **config_overrides
    )


def transformers_greedy(network, prompts: list[list[int]], max_tokens: int):
    import torch

    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            output = network.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=None,  # like vLLM's ignore_eos
            )
            tokens.append(output[0, len(prompt):].tolist())
    return tokens


def next_token_predictions(network, prompt: list[int]):
    import torch

    with torch.no_grad():
        return network(torch.tensor([prompt])).logits[0].argmax(dim=-1)


# Tiny models: window 32, prompts of 300 and 100 tokens prefilled in chunks of 64.
TINY_CASES = {
    # Layers 0-2 and 4-6 sliding, 3 and 7 full (Gemma 3 reads config.layer_types).
    "tiny_gemma3": [32, 32, 32, None] * 2,
    # No layer_types: vLLM puts the model-wide window in CacheConfig, so every layer slides.
    "tiny_mistral_sliding": [32] * 4,
}


@pytest.mark.parametrize("model_fixture", list(TINY_CASES))
def test_tiny_sliding_models_match_transformers(model_fixture, request):
    model = request.getfixturevalue(model_fixture)
    prompts = list(random_prompts([300, 100], seed=16).values())
    _, ours, specs = vanilla_vllm(
        model, [{"prompt_token_ids": prompt} for prompt in prompts], 24,
        max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
        kv_cache_memory_bytes=16 << 20,
    )
    assert spec_windows(specs) == TINY_CASES[model_fixture]
    network = transformers_model(model)
    assert ours == transformers_greedy(network, prompts, 24)
    for tokens in ours:
        assert len(set(tokens)) > 6, f"degenerate continuation {tokens}"
    # The window matters: without it, most predictions past the window change.
    windowed = next_token_predictions(network, prompts[0])[32:]
    unwindowed = next_token_predictions(transformers_model(model, sliding_window=4096),
                                        prompts[0])[32:]
    assert (windowed != unwindowed).float().mean() > 0.5


def test_gemma3_270m_matches_transformers(gemma3_270m):
    """The real model: window 512 on 15 of 18 layers; a 611-token prompt (Python source)
    prefilled in chunks of 256. vLLM tokenizes it, <bos> first."""
    text = inspect.getsource(textwrap)[:2400]
    (prompt,), ours, specs = vanilla_vllm(
        gemma3_270m, [{"prompt": text}], 16,
        max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=2,
        kv_cache_memory_bytes=128 << 20,
    )
    assert spec_windows(specs) == ([512] * 5 + [None]) * 3
    assert prompt[0] == 2 and len(prompt) > 512 + 64, (prompt[:4], len(prompt))
    assert ours == transformers_greedy(transformers_model(gemma3_270m), [prompt], 16)
