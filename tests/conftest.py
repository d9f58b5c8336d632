"""Shared fixtures: the embedded model, a tiny random Llama, engine harness settings."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# In-process engine core (the worker stays a separate process): tests read the scheduler's
# page manager directly. Page invariants are checked after every engine step.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("KVCOMPRESS_CHECK_PAGES", "1")


@pytest.fixture(scope="session")
def embedded_model() -> str:
    from kvcompress.models import embedded_model_dir, is_prepared

    path = embedded_model_dir()
    if not is_prepared(path):
        pytest.fail(f"embedded model missing at {path}: run `bash scripts/setup.sh` first")
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, embedded_model) -> str:
    """A 4-layer random Llama (GQA 4:2, head dim 32) with the embedded model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        source = Path(embedded_model) / name
        if source.exists():
            shutil.copy(source, path / name)
    return str(path)
