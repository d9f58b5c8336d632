"""Score surrogates: a reconstruction pass's scores without the pass (after KVzap).

A reconstruction pass (``--kv-scoring reconstruct``) scores each prompt key by the largest
attention the model pays it while repeating the prompt: query-agnostic, so a kept cache
answers later questions, but it costs a second prefill. A surrogate predicts the log of that
score from what the attention layer already holds while it writes the key: per layer and KV
head, a linear map of the key as cached (after rotary embedding), the value, and four
features of the token's place in the prompt. Made once per model
(``python -m kvcompress.profile_model``, ``profile_model.surrogate_fit``) with the pass as
teacher; applied inside the prefill, in the same step as the layer's forward
(``kvcompress.attention.surrogate_scores``).

Why these inputs: they are what the attention backend has, on every rank of tensor
parallelism, for every chunk of a chunked prefill, with no hook into the model. Measured on
SmolLM2-135M they predict the pass as well as the hidden state entering the layer (docs/
methods.md, "Scores without a second prefill").

The file sits beside the model (``kvcompress_surrogate.pt``) and names the model it was
made for (``profiles.model_fingerprint``); loading it for another model fails. No vLLM
imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcompress.profile_model.profiles import other_model

SURROGATE_FILE = "kvcompress_surrogate.pt"
FORMAT_VERSION = 2
# Format 1 (no squared terms) still loads: its squares count as zero.
READABLE_FORMATS = (1, 2)
# Features of a token's place in the prompt: log(1 + position), first token, among the
# first four (attention sinks), log(1 + tokens after it in the prompt).
NUM_POSITION_FEATURES = 4
# Scores never reach exactly 0 (their log is predicted): a floor for log-space targets.
MIN_SCORE = 1e-12


class SurrogateError(ValueError):
    """A surrogate that is missing, malformed or made for another model."""


def position_features(positions: torch.Tensor, prompt_len: int | torch.Tensor) -> torch.Tensor:
    """``[N, 4]`` fp32 features of tokens at ``positions [N]`` of a prompt of ``prompt_len``
    tokens (see NUM_POSITION_FEATURES)."""
    place = positions.float()
    after = (torch.as_tensor(prompt_len, device=positions.device) - 1 - positions).clamp_min(0)
    return torch.stack([torch.log1p(place), (positions == 0).float(), (positions < 4).float(),
                        torch.log1p(after.float())], dim=-1)


@dataclass
class ScoreSurrogate:
    """Per layer ``l`` and KV head ``h``: ``key_weights[l, h]`` and ``value_weights[l, h]``
    ``[D]``, ``position_weights[l, h]`` ``[4]``, ``bias[l, h]`` and, where fitted,
    ``key_square_weights`` / ``value_square_weights`` ``[D]``; the predicted log score of a
    token is ``k . wk + (k * k) . wkk + v . wv + (v * v) . wvv + position_features . wp + b``
    (fp32). The squares (format 2) let a head favour keys far from its mean in either
    direction, which a linear map cannot: on SmolLM2 they raised the held-out top-quarter
    overlap from 0.69 to 0.73 (docs/methods.md). ``quality``: the held-out figures of the
    fit (rank correlation, kept-set overlaps, per kind of calibration text)."""

    key_weights: torch.Tensor  # [L, H, D]
    value_weights: torch.Tensor  # [L, H, D]
    position_weights: torch.Tensor  # [L, H, 4]
    bias: torch.Tensor  # [L, H]
    fingerprint: str
    num_tokens: int  # calibration tokens the fit saw
    quality: dict[str, float] = field(default_factory=dict)
    key_square_weights: torch.Tensor | None = None  # [L, H, D]; None: a format 1 file
    value_square_weights: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.key_weights.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.key_weights.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key_weights.shape[2]

    def log_scores(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                   places: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` predicted log scores of ``layer``'s tokens: ``key`` / ``value``
        ``[N, H, D]`` as the layer writes them, ``places [N, 4]`` their
        ``position_features``."""
        key, value = key.float(), value.float()
        scores = ((key * self.key_weights[layer]).sum(-1)
                  + (value * self.value_weights[layer]).sum(-1)
                  + places @ self.position_weights[layer].T + self.bias[layer])
        if self.key_square_weights is not None and self.value_square_weights is not None:
            scores += ((key * key * self.key_square_weights[layer]).sum(-1)
                       + (value * value * self.value_square_weights[layer]).sum(-1))
        return scores

    def _mapped(self, change) -> ScoreSurrogate:
        """The same surrogate with ``change`` applied to every weight tensor."""
        squares = (self.key_square_weights, self.value_square_weights)
        return ScoreSurrogate(change(self.key_weights), change(self.value_weights),
                              change(self.position_weights), change(self.bias),
                              self.fingerprint, self.num_tokens, dict(self.quality),
                              *(None if weights is None else change(weights)
                                for weights in squares))

    def to(self, device: torch.device | str) -> ScoreSurrogate:
        return self._mapped(lambda weights: weights.to(device))

    def heads_of_rank(self, rank: int, world_size: int) -> ScoreSurrogate:
        """The KV heads one tensor-parallel rank holds (split evenly; a model with fewer KV
        heads than ranks replicates them, each rank holding one)."""
        if world_size == 1:
            return self
        heads = self.num_kv_heads
        if heads >= world_size:
            per_rank = heads // world_size
            part = slice(rank * per_rank, (rank + 1) * per_rank)
        else:
            first = rank * heads // world_size
            part = slice(first, first + 1)
        return self._mapped(lambda weights: weights[:, part])

    def save(self, path: str | Path) -> None:
        torch.save({
            "format": FORMAT_VERSION,
            "key_weights": self.key_weights.float().contiguous(),
            "value_weights": self.value_weights.float().contiguous(),
            "position_weights": self.position_weights.float().contiguous(),
            "bias": self.bias.float().contiguous(),
            **{name: weights.float().contiguous() for name, weights in (
                ("key_square_weights", self.key_square_weights),
                ("value_square_weights", self.value_square_weights)) if weights is not None},
            "fingerprint": self.fingerprint,
            "num_tokens": self.num_tokens,
            "quality": {key: float(value) for key, value in self.quality.items()},
        }, path)



