"""Fit a model's score surrogate (``profile_model.surrogates``) once, with a reconstruction
pass as the teacher. Called by ``python -m kvcompress.profile_model``.

Calibration prompts of every kind (``profile_model.calibration``: synthetic documents,
standard-library prose and code, multi-turn transcripts) go through the teacher
(``profile_model.teacher``: the prompt and the engine's reconstruction chunks in one
forward), which gives each prompt key its pass score and the prompt's cached keys and values
(after rotary embedding, as pages hold them). The surrogate's inputs are those keys and
values and the token's place in the prompt.

Per layer and KV head, closed-form ridge regression of the log teacher score on those
inputs (standardized; the normal equations summed in float64 over every calibration token).
A linear map is enough here: on SmolLM2 it reached the rank correlation of a ridge from the
hidden state entering the layer (docs/methods.md). Held-out prompts of each kind, from text
the fit never saw, give the figures the surrogate file records: rank correlation with the
pass per row, and the overlap of the kept sets at 2x, 4x and 8x, per row and over the whole
model (what ``--kv-budget-sharing model`` ranks). A fit whose held-out top-quarter overlap
falls under a floor, on any kind, is refused with its figures.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcompress.profile_model import teacher
from kvcompress.profile_model.calibration import (
    KINDS,
    REPEAT_PROMPT,
    available_kinds,
    calibration_prompt,
)
from kvcompress.profile_model.profiles import model_fingerprint
from kvcompress.profile_model.surrogates import (
    MIN_SCORE,
    NUM_POSITION_FEATURES,
    ScoreSurrogate,
    position_features,
    quality_line,
)

# The engine's reconstruction chunk (settings.flags.DEFAULT_RECONSTRUCT_CHUNK) and instruction.
TEACHER_CHUNK = 512
# Ridge strength relative to the mean squared standardized input (1e-3: barely regularized;
# the fit is over tens of thousands of tokens and a few hundred inputs).
RIDGE = 1e-3
# Compression factors the held-out overlaps are reported at (kept fraction 1/x).
REPORTED_FACTORS = (2, 4, 8)
# Calibration prompts per kind the fit runs the teacher over, and held out for its figures.
PROMPTS_PER_KIND = 4
HELD_OUT = 2
# The least held-out top-quarter overlap (overlap_4x) a fit is kept with, on every kind.
MIN_OVERLAP = 0.5


@dataclass
class PromptSample:
    """One calibration prompt: per layer its cached ``keys`` / ``values`` ``[L, P, H, D]``
    and the teacher's log scores ``[L, H, P]``; ``compressed [L]``: the layers a policy
    compresses (full attention; a sliding-window layer keeps its window whatever the
    scores, and its pass scores are nothing but that window), all when not given."""

    keys: torch.Tensor
    values: torch.Tensor
    log_scores: torch.Tensor
    compressed: torch.Tensor | None = None

    @property
    def compressed_layers(self) -> list[int]:
        layers = self.keys.shape[0]
        if self.compressed is None:
            return list(range(layers))
        return [layer for layer in range(layers) if self.compressed[layer]]

    @property
    def prompt_len(self) -> int:
        return self.keys.shape[1]

    def inputs(self, layer: int, head: int) -> torch.Tensor:
        """``[P, 4D + 4 + 1]`` fp64: key, its square, value, its square, position features,
        1 (the order of ``fit_surrogate``'s weights)."""
        length = self.prompt_len
        keys = self.keys[layer, :, head].double()
        values = self.values[layer, :, head].double()
        places = position_features(torch.arange(length), length)
        return torch.cat([keys, keys * keys, values, values * values, places.double(),
                          torch.ones(length, 1, dtype=torch.float64)], dim=-1)


def sample_prompt(model, prompt_ids: Sequence[int], repeat_ids: Sequence[int],
                  chunk: int = TEACHER_CHUNK) -> PromptSample:
    """The prompt's cached K/V and its reconstruction-pass teacher scores (``model`` loaded
    with ``attn_implementation=teacher.register()``)."""
    record = teacher.teacher_forward(model, prompt_ids, repeat_ids, chunk)
    layers = range(len(record.best))
    return PromptSample(torch.stack([record.keys[layer] for layer in layers]),
                        torch.stack([record.values[layer] for layer in layers]),
                        torch.stack([record.best[layer] for layer in layers])
                        .clamp_min(MIN_SCORE).log(),
                        torch.tensor([record.windows[layer] is None for layer in layers]))


def fit_surrogate(samples: Sequence[PromptSample], fingerprint: str, ridge: float = RIDGE,
                  squares: bool = True) -> ScoreSurrogate:
    """Ridge regression per (layer, KV head) of the log teacher scores on the inputs
    (``squares=False``: without the squared terms, a format 1 surrogate's map, for
    comparison)."""
    first = samples[0]
    num_layers, _, num_kv_heads, head_dim = first.keys.shape
    used = torch.ones(4 * head_dim + NUM_POSITION_FEATURES + 1, dtype=torch.bool)
    if not squares:
        used[head_dim : 2 * head_dim] = used[3 * head_dim : 4 * head_dim] = False
    features = int(used.sum())
    weights = torch.zeros(num_layers, num_kv_heads, len(used), dtype=torch.float64)
    # A sliding layer's map predicts the floor: a policy never reads its scores.
    weights[..., -1] = math.log(MIN_SCORE)
    for layer in first.compressed_layers:
        for head in range(num_kv_heads):
            gram = torch.zeros(features, features, dtype=torch.float64)
            moment = torch.zeros(features, dtype=torch.float64)
            count = 0
            for sample in samples:
                inputs = sample.inputs(layer, head)[:, used]
                gram += inputs.T @ inputs
                moment += inputs.T @ sample.log_scores[layer, head].double()
                count += inputs.shape[0]
            # Standardize through the Gram matrix: ridge in units of each input's spread.
            mean = gram[-1] / count
            spread = (gram.diagonal() / count - mean * mean).clamp_min(1e-12).sqrt()
            spread[-1] = 1.0
            scaled = gram / spread[:, None] / spread[None, :]
            penalty = ridge * count * torch.eye(features, dtype=torch.float64)
            penalty[-1, -1] = 0.0  # the bias is not shrunk
            solution = torch.linalg.solve(scaled + penalty, moment / spread)
            weights[layer, head, used] = solution / spread
    key, key_square, value, value_square, places = weights.float()[..., :-1].split(
        [head_dim] * 4 + [NUM_POSITION_FEATURES], dim=-1)
    return ScoreSurrogate(key.contiguous(), value.contiguous(), places.contiguous(),
                          weights[..., -1].float().contiguous(), fingerprint,
                          sum(sample.prompt_len for sample in samples),
                          key_square_weights=key_square.contiguous(),
                          value_square_weights=value_square.contiguous())


def predicted(surrogate: ScoreSurrogate, sample: PromptSample) -> torch.Tensor:
    """``[L, H, P]`` the surrogate's log scores of a sample's prompt."""
    places = position_features(torch.arange(sample.prompt_len), sample.prompt_len)
    return torch.stack([surrogate.log_scores(layer, sample.keys[layer], sample.values[layer],
                                             places).T
                        for layer in range(surrogate.num_layers)])


def held_out_quality(surrogate: ScoreSurrogate,
                     samples: Sequence[PromptSample]) -> dict[str, float]:
    """Mean over held-out prompts: ``rank_correlation`` (Spearman, per row, then averaged),
    ``overlap_Nx`` (kept sets of the top 1/N of each row, shared fraction) and
    ``model_overlap_Nx`` (the top 1/N over all rows of the model at once); over the rows of
    the layers a policy compresses."""
    totals: dict[str, list[float]] = {"rank_correlation": []}
    for sample in samples:
        layers = sample.compressed_layers  # the rows whose scores a policy reads
        guess = predicted(surrogate, sample)[layers].flatten(0, 1)  # [rows, P]
        truth = sample.log_scores[layers].flatten(0, 1)
        totals["rank_correlation"] += _spearman_rows(guess, truth).tolist()
        for factor in REPORTED_FACTORS:
            totals.setdefault(f"overlap_{factor}x", []).append(
                float(_top_overlap(guess, truth, 1 / factor).mean()))
            totals.setdefault(f"model_overlap_{factor}x", []).append(
                float(_top_overlap(guess.reshape(1, -1), truth.reshape(1, -1), 1 / factor)[0]))
    return {key: sum(values) / len(values) for key, values in totals.items()}


def _spearman_rows(guess: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    ranks = [values.argsort(-1).argsort(-1).double() for values in (guess, truth)]
    centred = [rank - rank.mean(-1, keepdim=True) for rank in ranks]
    return (centred[0] * centred[1]).sum(-1) / (centred[0].norm(dim=-1)
                                                * centred[1].norm(dim=-1)).clamp_min(1e-12)


def _top_overlap(guess: torch.Tensor, truth: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per row: the share of the true top ``fraction`` that the guessed top also holds."""
    keep = max(1, int(guess.shape[-1] * fraction))
    chosen = torch.zeros_like(guess, dtype=torch.bool).scatter_(-1, guess.topk(keep).indices, True)
    wanted = torch.zeros_like(truth, dtype=torch.bool).scatter_(-1, truth.topk(keep).indices, True)
    return (chosen & wanted).sum(-1).double() / keep


class SurrogateRefused(ValueError):
    """A fit whose held-out figures fall under the floor."""


def make_surrogate(model_dir: str, *, prompts: int = PROMPTS_PER_KIND,
                   held_out: int = HELD_OUT, seed: int = 1, device: str | None = None,
                   min_overlap: float = MIN_OVERLAP, log=print) -> ScoreSurrogate:
    """Run the teacher over ``prompts`` fitting and ``held_out`` held-out prompts of each
    kind, fit, and record the held-out figures in ``quality``: over all kinds
    (``rank_correlation``, ``overlap_4x``, ...) and per kind (``prose.overlap_4x``).
    Raises SurrogateRefused where a kind's top-quarter overlap is under ``min_overlap``."""
    fitting, held = teacher_samples(model_dir, prompts, held_out, seed, device, log)
    surrogate = fit_surrogate(fitting, model_fingerprint(model_dir))
    if held_out:
        surrogate.quality = kind_quality(surrogate, held)
        poor = [kind for kind in held if surrogate.quality[f"{kind}.overlap_4x"] < min_overlap]
        if poor:
            raise SurrogateRefused(
                f"the score surrogate's held-out top-quarter overlap is under the floor "
                f"{min_overlap:.2f} on {', '.join(poor)} ({quality_line(surrogate.quality)}); "
                "fit on more prompts (--surrogate-prompts), or lower the floor "
                "(--min-overlap) to accept it")
    return surrogate


def teacher_samples(model_dir: str, prompts: int, held_out: int, seed: int,
                    device: str | None = None,
                    log=print) -> tuple[list[PromptSample], dict[str, list[PromptSample]]]:
    """Load the model with the teacher's attention and run it over ``prompts`` fitting
    prompts of each kind and ``held_out`` held-out ones (per kind). Each (kind, role) draws
    from its own seeded generator: the fitting prompts do not depend on how many are held
    out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=teacher.register())
    model = model.to(device).eval()
    repeat_ids = tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)

    def run(kind: str, count: int, is_held_out: bool) -> list[PromptSample]:
        rng = random.Random(f"{seed}/{kind}/{'held out' if is_held_out else 'fitting'}")
        return [sample_prompt(model, tokenizer(calibration_prompt(
                    tokenizer, kind, rng, held_out=is_held_out))["input_ids"], repeat_ids)
                for _ in range(count)]

    fitting: list[PromptSample] = []
    held: dict[str, list[PromptSample]] = {}
    kinds = available_kinds()
    if kinds != KINDS:
        log("kvcompress: the standard library's source is not installed: the surrogate is "
            "calibrated on synthetic documents only")
    for kind in kinds:
        fitting += run(kind, prompts, False)
        if held_out:
            held[kind] = run(kind, held_out, True)
        log(f"kvcompress: surrogate teacher ran {prompts + held_out} {kind} prompts")
    return fitting, held


def kind_quality(surrogate: ScoreSurrogate,
                 held: dict[str, Sequence[PromptSample]]) -> dict[str, float]:
    """``held_out_quality`` over every held-out prompt, then per kind (``kind.figure``)."""
    quality = held_out_quality(surrogate, [sample for samples in held.values()
                                           for sample in samples])
    for kind, samples in held.items():
        quality.update({f"{kind}.{key}": value
                        for key, value in held_out_quality(surrogate, samples).items()})
    return quality
