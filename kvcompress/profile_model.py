"""Profile a model once, for the scorings that need no extra pass:

    python -m kvcompress.profile_model [MODEL] [--out PATH] [--documents N] [--if-missing]

runs the model (Hugging Face transformers, on CPU or the first GPU) over built-in
calibration text and writes its query profile (``kvcompress.profiles``, for ``--kv-scoring
expected``) and its score surrogate (``kvcompress.surrogates``, for ``--kv-scoring
surrogate`` and ``auto``; fitted by ``kvcompress.surrogate_fit``). MODEL is a local folder
or a hub id in the local Hugging Face cache; the files go beside a folder
(``kvcompress_profile.pt``, ``kvcompress_surrogate.pt``), or for a hub id into the user's
kvcompress cache, where the server finds them (``kvcompress.model_store``). For the
profile, only queries that look back at a context are measured: the questions and answers
that follow a document, and a reconstruction of the document ("repeat the previous
context"), i.e. the queries later turns will send. The documents are synthetic (records,
notes, logs, prose with names, numbers and codes), generated from a
seed, and differ from every benchmark's documents.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcompress import model_store
from kvcompress.calibration import REPEAT_INSTRUCTION, calibration_document, chat_text
from kvcompress.profiles import (
    QueryProfile,
    load_profile,
    model_fingerprint,
)
from kvcompress.surrogates import load_surrogate


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
    parser.add_argument("model", nargs="?",
                        help="a local Hugging Face model folder, or a hub id in the local "
                             "Hugging Face cache (default: the embedded model)")
    parser.add_argument("--out", help="where to write the profile (default: beside a folder, "
                                      "the user's kvcompress cache for a hub id)")
    parser.add_argument("--surrogate-out",
                        help="where to write the score surrogate (default: as --out)")
    parser.add_argument("--documents", type=int, default=12,
                        help="calibration documents (each gives a Q&A and a reconstruction)")
    parser.add_argument("--surrogate-documents", type=int, default=32,
                        help="calibration prompts the score surrogate is fitted on "
                             "(0: make no surrogate)")
    parser.add_argument("--held-out", type=int, default=8,
                        help="further prompts the surrogate's figures are measured on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--if-missing", action="store_true",
                        help="make only what is missing (or made for another model)")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error("--documents: allowed: an integer >= 1")
    if args.surrogate_documents < 0 or args.held_out < 0:
        parser.error("--surrogate-documents / --held-out: allowed: an integer >= 0")
    if args.model is None:
        from kvcompress.models import embedded_model_dir

        args.model = str(embedded_model_dir())
    folder = model_store.model_folder(args.model)
    if folder is None:
        parser.error(f"MODEL: {args.model} is neither a model folder nor a hub id in the local "
                     "Hugging Face cache (HF_HUB_CACHE); download it first")
    args.model_dir = str(folder)
    out = (Path(args.out) if args.out
           else model_store.default_out("profile", args.model, folder))
    out.parent.mkdir(parents=True, exist_ok=True)
    if not (args.if_missing and _valid(out, args.model_dir, load_profile, "query profile")):
        profile = profile_model(args.model_dir, args.documents, args.seed, args.device)
        profile.save(out)
        print(f"kvcompress: query profile of {profile.num_layers} layers x "
              f"{profile.num_heads} heads from {profile.num_queries} queries written to {out}")
    if args.surrogate_documents:
        _make_surrogate(args)
    return 0


def _make_surrogate(args: argparse.Namespace) -> None:
    from kvcompress.surrogate_fit import make_surrogate

    out = (Path(args.surrogate_out) if args.surrogate_out
           else model_store.default_out("surrogate", args.model, Path(args.model_dir)))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.if_missing and _valid(out, args.model_dir, load_surrogate, "score surrogate"):
        return
    surrogate = make_surrogate(args.model_dir, documents=args.surrogate_documents,
                               held_out=args.held_out, seed=args.seed + 1, device=args.device)
    surrogate.save(out)
    figures = ", ".join(f"{key} {value:.3f}" for key, value in surrogate.quality.items())
    print(f"kvcompress: score surrogate of {surrogate.num_layers} layers x "
          f"{surrogate.num_kv_heads} KV heads from {surrogate.num_tokens} prompt tokens "
          f"written to {out}" + (f"; held out: {figures}" if figures else ""))


def _valid(path: Path, model_dir: str, load, what: str) -> bool:
    """Whether ``path`` holds a valid ``what`` of this model (``load`` checks it)."""
    if not path.is_file():
        return False
    try:
        load(path, model_dir)
    except ValueError as error:
        print(f"kvcompress: remaking the {what} ({error})")
        return False
    print(f"kvcompress: {what} already at {path}")
    return True


if __name__ == "__main__":
    sys.exit(main())
