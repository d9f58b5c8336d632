"""Fit a model's query profile (``profile_model.profiles``, for ``--kv-scoring expected``):
the mean and covariance of each query head's queries, measured only where queries look back
at a context: the questions and answers that follow a calibration document, and a
reconstruction of the document ("repeat the previous context"), i.e. the queries later
turns will send. Called by ``python -m kvcompress.profile_model``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcompress.profile_model.calibration import (
    REPEAT_INSTRUCTION,
    calibration_document,
    chat_text,
)
from kvcompress.profile_model.profiles import ProfileError, QueryProfile, model_fingerprint


@dataclass
class _Statistics:
    """Running sums of one layer's queries: per query head, count, sum and outer sum."""

    count: int
    total: torch.Tensor  # [Hq, D] fp64
    outer: torch.Tensor  # [Hq, D, D] fp64

    def add(self, queries: torch.Tensor) -> None:  # [N, Hq, D]
        queries = queries.double()
        self.count += queries.shape[0]
        self.total += queries.sum(0)
        self.outer += torch.einsum("nhd,nhe->hde", queries, queries)

    def mean_and_covariance(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.total / self.count
        covariance = self.outer / self.count - mean[:, :, None] * mean[:, None, :]
        return mean.float(), covariance.float()


def calibration_conversations(tokenizer, documents: int, seed: int) -> list[tuple[str, int]]:
    """``(text, context_chars)`` pairs: queries after ``context_chars`` characters count."""
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        document, questions = calibration_document(rng, rng.randrange(25, 70))
        rng.shuffle(questions)
        context = chat_text(tokenizer, [{"role": "user", "content": document}], True)
        turns = [{"role": "user", "content": document},
                 {"role": "assistant", "content": "I have read it."}]
        for question in questions[:6]:
            asked, answer = question.rsplit("? ", 1)
            turns += [{"role": "user", "content": asked + "?"},
                      {"role": "assistant", "content": answer}]
        texts.append((chat_text(tokenizer, turns, False), len(context)))
        reconstruction = f"{document}\n\n{REPEAT_INSTRUCTION}\n{document}"
        texts.append((reconstruction, len(document)))
    return texts


def fit_query_profile(model_dir: str | Path, documents: int = 6, seed: int = 0,
                  device: str | None = None) -> QueryProfile:
    """Run the model over the calibration conversations and return its query profile."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.eval()
    layers = _attention_modules(model)
    config = model.config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    stats = [_Statistics(0, torch.zeros(num_heads, head_dim, dtype=torch.float64),
                         torch.zeros(num_heads, head_dim, head_dim, dtype=torch.float64))
             for _ in layers]
    mask: list[torch.Tensor] = []  # the current sequence's measured positions

    def collect(index: int):
        def hook(_module, _inputs, output):
            queries = output.reshape(*output.shape[:2], num_heads, head_dim)[0]
            stats[index].add(queries[mask[0]].to("cpu"))
        return hook

    handles = [(getattr(attention, "q_norm", None) or attention.q_proj).register_forward_hook(
        collect(index)) for index, attention in enumerate(layers)]
    try:
        for text, context_chars in calibration_conversations(tokenizer, documents, seed):
            encoded = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
            offsets = encoded.pop("offset_mapping")[0]
            mask[:] = [offsets[:, 0] >= context_chars]
            with torch.inference_mode():
                # The base model only: the queries need no logits.
                model.model(input_ids=encoded["input_ids"].to(device))
    finally:
        for handle in handles:
            handle.remove()
    means, covariances = zip(*(layer_stats.mean_and_covariance() for layer_stats in stats))
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().float().cpu()
    return QueryProfile(
        means=torch.stack(means), covariances=torch.stack(covariances), inv_freq=inv_freq,
        rotary_dim=2 * inv_freq.shape[0],
        rotary_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        attention_scale=float(getattr(layers[0], "scaling", head_dim ** -0.5)),
        fingerprint=model_fingerprint(model_dir), num_queries=stats[0].count)


def _attention_modules(model) -> list:
    """Every decoder layer's attention module (Llama-family layout: ``model.model.layers[i]
    .self_attn`` with ``q_proj``, optionally ``q_norm``, and ``model.model.rotary_emb``)."""
    try:
        modules = [layer.self_attn for layer in model.model.layers]
        _ = modules[0].q_proj, model.model.rotary_emb.inv_freq
    except AttributeError as error:
        raise ProfileError(f"{type(model).__name__} does not have the Llama-family attention "
                           f"layout the query profiler reads ({error})") from error
    return modules
