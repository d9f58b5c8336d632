"""Shared fixtures: the real models (the embedded SmolLM2, Gemma 3 270M), tiny random Llama /
Qwen2 / Qwen3 / Gemma 2 / gpt-oss models, and tiny random models with sliding-window layers
(Gemma 3: interleaved with full attention; Mistral: every layer)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# In-process engine core (the worker stays a separate process): tests read the scheduler's
# page manager directly. Page invariants are checked after every engine step.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("KVCOMPRESS_CHECK_PAGES", "1")
# Surrogates and profiles the tests make by hub id go to a cache of the test run's own, never
# the user's (kvcompress.profile_model.store), and none of the user's is found by the tests.
os.environ["KVCOMPRESS_CACHE"] = tempfile.mkdtemp(prefix="kvcompress-test-cache-")


@pytest.fixture(scope="session")
def embedded_model() -> str:
    from kvcompress.models import embedded_model_dir, is_prepared

    path = embedded_model_dir()
    if not is_prepared(path):
        pytest.fail(f"embedded model missing at {path}: run `bash scripts/setup.sh` first")
    return str(path)


@pytest.fixture(scope="session")
def gemma3_270m() -> str:
    """Gemma 3 270M (base): 18 layers, 15 of them sliding window 512 (full: 5, 11, 17), one
    KV head of dim 256, bfloat16 weights."""
    from kvcompress.models import GEMMA3_270M, is_prepared

    path = GEMMA3_270M.model_dir()
    if not is_prepared(path):
        pytest.fail(f"Gemma 3 270M missing at {path}: run `bash scripts/setup.sh` first")
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
    return _save_with_embedded_tokenizer(model, path, embedded_model)


@pytest.fixture(scope="session")
def profiled_tiny_llama(tiny_llama) -> str:
    """tiny_llama with its query profile (--kv-scoring expected) written beside it by the
    profiling command (two calibration documents: enough for a valid profile)."""
    from kvcompress.profile_model.command import main as profile_main

    assert profile_main([tiny_llama, "--documents", "2", "--surrogate-documents", "0",
                         "--device", "cpu"]) == 0
    return tiny_llama


@pytest.fixture(scope="session")
def surrogate_tiny_llama(tiny_llama, tmp_path_factory) -> str:
    """A copy of tiny_llama with its score surrogate beside it (--kv-scoring surrogate, and
    what auto resolves to with reuse on), fitted by the profiling command on four prompts.
    A copy, so that tiny_llama's own engines keep resolving auto without one."""
    return _copy_with_surrogate(tiny_llama, tmp_path_factory.mktemp("surrogate"))


@pytest.fixture(scope="session")
def surrogate_tiny_llama_kv4(tiny_llama_kv4, tmp_path_factory) -> str:
    """tiny_llama_kv4 with its score surrogate beside it: the default scoring (auto:
    the surrogate) at tensor parallel 2."""
    return _copy_with_surrogate(tiny_llama_kv4, tmp_path_factory.mktemp("surrogate-kv4"))


def _copy_with_surrogate(model: str, parent: Path) -> str:
    """A copy of ``model`` in ``parent`` with a surrogate fitted on four prompts beside it."""
    from kvcompress.profile_model.command import main as profile_main

    path = parent / Path(model).name
    shutil.copytree(model, path)
    assert profile_main([str(path), "--documents", "1", "--surrogate-documents", "4",
                         "--held-out", "1", "--device", "cpu"]) == 0
    return str(path)


# What the tiny models below share with tiny_llama: the embedded model's vocabulary, 4 layers,
# GQA 4:2 with head dim 32. Nothing is downloaded: each is built from its config here.
TINY_SHAPE = dict(
    vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    pad_token_id=2,
)


@pytest.fixture(scope="session")
def tiny_llama_kv4(tmp_path_factory, embedded_model) -> str:
    """tiny_llama with 4 KV heads (8 query heads): 2 KV heads per rank at tensor parallel 2."""
    return _tiny_llama_with_heads(tmp_path_factory, embedded_model, query_heads=8, kv_heads=4)


@pytest.fixture(scope="session")
def tiny_llama_kv1(tmp_path_factory, embedded_model) -> str:
    """tiny_llama with one KV head (4 query heads): replicated on both ranks at tensor
    parallel 2."""
    return _tiny_llama_with_heads(tmp_path_factory, embedded_model, query_heads=4, kv_heads=1)