_HOW = "make one with: python -m kvcompress.profile_model MODEL"


def load_surrogate(path: str | Path, model_dir: str | Path | None = None) -> ScoreSurrogate:
    """The surrogate at ``path``; with ``model_dir``, checked to be that model's. Every
    error names ``--kv-surrogate`` and how to make one. A format 1 file loads (without
    squares); ``is_current`` says whether to remake it."""
    path = Path(path)
    if not path.is_file():
        raise SurrogateError(f"--kv-surrogate: no score surrogate at {path}; {_HOW}")
    try:
        data: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        surrogate = ScoreSurrogate(
            data["key_weights"], data["value_weights"], data["position_weights"], data["bias"],
            str(data["fingerprint"]), int(data["num_tokens"]),
            {str(key): float(value) for key, value in dict(data.get("quality", {})).items()},
            data.get("key_square_weights"), data.get("value_square_weights"))
    except Exception as error:
        raise SurrogateError(f"--kv-surrogate: {path} is not a score surrogate ({error}); "
                             f"{_HOW}") from error
    if data.get("format") not in READABLE_FORMATS:
        raise SurrogateError(f"--kv-surrogate: {path} has an unknown format (expected "
                             f"version {FORMAT_VERSION}); {_HOW}")
    layers, heads, dim = surrogate.key_weights.shape
    squares = [weights for weights in (surrogate.key_square_weights,
                                       surrogate.value_square_weights) if weights is not None]
    if (surrogate.value_weights.shape != (layers, heads, dim)
            or any(weights.shape != (layers, heads, dim) for weights in squares)
            or len(squares) == 1
            or surrogate.position_weights.shape != (layers, heads, NUM_POSITION_FEATURES)
            or surrogate.bias.shape != (layers, heads)
            or not all(math.isfinite(float(t.abs().max())) for t in (
                surrogate.key_weights, surrogate.value_weights, surrogate.position_weights,
                surrogate.bias, *squares))):
        raise SurrogateError(f"--kv-surrogate: {path} is malformed (shapes "
                             f"{tuple(surrogate.key_weights.shape)}, "
                             f"{tuple(surrogate.position_weights.shape)})")
    mismatch = other_model(surrogate.fingerprint, model_dir)
    if mismatch:
        raise SurrogateError(f"--kv-surrogate: {path} {mismatch}; {_HOW}")
    return surrogate


def quality_line(quality: dict[str, float]) -> str:
    """The held-out figures a person reads first: per kind of calibration text, rank
    correlation and top-quarter overlap (every figure for a file made before kinds)."""
    kinds = list(dict.fromkeys(key.rpartition(".")[0] for key in quality if "." in key))
    if not kinds:
        return ", ".join(f"{key} {value:.3f}" for key, value in quality.items())
    return "; ".join(f"{kind}: rank correlation {quality[f'{kind}.rank_correlation']:.2f}, "
                     f"top-quarter overlap {quality[f'{kind}.overlap_4x']:.2f}"
                     for kind in kinds)


def is_current(surrogate: ScoreSurrogate) -> bool:
    """Whether the surrogate has what this version fits (the squared terms)."""
    return surrogate.key_square_weights is not None


def check_surrogate_shape(surrogate: ScoreSurrogate, num_layers: int, num_kv_heads: int,
                          head_dim: int) -> None:
    """The surrogate covers this model's attention layers and (this rank's) KV heads."""
    if (surrogate.num_layers, surrogate.num_kv_heads, surrogate.head_dim) != (
            num_layers, num_kv_heads, head_dim):
        raise SurrogateError(
            f"--kv-surrogate: the surrogate has {surrogate.num_layers} layers x "
            f"{surrogate.num_kv_heads} KV heads x {surrogate.head_dim}, the model "
            f"{num_layers} x {num_kv_heads} x {head_dim}: it was made for another model")
