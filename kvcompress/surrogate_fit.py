"""Fit a model's score surrogate (``kvcompress.surrogates``) once, with a reconstruction pass
as the teacher. Called by ``python -m kvcompress.profile_model``.

For each calibration prompt (a synthetic document and a question, through the chat
template; ``kvcompress.calibration``), Hugging Face transformers runs the prompt once, then
the engine's reconstruction pass over it: the repeat instruction followed by the prompt in
chunks of ``--kv-reconstruct-chunk``'s default, each chunk attending to the whole prompt and
to its own earlier tokens. A prompt key's teacher score is what
``attention.reconstruction_scores`` computes in the engine: the largest probability any
query of any pass, in any query head of its KV head, pays it. The surrogate's inputs are the
prompt's cached keys and values (the KV cache after the prompt: keys after rotary
embedding, as pages hold them) and the token's place in the prompt.

Per layer and KV head, closed-form ridge regression of the log teacher score on those
inputs (standardized; the normal equations summed in float64 over every calibration token).
A linear map is enough here: on SmolLM2 it reached the rank correlation of a ridge from the
hidden state entering the layer (docs/methods.md). Held-out prompts give the figures the
surrogate file records: rank correlation with the pass per row, and the overlap of the kept
sets at 2x, 4x and 8x, per row and over the whole model (what ``--kv-budget-sharing model``
ranks).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcompress.calibration import REPEAT_PROMPT, calibration_document, chat_text
from kvcompress.profiles import model_fingerprint
from kvcompress.surrogates import MIN_SCORE, ScoreSurrogate, position_features

# The engine's reconstruction chunk (settings.flags.DEFAULT_RECONSTRUCT_CHUNK) and instruction.
TEACHER_CHUNK = 512
# Ridge strength relative to the mean squared standardized input (1e-3: barely regularized;
# the fit is over tens of thousands of tokens and a few hundred inputs).
RIDGE = 1e-3
# Compression factors the held-out overlaps are reported at (kept fraction 1/x).
REPORTED_FACTORS = (2, 4, 8)


@dataclass
class PromptSample:
    """One calibration prompt: per layer its cached ``keys`` / ``values`` ``[L, P, H, D]``
    and the teacher's log scores ``[L, H, P]``."""

    keys: torch.Tensor
    values: torch.Tensor
    log_scores: torch.Tensor

    @property
    def prompt_len(self) -> int:
        return self.keys.shape[1]

    def inputs(self, layer: int, head: int) -> torch.Tensor:
        """``[P, 2D + 4 + 1]`` fp64: key, value, position features, 1."""
        length = self.prompt_len
        places = position_features(torch.arange(length), length)
        return torch.cat([self.keys[layer, :, head].double(), self.values[layer, :, head].double(),
                          places.double(), torch.ones(length, 1, dtype=torch.float64)], dim=-1)


def calibration_prompts(tokenizer, count: int, seed: int) -> list[str]:
    """``count`` chat prompts: a synthetic document of 20-110 sentences (~300-1,800 tokens)
    and one question about it, as a user would send them."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        document, questions = calibration_document(rng, rng.randrange(20, 110))
        question = rng.choice(questions).rsplit("? ", 1)[0] + "?" if questions else "Summarize."
        prompts.append(chat_text(tokenizer, [{"role": "user",
                                              "content": f"{document}\n\n{question}"}], True))
    return prompts


def sample_prompt(model, prompt_ids: Sequence[int], repeat_ids: Sequence[int],
                  chunk: int = TEACHER_CHUNK) -> PromptSample:
    """The prompt's cached K/V and its reconstruction-pass teacher scores (``model`` loaded
    with eager attention, so that it returns its attention probabilities)."""
    config = model.config
    num_kv_heads = config.num_key_value_heads
    group = config.num_attention_heads // num_kv_heads
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    length = ids.shape[1]
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
        keys = torch.stack([layer_keys[0] for layer_keys in _cached(cache, "keys")])
        values = torch.stack([layer_values[0] for layer_values in _cached(cache, "values")])
        best = torch.full((keys.shape[0], num_kv_heads, length), float("-inf"))
        for start in range(0, length, chunk):
            tokens = list(repeat_ids) + list(prompt_ids[start : start + chunk])
            output = model(torch.tensor([tokens], device=model.device),
                           past_key_values=copy.deepcopy(cache), use_cache=True,
                           output_attentions=True)
            for layer, probabilities in enumerate(output.attentions):  # [1, Hq, t, P + t]
                prompt_part = probabilities[0, :, :, :length].float().cpu()
                grouped = prompt_part.reshape(num_kv_heads, group, -1, length)
                best[layer] = torch.maximum(best[layer], grouped.amax(dim=(1, 2)).log())
    # [L, H, P, D] -> [L, P, H, D]: tokens first, as the layer writes them
    return PromptSample(keys.transpose(1, 2).float().cpu(), values.transpose(1, 2).float().cpu(),
                        best.clamp_min(torch.tensor(MIN_SCORE).log()))


def _cached(cache, kind: str) -> list[torch.Tensor]:
    """Each layer's cached keys or values ``[1, H, P, D]`` (transformers' cache classes)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [getattr(layer, kind) for layer in layers]
    return list(getattr(cache, f"{kind[:-1]}_cache"))  # older DynamicCache


def fit_surrogate(samples: Sequence[PromptSample], fingerprint: str,
                  ridge: float = RIDGE) -> ScoreSurrogate:
    """Ridge regression per (layer, KV head) of the log teacher scores on the inputs."""
    first = samples[0]
    num_layers, _, num_kv_heads, head_dim = first.keys.shape
    features = 2 * head_dim + 5
    weights = torch.zeros(num_layers, num_kv_heads, features, dtype=torch.float64)
    for layer in range(num_layers):
        for head in range(num_kv_heads):
            gram = torch.zeros(features, features, dtype=torch.float64)
            moment = torch.zeros(features, dtype=torch.float64)
            count = 0
            for sample in samples:
                inputs = sample.inputs(layer, head)
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
            weights[layer, head] = solution / spread
    weights = weights.float()
    dim = head_dim
    return ScoreSurrogate(weights[..., :dim].contiguous(), weights[..., dim : 2 * dim].contiguous(),
                          weights[..., 2 * dim : 2 * dim + 4].contiguous(),
                          weights[..., -1].contiguous(), fingerprint,
                          sum(sample.prompt_len for sample in samples))


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
    ``model_overlap_Nx`` (the top 1/N over all rows of the model at once)."""
    totals: dict[str, list[float]] = {"rank_correlation": []}
    for sample in samples:
        guess = predicted(surrogate, sample).flatten(0, 1)  # [rows, P]
        truth = sample.log_scores.flatten(0, 1)
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


def make_surrogate(model_dir: str, *, documents: int = 32, held_out: int = 8, seed: int = 1,
                   device: str | None = None, log=print) -> ScoreSurrogate:
    """Load the model, sample ``documents + held_out`` calibration prompts, fit on the first
    ``documents`` and record the held-out figures in ``quality``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").to(device)
    model.eval()
    repeat_ids = tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)
    samples = []
    for number, prompt in enumerate(calibration_prompts(tokenizer, documents + held_out, seed)):
        samples.append(sample_prompt(model, tokenizer(prompt)["input_ids"], repeat_ids))
        log(f"kvcompress: surrogate calibration prompt {number + 1}/{documents + held_out} "
            f"({samples[-1].prompt_len} tokens)")
    surrogate = fit_surrogate(samples[:documents], model_fingerprint(model_dir))
    if held_out:
        surrogate.quality = held_out_quality(surrogate, samples[documents:])
    return surrogate
