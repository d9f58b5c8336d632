"""Configuration specs (parsing, labels, additional_config) and --kv-option parsing."""

from __future__ import annotations

import pytest

from benchmarks.specs import CompressionSpec, parse_kv_options, parse_specs
from kvcompress.policies import METHODS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vanilla", CompressionSpec()),
        ("none", CompressionSpec()),
        ("pyramidkv:128", CompressionSpec("pyramidkv", budget=128)),
        ("snapkv:budget=64", CompressionSpec("snapkv", budget=64)),
        ("AdaKV:r=0.875", CompressionSpec("adakv", ratio=0.875)),
        ("pyramidkv:256@h2o:64", CompressionSpec("pyramidkv", 256, None, "h2o", 64)),
        ("snapkv:r=0.5@window:32", CompressionSpec("snapkv", None, 0.5, "window", 32)),
        ("pyramidkv:64+pyramid_beta=4+kv_pooling=avg",
         CompressionSpec("pyramidkv", 64, options=(("kv_pyramid_beta", 4),
                                                   ("kv_pooling", "avg")))),
        ("adakv:64@h2o:32+adakv_floor=0.8",
         CompressionSpec("adakv", 64, None, "h2o", 32, (("kv_adakv_floor", 0.8),))),
        ("pyramidkv+score_threshold=-6",
         CompressionSpec("pyramidkv", options=(("kv_score_threshold", -6),))),
        ("snapkv:r=0.75+kv_score_threshold=-6.5",
         CompressionSpec("snapkv", ratio=0.75, options=(("kv_score_threshold", -6.5),))),
    ],
)
def test_spec_parse(text, expected):
    assert CompressionSpec.parse(text) == expected


@pytest.mark.parametrize("text", ["h2o:128", "snapkv", "snapkv:r=1.5", "snapkv:0", "snapkv:x=3",
                                  "snapkv:64@h2o", "snapkv:64@h2o:x", "vanilla@h2o:64",
                                  "snapkv:64@h2o:0", "vanilla+window=4", "snapkv:64+window",
                                  "snapkv:64+budget=3", "snapkv:64+page_sise=8"])
def test_spec_parse_rejects(text):  # "snapkv": an amount or a score threshold
    with pytest.raises(ValueError):
        CompressionSpec.parse(text)


def test_spec_accepts_every_policy_method():
    assert [CompressionSpec(m, budget=64).method for m in METHODS] == list(METHODS)


def test_spec_labels_and_additional_config():
    ratio = CompressionSpec("pyramidkv", ratio=0.875)
    assert ratio.label == "pyramidkv:r=0.875"
    assert ratio.compression_factor == pytest.approx(8.0)
    assert ratio.additional_config({"kv_window": 16}) == {
        "kv_compression": "pyramidkv", "kv_window": 16, "kv_compression_ratio": 0.875}
    budget = CompressionSpec("snapkv", budget=64)
    assert budget.additional_config() == {"kv_compression": "snapkv", "kv_budget": 64}
    assert budget.compression_factor is None
    assert CompressionSpec().additional_config({"kv_window": 16}) == {}
    assert CompressionSpec().label == "vanilla"
    decode = CompressionSpec("pyramidkv", budget=256, decode_policy="h2o", decode_budget=64)
    assert decode.label == "pyramidkv:256@h2o:64"
    assert CompressionSpec.parse(decode.label) == decode
    assert decode.additional_config() == {
        "kv_compression": "pyramidkv", "kv_budget": 256, "kv_decode_policy": "h2o",
        "kv_decode_budget": 64}


def test_spec_settings_label_round_trip_and_override_the_run_options():
    spec = CompressionSpec.parse("pyramidkv:64+pyramid_beta=4+gqa_reduce=max")
    assert spec.label == "pyramidkv:64+pyramid_beta=4+gqa_reduce=max"
    assert CompressionSpec.parse(spec.label) == spec
    assert spec.additional_config({"kv_pyramid_beta": 20, "kv_window": 16}) == {
        "kv_compression": "pyramidkv", "kv_pyramid_beta": 4, "kv_window": 16,
        "kv_gqa_reduce": "max", "kv_budget": 64}
    # worker jobs receive the spec through JSON, which turns the pairs into lists
    assert CompressionSpec(**{**vars(spec), "options": [list(p) for p in spec.options]}) == spec


def test_parse_specs_rejects_duplicates():
    assert [s.label for s in parse_specs("vanilla, snapkv:64")] == ["vanilla", "snapkv:64"]
    with pytest.raises(ValueError, match="duplicate"):
        parse_specs("snapkv:64,snapkv:budget=64")


def test_parse_kv_options():
    assert parse_kv_options(["kv_window=16", "kv_pooling=avg", "kv_pyramid_beta=2.5"]) == {
        "kv_window": 16, "kv_pooling": "avg", "kv_pyramid_beta": 2.5}
    for bad in ("kv_windw=16", "window=16", "kv_budget=64", "kv_window"):
        with pytest.raises(SystemExit, match="--kv-option"):
            parse_kv_options([bad])


def test_spec_cache_dtype():
    fp8 = CompressionSpec.parse("pyramidkv:r=0.875+scoring=window+cache_dtype=fp8")
    assert (fp8.cache_dtype, fp8.options) == ("fp8", (("kv_scoring", "window"),))
    assert fp8.label == "pyramidkv:r=0.875+scoring=window+cache_dtype=fp8"
    assert CompressionSpec.parse(fp8.label) == fp8
    assert "kv_cache_dtype" not in fp8.additional_config()  # an engine argument, not ours
    vanilla = CompressionSpec.parse("vanilla+kv_cache_dtype=fp8_e5m2")
    assert (vanilla.is_vanilla, vanilla.label) == (True, "vanilla+cache_dtype=fp8_e5m2")
    assert (vanilla.kv_element_bytes("bfloat16"), CompressionSpec().kv_element_bytes("float32")
            ) == (1, 4)
    with pytest.raises(ValueError, match="cache_dtype"):
        CompressionSpec.parse("vanilla+cache_dtype=int8")


def test_a_threshold_spec_needs_no_amount_and_its_kept_fraction_is_measured():
    from benchmarks.quality.scoring import collect_rows

    spec = CompressionSpec.parse("pyramidkv+score_threshold=-6+scoring=reconstruct")
    assert spec.thresholded and spec.label == "pyramidkv+score_threshold=-6+scoring=reconstruct"
    assert CompressionSpec.parse(spec.label) == spec
    assert spec.additional_config() == {"kv_compression": "pyramidkv",
                                        "kv_score_threshold": -6, "kv_scoring": "reconstruct"}
    with pytest.raises(ValueError, match="score_threshold"):
        CompressionSpec("pyramidkv", options=(("kv_scoring", "window"),))
    outcome = type("Outcome", (), {"error": None, "seconds": 1.0, "result": {
        "outputs": [], "generate_s": 1.0, "measured_kept_fraction": 0.21}})()
    budget = CompressionSpec("pyramidkv", budget=100)
    rows = collect_rows([], [spec, budget], {spec.label: outcome, budget.label: outcome},
                        [400])
    assert rows[0]["kept_fraction"] == 0.21  # measured: data-dependent
    assert rows[1]["kept_fraction"] == 0.25 and rows[1]["measured_kept_fraction"] == 0.21
