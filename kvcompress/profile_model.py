"""Profile a model's queries once, for ``--kv-scoring expected``:

    python -m kvcompress.profile_model [MODEL_DIR] [--out PATH] [--documents N] [--if-missing]

runs the model (Hugging Face transformers, on CPU or the first GPU) over built-in
calibration conversations and writes ``MODEL_DIR/kvcompress_profile.pt``
(``kvcompress.profiles``). Only queries that look back at a context are measured: the
questions and answers that follow a document, and a reconstruction of the document ("repeat
the previous context"), i.e. the queries later turns will send. The documents are
synthetic (records, notes, logs, prose with names, numbers and codes), generated from a
seed, and differ from every benchmark's documents.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcompress.profiles import (
    ProfileError,
    QueryProfile,
    default_profile_path,
    load_profile,
    model_fingerprint,
)

REPEAT_INSTRUCTION = "Repeat the previous context exactly."
_NAMES = ("Amara", "Bogdan", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi",
          "Ingrid", "Jomo", "Katya", "Lorenzo", "Mei", "Nikolai", "Oksana", "Pedro")
_PLACES = ("the north warehouse", "the river depot", "the old mill", "the harbour office",
           "the east annex", "the mountain lab", "the central archive", "the south yard")
_THINGS = ("copper wire", "glass jars", "oak planks", "wool blankets", "solar panels",
           "brass valves", "paper rolls", "clay bricks", "steel bolts", "linen sheets")
_VERBS = ("inspected", "repaired", "moved", "counted", "labelled", "shipped", "ordered",
          "measured")
_PROSE = (
    "The morning was quiet and the light came in low over the fields.",
    "Nobody expected the meeting to run long, yet it did.",
    "A short note on the board reminded everyone to lock the side door.",
    "The old radio in the corner played a song that nobody could name.",
    "Rain had left the road soft, and the trucks moved slowly.",
    "It was agreed that the figures would be checked again on Friday.",
    "Someone had left a cup of tea on the windowsill, long gone cold.",
    "The committee thanked the volunteers for their patience.",
)


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


def calibration_document(rng: random.Random, sentences: int) -> tuple[str, list[str]]:
    """A synthetic document and questions about it (with their answers inline)."""
    lines, questions = [], []
    for _ in range(sentences):
        kind = rng.randrange(4)
        name, place = rng.choice(_NAMES), rng.choice(_PLACES)
        thing, verb = rng.choice(_THINGS), rng.choice(_VERBS)
        count = rng.randrange(2, 900)
        if kind == 0:
            lines.append(f"On day {rng.randrange(1, 29)}, {name} {verb} {count} {thing} "
                         f"at {place}.")
            questions.append(f"How many {thing} did {name} handle? {count}.")
        elif kind == 1:
            code = f"{rng.choice('BDFKLPRTVZ')}{rng.choice('AEIOU')}-{rng.randrange(1000, 9999)}"
            lines.append(f"The lot of {thing} stored at {place} carries the tag {code}.")
            questions.append(f"Which tag do the {thing} at {place} carry? {code}.")
        elif kind == 2:
            lines.append(f"{name} moved from {place} to {rng.choice(_PLACES)} and now "
                         f"looks after the {thing}.")
            questions.append(f"Who looks after the {thing}? {name}.")
        else:
            lines.append(rng.choice(_PROSE))
    return " ".join(lines), questions


def calibration_conversations(tokenizer, documents: int, seed: int) -> list[tuple[str, int]]:
    """``(text, context_chars)`` pairs: queries after ``context_chars`` characters count."""
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        document, questions = calibration_document(rng, rng.randrange(25, 70))
        rng.shuffle(questions)
        context = _chat(tokenizer, [{"role": "user", "content": document}], True)
        turns = [{"role": "user", "content": document},
                 {"role": "assistant", "content": "I have read it."}]
        for question in questions[:6]:
            asked, answer = question.rsplit("? ", 1)
            turns += [{"role": "user", "content": asked + "?"},
                      {"role": "assistant", "content": answer}]
        texts.append((_chat(tokenizer, turns, False), len(context)))
        reconstruction = f"{document}\n\n{REPEAT_INSTRUCTION}\n{document}"
        texts.append((reconstruction, len(document)))
    return texts


def _chat(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    return "\n".join(message["content"] for message in messages)


def profile_model(model_dir: str | Path, documents: int = 12, seed: int = 0,
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
                model(input_ids=encoded["input_ids"].to(device))
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
        raise SystemExit(f"profile_model: {type(model).__name__} does not have the "
                         f"Llama-family attention layout this profiler reads ({error})") from error
    return modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.profile_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?",
                        help="a local Hugging Face model folder (default: the embedded model)")
    parser.add_argument("--out", help="where to write the profile (default: beside the model)")
    parser.add_argument("--documents", type=int, default=12,
                        help="calibration documents (each gives a Q&A and a reconstruction)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing if the model's valid profile is already there")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error("--documents: allowed: an integer >= 1")
    if args.model_dir is None:
        from kvcompress.models import embedded_model_dir

        args.model_dir = str(embedded_model_dir())
    out = Path(args.out) if args.out else default_profile_path(args.model_dir)
    if args.if_missing and out.is_file():
        try:
            load_profile(out, args.model_dir)
            print(f"kvcompress: query profile already at {out}")
            return 0
        except ProfileError as error:
            print(f"kvcompress: remaking the profile ({error})")
    profile = profile_model(args.model_dir, args.documents, args.seed, args.device)
    profile.save(out)
    print(f"kvcompress: query profile of {profile.num_layers} layers x {profile.num_heads} "
          f"heads from {profile.num_queries} queries written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
