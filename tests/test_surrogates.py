"""Score surrogates (``--kv-scoring surrogate``, ``hybrid-surrogate``, ``auto``): the fit
against a reconstruction-pass teacher on a tiny model, the file format, the refusals
(missing, malformed, another model's) and how ``auto`` resolves at start."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvcompress.profile_model.surrogate_fit import (
    PromptSample,
    fit_surrogate,
    held_out_quality,
    predicted,
)
from kvcompress.profile_model.surrogates import (
    MIN_SCORE,
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
    from kvcompress.profile_model.profiles import model_fingerprint

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


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_gemma2",
                                        "tiny_gemma3", "tiny_gpt_oss", "tiny_mistral_sliding"])
def test_the_teacher_is_the_reconstruction_pass(model_name, request):
    """The teacher's score of a prompt key is the largest probability the pass's queries
    (repeat instruction + the prompt, chunk by chunk, each at the positions right after the
    prompt) pay it, over query heads of its KV head: checked against transformers' own eager
    attention over the prompt followed by one chunk, for every architecture the tests build
    (biases, q/k norms, soft-capped logits, sliding windows of 32 shorter than the prompt,
    attention sinks). The keys it records are the ones the model caches."""
    from transformers import AutoModelForCausalLM

    from kvcompress.profile_model import teacher
    from kvcompress.profile_model.surrogate_fit import sample_prompt

    folder = request.getfixturevalue(model_name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation=teacher.register()).eval()
    eager = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    group = config.num_attention_heads // kv_heads
    prompt, repeat = list(range(100, 170)), [7, 8, 9]
    sample = sample_prompt(model, prompt, repeat, chunk=25)  # three chunks
    assert sample.log_scores.shape == (layers, kv_heads, 70)
    best = torch.full((layers, kv_heads, 70), float("-inf"))
    with torch.inference_mode():
        for start in range(0, 70, 25):
            # The chunk right after the prompt: its positions and what it attends to are
            # the pass's, the model's own masks (windows included) laying them out.
            tokens = prompt + repeat + prompt[start : start + 25]
            output = eager(torch.tensor([tokens]), output_attentions=True,
                           **_causal_masks(model_name, len(tokens)))
            for layer, probabilities in enumerate(output.attentions):  # [1, Hq, T, T]
                paid = probabilities[0, :, 70:, :70].reshape(kv_heads, group, -1, 70)
                best[layer] = torch.maximum(best[layer], paid.amax(dim=(1, 2)).log())
        cache = eager(torch.tensor([prompt]), use_cache=True,
                      **_causal_masks(model_name, len(prompt))).past_key_values
    torch.testing.assert_close(sample.log_scores, best.clamp_min(math.log(MIN_SCORE)),
                               atol=1e-4, rtol=1e-4)
    for layer, cached in enumerate(cache.layers):
        if cached.keys.shape[2] == 70:  # a sliding layer's cache keeps only its window
            for recorded, kept in ((sample.keys, cached.keys), (sample.values, cached.values)):
                torch.testing.assert_close(recorded[layer], kept[0].transpose(0, 1),
                                           atol=1e-4, rtol=1e-4)


def test_a_model_whose_attention_bypasses_the_interface_is_refused(tiny_llama):
    """A model that runs its attention without transformers' attention interface (here:
    loaded with eager attention) leaves the teacher nothing to read: a clear error, not a
    fit on missing layers."""
    from transformers import AutoModelForCausalLM

    from kvcompress.profile_model.surrogate_fit import sample_prompt
    from kvcompress.profile_model.teacher import TeacherUnsupported

    eager = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with pytest.raises(TeacherUnsupported, match="ran 0 of its 4 attention layers"):
        sample_prompt(eager, list(range(100, 140)), [7, 8], chunk=16)


def _causal_masks(model_name: str, length: int) -> dict:
    """gpt-oss's forward builds a sliding-window mask even where no layer has a window, and
    fails without one in its config: given its masks, it builds none."""
    if model_name != "tiny_gpt_oss":
        return {}
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    return {"attention_mask": {"full_attention": causal, "sliding_attention": causal}}


def test_a_fit_under_the_floor_is_refused_with_its_figures(tiny_llama, tmp_path, capsys):
    """--min-overlap: a surrogate whose held-out top-quarter overlap is under the floor on
    any kind is not written; the command says so with every kind's figures and fails."""
    from kvcompress.profile_model.command import main as profile_main

    out = tmp_path / "surrogate.pt"
    assert profile_main([tiny_llama, "--out", str(tmp_path / "profile.pt"), "--surrogate-out",
                         str(out), "--documents", "1", "--surrogate-prompts", "1",
                         "--held-out", "1", "--min-overlap", "1", "--device", "cpu"]) == 1
    assert not out.exists()
    error = capsys.readouterr().err
    assert "under the floor 1.00" in error and "--min-overlap" in error
    assert all(f"{kind}: rank correlation" in error
               for kind in ("synthetic", "prose", "code", "chat"))


def test_calibration_prompts_of_every_kind_hold_out_other_files(embedded_model):
    """Each kind gives chat prompts through the model's template; the natural kinds draw
    held-out prompts from standard-library files the fitting prompts never use."""
    import random

    from transformers import AutoTokenizer

    from kvcompress.profile_model.calibration import KINDS, calibration_prompt
    from kvcompress.profile_model.corpus import source_files

    fitting, held = source_files(held_out=False), source_files(held_out=True)
    assert len(fitting) > 20 and len(held) > 5
    assert not {file.name for file in fitting} & {file.name for file in held}
    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    for kind in KINDS:
        prompts = [calibration_prompt(tokenizer, kind, random.Random(number), held_out=False)
                   for number in range(3)]
        assert all(prompt.startswith("<|im_start|>") for prompt in prompts)
        assert len(set(prompts)) == 3
    chat = calibration_prompt(tokenizer, "chat", random.Random(0), held_out=True)
    assert chat.count("<|im_start|>assistant") >= 2  # a transcript, then the open turn


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
    assert "held out: synthetic: rank correlation" in caplog.text  # said at every start
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


def test_a_model_named_by_its_hub_id_uses_the_surrogate_its_command_made(local_hub):
    """Issue 52: ``profile_model <hub id>`` finds the model in the local Hugging Face cache
    (no network), writes its surrogate into the user's kvcompress cache under the model's
    fingerprint (not into the hub cache), and an engine started with that hub id resolves
    auto to it; with no surrogate the error names the places looked at and the command."""
    from vllm.engine.arg_utils import EngineArgs

    from kvcompress.engine.engine_args import prepare_engine_args
    from kvcompress.profile_model import store as model_store
    from kvcompress.profile_model.command import main as profile_main
    from kvcompress.profile_model.profiles import model_fingerprint

    _, repo_snapshot, cache = local_hub
    snapshot = model_store.model_folder("tiny-org/tiny-llama")
    assert snapshot == repo_snapshot

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
