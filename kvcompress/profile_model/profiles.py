"""Query profiles: what a model's queries look like when they look back at a context,
measured once per model (``python -m kvcompress.profile_model``) and read by
``--kv-scoring expected``.

A profile holds, for every attention layer and query head, the mean and covariance of the
queries before rotary embedding, gathered at positions after a context (questions about it,
answers, a reconstruction of it), plus the rotary frequencies the model applies. With them
a prompt's keys are scored by the attention an average *future* query is expected to pay
them (``kvcompress.attention.expected_scores``): no extra pass, no dependence on the
question of the moment.

The file sits beside the model (``kvcompress_profile.pt``) and names the model it was made
for (a fingerprint of its config and weight files); loading it for another model fails.
No vLLM imports.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PROFILE_FILE = "kvcompress_profile.pt"
FORMAT_VERSION = 1
# Bytes read from each end of every weight file for the fingerprint: enough to tell two
# checkpoints apart (fine-tunes change every tensor), cheap for a 100 GB model.
_EDGE_BYTES = 1 << 20
# Config keys that describe the run, not the model.
_VOLATILE_KEYS = {"_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                  "torch_dtype", "use_cache"}


class ProfileError(ValueError):
    """A profile that is missing, malformed or made for another model."""


@dataclass
class QueryProfile:
    """Per layer ``l`` and query head ``h``: ``means[l, h]`` ``[D]`` and ``covariances[l, h]``
    ``[D, D]`` of the pre-rotary queries (fp32); ``inv_freq`` ``[R / 2]`` the rotary
    frequencies over the first ``rotary_dim`` dimensions (neox layout: dimension ``i`` pairs
    with ``i + R/2``), ``rotary_scaling`` their cos/sin factor. ``fingerprint``: the model's."""

    means: torch.Tensor
    covariances: torch.Tensor
    inv_freq: torch.Tensor
    rotary_dim: int
    rotary_scaling: float
    attention_scale: float  # the model's softmax scale (1/sqrt(D) for most)
    fingerprint: str
    num_queries: int  # query vectors each statistic averages

    @property
    def num_layers(self) -> int:
        return self.means.shape[0]

    @property
    def num_heads(self) -> int:
        return self.means.shape[1]

    @property
    def head_dim(self) -> int:
        return self.means.shape[2]

    def save(self, path: str | Path) -> None:
        torch.save({
            "format": FORMAT_VERSION,
            "means": self.means.float().contiguous(),
            "covariances": self.covariances.float().contiguous(),
            "inv_freq": self.inv_freq.float().contiguous(),
            "rotary_dim": self.rotary_dim,
            "rotary_scaling": self.rotary_scaling,
            "attention_scale": self.attention_scale,
            "fingerprint": self.fingerprint,
            "num_queries": self.num_queries,
        }, path)

    def heads_of_rank(self, rank: int, world_size: int) -> QueryProfile:
        """The query heads one tensor-parallel rank holds (heads are split evenly)."""
        if world_size == 1:
            return self
        per_rank = self.num_heads // world_size
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        return QueryProfile(self.means[:, part], self.covariances[:, part], self.inv_freq,
                            self.rotary_dim, self.rotary_scaling, self.attention_scale,
                            self.fingerprint, self.num_queries)


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest of the model's config (run-specific keys left out) and of its weight files
    (size and both ends of each): the same checkpoint gives the same fingerprint wherever
    it is copied."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ProfileError(f"{model_dir} has no config.json: not a model folder")
    config = json.loads(config_path.read_text())
    stable = {key: value for key, value in config.items() if key not in _VOLATILE_KEYS}
    digest.update(json.dumps(stable, sort_keys=True).encode())
    weights = sorted(list(model_dir.glob("*.safetensors")) + list(model_dir.glob("*.bin")))
    for weight in weights:
        size = weight.stat().st_size
        digest.update(f"{weight.name}:{size}".encode())
        with weight.open("rb") as handle:
            digest.update(handle.read(_EDGE_BYTES))
            handle.seek(max(0, size - _EDGE_BYTES))
            digest.update(handle.read(_EDGE_BYTES))
    return digest.hexdigest()[:32]



def load_profile(path: str | Path, model_dir: str | Path | None = None) -> QueryProfile:
    """The profile at ``path``; with ``model_dir``, checked to be that model's. Every
    error names ``--kv-profile`` and how to make a profile."""
    path = Path(path)
    how = "make one with: python -m kvcompress.profile_model MODEL"
    if not path.is_file():
        raise ProfileError(f"--kv-profile: no query profile at {path}; {how}")
    try:
        data: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        profile = QueryProfile(data["means"], data["covariances"], data["inv_freq"],
                               int(data["rotary_dim"]), float(data["rotary_scaling"]),
                               float(data["attention_scale"]), str(data["fingerprint"]),
                               int(data["num_queries"]))
    except Exception as error:
        raise ProfileError(f"--kv-profile: {path} is not a query profile ({error}); {how}") \
            from error
    if data.get("format") != FORMAT_VERSION:
        raise ProfileError(f"--kv-profile: {path} has an unknown format "
                           f"(expected version {FORMAT_VERSION}); {how}")
    layers, heads, dim = profile.means.shape
    if (profile.covariances.shape != (layers, heads, dim, dim)
            or profile.inv_freq.shape != (profile.rotary_dim // 2,)
            or profile.rotary_dim > dim or profile.rotary_dim % 2):
        raise ProfileError(f"--kv-profile: {path} is malformed (shapes {tuple(profile.means.shape)}"
                           f", {tuple(profile.covariances.shape)}, rotary {profile.rotary_dim})")
    mismatch = other_model(profile.fingerprint, model_dir)
    if mismatch:
        raise ProfileError(f"--kv-profile: {path} {mismatch}; {how}")
    return profile


def other_model(fingerprint: str, model_dir: str | Path | None) -> str | None:
    """Why a file made for the model of ``fingerprint`` is not ``model_dir``'s (None: it is,
    or there is no model folder to compare with)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    expected = model_fingerprint(model_dir)
    if fingerprint == expected:
        return None
    return (f"was made for another model (fingerprint {fingerprint}, {model_dir} has "
            f"{expected})")


def check_profile_shape(profile: QueryProfile, num_layers: int, num_heads: int,
                        head_dim: int) -> None:
    """The profile covers this model's attention layers and query heads."""
    if (profile.num_layers, profile.num_heads, profile.head_dim) != (num_layers, num_heads,
                                                                    head_dim):
        raise ProfileError(
            f"--kv-profile: the profile has {profile.num_layers} layers x {profile.num_heads} "
            f"query heads x {profile.head_dim}, the model {num_layers} x {num_heads} x "
            f"{head_dim}: it was made for another model")