def _tiny_llama_with_heads(tmp_path_factory, embedded_model, query_heads, kv_heads) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp(f"tiny-llama-kv{kv_heads}")
    config = LlamaConfig(**{**TINY_SHAPE, "num_attention_heads": query_heads,
                            "num_key_value_heads": kv_heads})
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32)
    return _save_with_embedded_tokenizer(model, path, embedded_model)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, embedded_model) -> str:
    """A tiny random Qwen2: q/k/v projections with biases (random, not the zeros of a fresh
    model, so they matter)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1235)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_SHAPE)).to(torch.float32)
    _randomize(model, ("q_proj.bias", "k_proj.bias", "v_proj.bias"), center=0.0)
    return _save_with_embedded_tokenizer(model, tmp_path_factory.mktemp("tiny-qwen2"),
                                         embedded_model)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, embedded_model) -> str:
    """A tiny random Qwen3: RMS norms on q and k per head (random gains, not the ones of a
    fresh model)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1236)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_SHAPE)).to(torch.float32)
    _randomize(model, ("q_norm.weight", "k_norm.weight"), center=1.0)
    return _save_with_embedded_tokenizer(model, tmp_path_factory.mktemp("tiny-qwen3"),
                                         embedded_model)


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory, embedded_model) -> str:
    """A tiny random Gemma 2 with every layer full attention (no sliding window) and its
    attention logits soft-capped at 5. Large logits (scale 8^-0.5) make the cap matter, and
    gains of ~4 on the sublayer outputs keep the (tied, scaled) input embedding from
    dominating, which would make the model repeat its last token. Without the cap, HF's
    greedy continuations of this model differ at nearly every token."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **TINY_SHAPE, query_pre_attn_scalar=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, layer_types=["full_attention"] * 4,
    )
    torch.manual_seed(1237)
    model = Gemma2ForCausalLM(config).to(torch.float32)
    # Gemma's norms scale by (1 + weight).
    _randomize(model, ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
               center=3.0)
    return _save_with_embedded_tokenizer(model, tmp_path_factory.mktemp("tiny-gemma2"),
                                         embedded_model)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory, embedded_model) -> str:
    """A tiny random gpt-oss (4 experts, 2 per token) with its attention sinks (random, spread
    0.5: without them the greedy continuations differ) and no sliding window on any layer.
    Untied embeddings: vLLM's gpt-oss has its own lm_head and would leave it unloaded."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **(TINY_SHAPE | dict(tie_word_embeddings=False)), num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, layer_types=["full_attention"] * 4,
    )
    torch.manual_seed(1238)
    model = GptOssForCausalLM(config).to(torch.float32)
    _randomize(model, ("sinks",), center=0.0)
    return _save_with_embedded_tokenizer(model, tmp_path_factory.mktemp("tiny-gpt-oss"),
                                         embedded_model)


# tiny_gemma3's layers: three sliding-window layers, then one full-attention layer, twice.
TINY_GEMMA3_LAYER_TYPES = (["sliding_attention"] * 3 + ["full_attention"]) * 2
TINY_SLIDING_WINDOW = 32


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, embedded_model) -> str:
    """A tiny random Gemma 3 text model, 8 layers: sliding window 32 on layers 0-2 and 4-6,
    full attention on 3 and 7 (each kind with its own RoPE base, as in Gemma 3). Random q/k
    norm gains (~2: sharper attention) and, as in tiny_gemma2, gains of ~4 on the sublayer
    outputs (else the model repeats its last token). With them, greedy continuations have no
    repeats, and for 100-300 token prompts they differ from the first token on from those of
    the same weights without the window."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **(TINY_SHAPE | dict(num_hidden_layers=len(TINY_GEMMA3_LAYER_TYPES))),
        layer_types=TINY_GEMMA3_LAYER_TYPES, sliding_window=TINY_SLIDING_WINDOW,
        query_pre_attn_scalar=32,
    )
    torch.manual_seed(1239)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    # Gemma's norms scale by (1 + weight).
    _randomize(model, ("q_norm.weight", "k_norm.weight"), center=1.0)
    _randomize(model, ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
               center=3.0)
    return _save_with_embedded_tokenizer(model, tmp_path_factory.mktemp("tiny-gemma3"),
                                         embedded_model)


@pytest.fixture(scope="session")
def tiny_mistral_sliding(tmp_path_factory, embedded_model) -> str:
    """A tiny random Mistral with sliding window 32 on every layer (Mistral-7B-v0.1's kind: no
    `layer_types`, so vLLM gives every layer a SlidingWindowSpec)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(1240)
    model = MistralForCausalLM(MistralConfig(**TINY_SHAPE, sliding_window=TINY_SLIDING_WINDOW))
    return _save_with_embedded_tokenizer(model.to(torch.float32),
                                         tmp_path_factory.mktemp("tiny-mistral-sliding"),
                                         embedded_model)


def _randomize(model, name_endings: tuple[str, ...], center: float) -> None:
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(name_endings):
                parameter.normal_(center, 0.5)


def _save_with_embedded_tokenizer(model, path: Path, embedded_model: str) -> str:
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        source = Path(embedded_model) / name
        if source.exists():
            shutil.copy(source, path / name)
    return str(path)


@pytest.fixture
def local_hub(tiny_llama, tmp_path, monkeypatch):
    """tiny_llama as the hub id ``tiny-org/tiny-llama`` in a local Hugging Face cache of its
    own (offline, as a user's machine without network), and a kvcompress cache of its own;
    the environment the command and the server read. Yields (hub id, snapshot folder, the
    kvcompress cache)."""
    from kvcompress.profile_model import store

    hub, cache = tmp_path / "hub", tmp_path / "kvcompress-cache"
    repo = hub / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123abc"
    shutil.copytree(tiny_llama, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(store.CACHE_ENV, str(cache))
    return "tiny-org/tiny-llama", snapshot, cache

