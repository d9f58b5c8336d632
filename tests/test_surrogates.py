"""Score surrogates (``--kv-scoring surrogate``, ``hybrid-surrogate``, ``auto``): the fit
against a reconstruction-pass teacher on a tiny model, the file format, the refusals
(missing, malformed, another model's) and how ``auto`` resolves at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcompress.surrogate_fit import PromptSample, fit_surrogate, held_out_quality, predicted
from kvcompress.surrogates import (
    NUM_POSITION_FEATURES,
    SURROGATE_FILE,
    ScoreSurrogate,
    SurrogateError,
    check_surrogate_shape,
    load_surrogate,
    position_features,
)


@pytest.fixture(scope="module")
def fitted_llama(surrogate_tiny_llama) -> Path:
    """A copy of tiny_llama with its surrogate written beside it by the command (conftest)."""
    return Path(surrogate_tiny_llama)


def test_the_command_writes_a_surrogate_beside_the_model(fitted_llama):
    """Shapes follow the model (4 layers, 2 KV heads of 32); the fit moved the weights; the
    held-out figures are recorded; the fingerprint is the model's."""
    from kvcompress.profiles import model_fingerprint

    surrogate = load_surrogate(fitted_llama / SURROGATE_FILE, fitted_llama)
    assert (surrogate.num_layers, surrogate.num_kv_heads, surrogate.head_dim) == (4, 2, 32)
    assert surrogate.position_weights.shape == (4, 2, NUM_POSITION_FEATURES)
    assert surrogate.key_weights.abs().sum() > 0 and surrogate.num_tokens > 100
    assert -1 <= surrogate.quality["rank_correlation"] <= 1
    assert set(surrogate.quality) >= {"overlap_2x", "overlap_4x", "overlap_8x",
                                      "model_overlap_8x"}
    assert surrogate.fingerprint == model_fingerprint(fitted_llama)
    check_surrogate_shape(surrogate, 4, 2, 32)
    with pytest.raises(SurrogateError, match="another model"):
        check_surrogate_shape(surrogate, 30, 3, 64)


def test_the_fit_recovers_a_linear_teacher():
    """Where the teacher's log scores are a linear map of the inputs, ridge regression finds
    it (held-out rank correlation ~1), and ``predicted`` applies it as the engine does."""
    generator = torch.Generator().manual_seed(0)
    layers, heads, dim = 2, 2, 8
    truth = ScoreSurrogate(torch.randn(layers, heads, dim, generator=generator),
                           torch.randn(layers, heads, dim, generator=generator),
                           torch.randn(layers, heads, NUM_POSITION_FEATURES, generator=generator),
                           torch.randn(layers, heads, generator=generator), "x", 0)

    def sample(length: int) -> PromptSample:
        keys, values = torch.randn(2, layers, length, heads, dim, generator=generator)
        placeholder = PromptSample(keys, values, torch.zeros(layers, heads, length))
        placeholder.log_scores = predicted(truth, placeholder)
        return placeholder

    fitted = fit_surrogate([sample(300) for _ in range(4)], "x", ridge=1e-9)
    quality = held_out_quality(fitted, [sample(200)])
    assert quality["rank_correlation"] > 0.999 and quality["overlap_8x"] > 0.95
    torch.testing.assert_close(fitted.key_weights, truth.key_weights, atol=1e-3, rtol=1e-3)


def test_the_teacher_is_the_reconstruction_pass(tiny_llama):
    """The teacher's score of a prompt key is the largest probability the pass's queries
    (repeat instruction + the prompt) pay it, over query heads of its KV head: checked
    against attention recomputed by hand from the model's own cached K/V."""
    from transformers import AutoModelForCausalLM

    from kvcompress.surrogate_fit import sample_prompt

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompt, repeat = list(range(100, 160)), [7, 8, 9]
    sample = sample_prompt(model, prompt, repeat, chunk=25)  # three chunks
    assert sample.log_scores.shape == (4, 2, 60) and sample.keys.shape == (4, 60, 2, 32)
    with torch.inference_mode():
        full = model(torch.tensor([prompt + repeat + prompt[25:50]]), output_attentions=True)
    # Chunk 2's pass (instruction + chunk) alone, as one forward: its queries'
    # probabilities over the prompt bound the teacher from below, and equal it where that
    # pass pays a key most.
    probabilities = full.attentions[2][0, :, 60:, :60].reshape(2, 2, -1, 60).amax(dim=(1, 2))
    assert (sample.log_scores[2].exp() >= probabilities - 1e-5).all()
    assert ((sample.log_scores[2].exp() - probabilities).abs() < 1e-5).any()


def test_another_models_surrogate_is_refused(fitted_llama, tiny_llama_kv4):
    with pytest.raises(SurrogateError,
                       match=r"--kv-surrogate: .* another model.*profile_model"):
        load_surrogate(fitted_llama / SURROGATE_FILE, tiny_llama_kv4)


def test_missing_and_malformed_surrogates_are_refused(tmp_path):
    with pytest.raises(SurrogateError, match="--kv-surrogate: no score surrogate"):
        load_surrogate(tmp_path / "absent.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a surrogate")
    with pytest.raises(SurrogateError, match="is not a score surrogate"):
        load_surrogate(junk)
    bad = ScoreSurrogate(torch.zeros(2, 2, 8), torch.zeros(2, 2, 7), torch.zeros(2, 2, 4),
                         torch.zeros(2, 2), "x", 1)
    bad.save(tmp_path / "bad.pt")
    with pytest.raises(SurrogateError, match="malformed"):
        load_surrogate(tmp_path / "bad.pt")
    nan = ScoreSurrogate(torch.full((2, 2, 8), float("nan")), torch.zeros(2, 2, 8),
                         torch.zeros(2, 2, 4), torch.zeros(2, 2), "x", 1)
    nan.save(tmp_path / "nan.pt")
    with pytest.raises(SurrogateError, match="malformed"):
        load_surrogate(tmp_path / "nan.pt")


