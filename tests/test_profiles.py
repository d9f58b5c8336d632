"""Query profiles (``--kv-scoring expected``): the profiling command on a tiny model, the
file format, and the refusals (missing, malformed, another model's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvcompress.profile_model.profiles import (
    PROFILE_FILE,
    ProfileError,
    QueryProfile,
    check_profile_shape,
    load_profile,
    model_fingerprint,
)


@pytest.fixture(scope="module")
def profiled_llama(profiled_tiny_llama) -> Path:
    """tiny_llama with its profile written beside it by the command (conftest)."""
    return Path(profiled_tiny_llama)


def test_the_command_writes_a_profile_beside_the_model(profiled_llama):
    """Shapes follow the model's config; covariances are symmetric positive semi-definite;
    the statistics come from real queries (not zeros); the fingerprint is the model's."""
    profile = load_profile(profiled_llama / PROFILE_FILE, profiled_llama)
    assert (profile.num_layers, profile.num_heads, profile.head_dim) == (4, 4, 32)
    assert profile.rotary_dim == 32 and profile.inv_freq.shape == (16,)
    assert profile.num_queries > 100
    assert profile.means.abs().sum() > 0
    torch.testing.assert_close(profile.covariances, profile.covariances.transpose(-1, -2))
    assert torch.linalg.eigvalsh(profile.covariances.double()).min() > -1e-4
    assert profile.attention_scale == pytest.approx(32**-0.5)
    assert profile.fingerprint == model_fingerprint(profiled_llama)
    check_profile_shape(profile, 4, 4, 32)
    with pytest.raises(ProfileError, match="another model"):
        check_profile_shape(profile, 30, 9, 64)


def test_another_models_profile_is_refused(profiled_llama, tiny_llama_kv4):
    """Same architecture, other weights: the fingerprint differs and loading names
    --kv-profile and the command that makes a profile."""
    with pytest.raises(ProfileError, match=r"--kv-profile: .* another model.*profile_model"):
        load_profile(profiled_llama / PROFILE_FILE, tiny_llama_kv4)


def test_fingerprint_follows_the_weights(profiled_llama, tmp_path):
    """A copy elsewhere keeps the fingerprint; changed weight bytes change it."""
    copy = tmp_path / "copy"
    shutil.copytree(profiled_llama, copy)
    assert model_fingerprint(copy) == model_fingerprint(profiled_llama)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy) != model_fingerprint(profiled_llama)


def test_missing_and_malformed_profiles_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="--kv-profile: no query profile"):
        load_profile(tmp_path / "absent.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a profile")
    with pytest.raises(ProfileError, match="is not a query profile"):
        load_profile(junk)
    bad = QueryProfile(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, 7), torch.zeros(4), 8, 1.0,
                       0.3, "x", 1)
    bad.save(tmp_path / "bad.pt")
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(tmp_path / "bad.pt")


def test_heads_of_a_rank():
    profile = QueryProfile(torch.arange(2 * 4 * 2.0).view(2, 4, 2), torch.zeros(2, 4, 2, 2),
                           torch.ones(1), 2, 1.0, 0.5, "x", 1)
    second = profile.heads_of_rank(1, 2)
    assert second.num_heads == 2
    torch.testing.assert_close(second.means, profile.means[:, 2:])


def test_the_engine_refuses_to_start_without_the_models_profile(profiled_llama,
                                                                tiny_llama_kv4):
    """Before any engine process: no profile beside the model, or another model's."""
    from vllm.engine.arg_utils import EngineArgs

    from kvcompress.engine.engine_args import prepare_engine_args

    expected = {"kv_compression": "pyramidkv", "kv_scoring": "expected"}
    with pytest.raises(ProfileError, match="--kv-profile: no query profile.*profile_model"):
        prepare_engine_args(EngineArgs(model=tiny_llama_kv4, additional_config=expected))
    other = dict(expected, kv_profile=str(profiled_llama / PROFILE_FILE))
    with pytest.raises(ProfileError, match="another model"):
        prepare_engine_args(EngineArgs(model=tiny_llama_kv4, additional_config=other))
    engine_args = EngineArgs(model=str(profiled_llama), additional_config=dict(expected))
    prepare_engine_args(engine_args)  # its own profile, found beside it
    assert engine_args.additional_config["kv_profile"] == str(profiled_llama / PROFILE_FILE)