def test_kv_heads_of_a_rank():
    surrogate = ScoreSurrogate(torch.arange(2 * 4 * 2.0).view(2, 4, 2), torch.zeros(2, 4, 2),
                               torch.zeros(2, 4, 4), torch.zeros(2, 4), "x", 1)
    second = surrogate.heads_of_rank(1, 2)
    assert second.num_kv_heads == 2
    torch.testing.assert_close(second.key_weights, surrogate.key_weights[:, 2:])
    # more ranks than KV heads: each rank holds the head it replicates
    assert surrogate.heads_of_rank(5, 8).key_weights.tolist() == \
        surrogate.key_weights[:, 2:3].tolist()


def test_position_features():
    places = position_features(torch.tensor([0, 1, 3, 4, 9]), 10)
    assert places[:, 1].tolist() == [1, 0, 0, 0, 0] and places[:, 2].tolist() == [1, 1, 1, 0, 0]
    torch.testing.assert_close(places[:, 3], torch.log1p(torch.tensor([9.0, 8, 6, 5, 0])))


def test_the_engine_resolves_auto_and_refuses_a_wrong_surrogate(fitted_llama, tiny_llama_kv4,
                                                                 caplog):
    """Before any engine process: auto is the surrogate with the model's surrogate and
    reuse on, else the window; an explicit surrogate scoring refuses a missing one or
    another model's."""
    from vllm.engine.arg_utils import EngineArgs

    from kvcompress.engine.engine_args import prepare_engine_args

    def started(model, **settings) -> dict:
        engine_args = EngineArgs(model=str(model), additional_config={
            "kv_compression": "pyramidkv", **settings})
        prepare_engine_args(engine_args)
        return engine_args.additional_config

    from kvcompress.settings import resolution

    with caplog.at_level("INFO", logger=resolution.logger.name):
        resolved = started(fitted_llama)
    assert resolved["kv_scoring"] == "surrogate"
    assert "held out: rank_correlation" in caplog.text  # what it predicts, said at start
    assert resolved["kv_surrogate"] == str(fitted_llama / SURROGATE_FILE)
    assert started(fitted_llama, kv_reuse="off")["kv_scoring"] == "window"
    assert started(tiny_llama_kv4)["kv_scoring"] == "window"  # no surrogate: logged
    with pytest.raises(SurrogateError, match="--kv-surrogate: no score surrogate"):
        started(tiny_llama_kv4, kv_scoring="surrogate")
    with pytest.raises(SurrogateError, match="another model"):
        started(tiny_llama_kv4, kv_scoring="surrogate",
                kv_surrogate=str(fitted_llama / SURROGATE_FILE))
    with pytest.raises(SurrogateError, match="another model"):  # auto does not guess either
        started(tiny_llama_kv4, kv_surrogate=str(fitted_llama / SURROGATE_FILE))


def test_a_model_named_by_its_hub_id_uses_the_surrogate_its_command_made(tiny_llama, tmp_path,
                                                                         monkeypatch):
    """Issue 52: ``profile_model <hub id>`` finds the model in the local Hugging Face cache
    (no network), writes its surrogate into the user's kvcompress cache under the model's
    fingerprint (not into the hub cache), and an engine started with that hub id resolves
    auto to it; with no surrogate the error names the places looked at and the command."""
    import shutil

    from vllm.engine.arg_utils import EngineArgs

    from kvcompress import model_store
    from kvcompress.engine.engine_args import prepare_engine_args
    from kvcompress.profile_model import main as profile_main
    from kvcompress.profiles import model_fingerprint

    hub, cache = tmp_path / "hub", tmp_path / "cache"
    repo = hub / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_llama, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(model_store.CACHE_ENV, str(cache))
    snapshot = model_store.model_folder("tiny-org/tiny-llama")
    assert snapshot == repo / "snapshots" / "0123abc"

    def started(**settings) -> dict:
        engine_args = EngineArgs(model="tiny-org/tiny-llama", additional_config={
            "kv_compression": "pyramidkv", **settings})
        prepare_engine_args(engine_args)
        return engine_args.additional_config

    assert started()["kv_scoring"] == "window"  # none made yet: logged, the window
    with pytest.raises(SurrogateError, match=r"looked at .*cache.*; make one with: python -m "
                                             r"kvcompress.profile_model tiny-org/tiny-llama"):
        started(kv_scoring="surrogate")
    assert profile_main(["tiny-org/tiny-llama", "--documents", "1", "--surrogate-documents",
                         "4", "--held-out", "1", "--device", "cpu"]) == 0
    made = cache / "surrogates" / f"{model_fingerprint(snapshot)}.pt"
    assert made.is_file() and (cache / "profiles").is_dir()
    assert not (snapshot / SURROGATE_FILE).exists()  # the hub's snapshot is left as it was
    resolved = started()
    assert (resolved["kv_scoring"], resolved["kv_surrogate"]) == ("surrogate", str(made))
