"""Compression settings: parsing, defaults, and every promised validation error."""

import pytest

from kvcompress.policies import COMPRESSION_METHODS, METHODS, PolicySettings
from kvcompress.settings.config import KVCompressionConfig, KVCompressionConfigError
from kvcompress.settings.flags import DEFAULT_BUDGET, DEFAULT_MIN_PROMPT, FLAG_SPECS


def test_none_is_default_and_disabled():
    config = KVCompressionConfig.from_mapping({})
    assert config.method == "none" and not config.enabled
    assert config.budget is None and config.ratio is None


def test_method_without_amount_uses_documented_default_budget():
    config = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv"})
    assert config.enabled and config.budget == DEFAULT_BUDGET and config.ratio is None


def test_round_trip_through_mapping_keeps_every_field():
    given = {
        "kv_compression": "adakv", "kv_compression_ratio": 0.75, "kv_window": 16,
        "kv_pyramid_beta": 10, "kv_pooling": "avg", "kv_pooling_kernel": 5,
        "kv_sink_tokens": 2, "kv_page_size": 32,
    }
    config = KVCompressionConfig.from_mapping(given)
    assert KVCompressionConfig.from_mapping(config.to_mapping()) == config
    assert config.ratio == 0.75 and config.window == 16 and config.page_size == 32


def test_other_plugins_keys_are_ignored_but_unknown_kv_keys_are_not():
    KVCompressionConfig.from_mapping({"some_other_plugin": 1})
    with pytest.raises(KVCompressionConfigError, match="kv_bugdet"):
        KVCompressionConfig.from_mapping({"kv_bugdet": 64})


@pytest.mark.parametrize(
    ("settings", "flag", "allowed"),
    [
        ({"kv_compression": "h2o_typo"}, "--kv-compression", "pyramidkv"),
        ({"kv_compression": "snapkv", "kv_budget": 0}, "--kv-budget", ">= 1"),
        ({"kv_compression": "snapkv", "kv_budget": -5}, "--kv-budget", ">= 1"),
        ({"kv_compression": "snapkv", "kv_budget": 64, "kv_window": 65}, "--kv-window",
         "window <= budget"),
        ({"kv_compression": "snapkv", "kv_compression_ratio": 0.0}, "--kv-compression-ratio",
         "0 < R < 1"),
        ({"kv_compression": "snapkv", "kv_compression_ratio": 1.0}, "--kv-compression-ratio",
         "0 < R < 1"),
        ({"kv_compression": "snapkv", "kv_page_size": 24}, "--kv-page-size", "power of two"),
        ({"kv_compression": "snapkv", "kv_page_size": 512}, "--kv-page-size", "power of two"),
        ({"kv_compression": "snapkv", "kv_reuse": "maybe"}, "--kv-reuse", "on, prompts, off"),
        ({"kv_compression": "snapkv", "kv_pooling": "median"}, "--kv-pooling", "max"),
        ({"kv_compression": "snapkv", "kv_budget_sharing": "head"}, "--kv-budget-sharing",
         "auto, layer, model"),
        ({"kv_compression": "streamingllm", "kv_budget_sharing": "model"},
         "--kv-budget-sharing", "auto, layer"),
        ({"kv_compression": "snapkv", "kv_pooling_kernel": 4}, "--kv-pooling-kernel", "odd"),
        ({"kv_compression": "snapkv", "kv_pyramid_beta": 0.5}, "--kv-pyramid-beta", ">= 1"),
        ({"kv_compression": "snapkv", "kv_sink_tokens": -1}, "--kv-sink-tokens", ">= 0"),
        ({"kv_compression": "snapkv", "kv_sharing_wait": 0}, "--kv-sharing-wait", ">= 1"),
        ({"kv_compression": "snapkv", "kv_window": 0}, "--kv-window", ">= 1"),
        ({"kv_compression": "snapkv", "kv_budget": "lots"}, "--kv-budget", "integer"),
        ({"kv_compression": "snapkv", "kv_decode_budget": 0}, "--kv-decode-budget", ">= 1"),
        ({"kv_compression": "snapkv", "kv_decode_budget": 64, "kv_decode_interval": 0},
         "--kv-decode-interval", ">= 1"),
        ({"kv_compression": "snapkv", "kv_decode_policy": "lru", "kv_decode_budget": 64},
         "--kv-decode-policy", "window, h2o, snapkv"),
        ({"kv_compression": "snapkv", "kv_decode_policy": "h2o"}, "--kv-decode-policy",
         "--kv-decode-budget"),
        ({"kv_compression": "snapkv", "kv_decode_policy": "snapkv", "kv_decode_budget": 8},
         "--kv-decode-budget", "> --kv-window"),
        ({"kv_compression": "snapkv", "kv_score_threshold": 0}, "--kv-score-threshold",
         "a finite number < 0"),
        ({"kv_compression": "snapkv", "kv_score_threshold": 6}, "--kv-score-threshold",
         "a finite number < 0"),
        ({"kv_compression": "snapkv", "kv_score_threshold": "nan"}, "--kv-score-threshold",
         "a finite number < 0"),
        ({"kv_compression": "snapkv", "kv_score_threshold": "low"}, "--kv-score-threshold",
         "a number"),
        ({"kv_compression": "streamingllm", "kv_score_threshold": -6},
         "--kv-score-threshold", "allowed with: pyramidkv, snapkv, adakv"),
    ],
)
def test_invalid_values_name_the_flag_and_the_allowed_values(settings, flag, allowed):
    with pytest.raises(KVCompressionConfigError) as error:
        KVCompressionConfig.from_mapping(settings)
    assert flag in str(error.value)
    assert allowed in str(error.value)


def test_budget_and_ratio_together_are_refused():
    with pytest.raises(KVCompressionConfigError, match="exclusive"):
        KVCompressionConfig.from_mapping(
            {"kv_compression": "pyramidkv", "kv_budget": 64, "kv_compression_ratio": 0.5}
        )


def test_policy_settings_carry_the_config_and_share_its_defaults():
    config = KVCompressionConfig.from_mapping({
        "kv_compression": "adakv", "kv_compression_ratio": 0.5, "kv_window": 16,
        "kv_pyramid_beta": 5, "kv_pooling": "avg", "kv_pooling_kernel": 3, "kv_sink_tokens": 2,
    })
    assert config.policy == PolicySettings(
        "adakv", ratio=0.5, window=16, beta=5.0, pooling="avg", pooling_kernel=3, sink_tokens=2,
        budget_sharing="layer",  # auto unresolved: window scores keep the method's split
    )
    assert config.policy is config.policy  # built once per config
    snap = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_reuse": "off"})
    assert snap.policy == PolicySettings("snapkv", budget=DEFAULT_BUDGET)
    with pytest.raises(ValueError, match="'none'"):
        _ = KVCompressionConfig().policy


def test_method_choices_and_help_come_from_the_registry():
    spec = next(spec for spec in FLAG_SPECS if spec.key == "kv_compression")
    assert spec.choices == ("none", *METHODS)
    for method in COMPRESSION_METHODS:
        assert f"'{method.name}' {method.summary}" in spec.help


def test_every_flag_has_help_and_maps_to_a_snake_case_key():
    for spec in FLAG_SPECS:
        assert spec.help
        assert spec.flag == "--" + spec.key.replace("_", "-")


ENGINE = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_budget": 128})


def test_request_overrides_replace_the_amount_and_keep_the_rest():
    assert ENGINE.with_request_overrides(None) is ENGINE
    assert ENGINE.with_request_overrides({"temperature_hint": 1}) is ENGINE
    ratio = ENGINE.with_request_overrides({"kv_compression_ratio": 0.5})
    assert ratio.ratio == 0.5 and ratio.budget is None and ratio.method == "pyramidkv"
    snap = ENGINE.with_request_overrides({"kv_compression": "snapkv"})
    assert snap.method == "snapkv" and snap.budget == 128
    assert not ENGINE.with_request_overrides({"kv_compression": "none"}).enabled


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_budget": 4}, "'kv_window'"),  # engine window 8 > request budget 4
        ({"kv_page_size": 32}, "whole engine"),
        ({"kv_reuse": "off"}, "whole engine"),
        ({"kv_budget": 64, "kv_compression_ratio": 0.5}, "exclusive"),
        ({"kv_sink_tokens": -2}, "'kv_sink_tokens'"),
        ({"kv_buget": 10}, "kv_buget"),
        ({"kv_decode_policy": "snapkv"}, "'kv_decode_policy'.*--kv-decode-budget"),
        ({"kv_decode_policy": "h2o", "kv_decode_budget": 16, "kv_window": 16},
         "'kv_decode_budget'"),
        ({"kv_decode_window": 64}, "kv_decode_window"),  # the flag it replaced
        ({"kv_decode_score_every": 0}, r"'kv_decode_score_every'.*>= 1"),
        ({"kv_adakv_floor": 1.2}, r"'kv_adakv_floor'.*\[0, 1\]"),
        ({"kv_adakv_floor": "high"}, "'kv_adakv_floor'"),
        ({"kv_adakv_totals": "linear"}, "'kv_adakv_totals'.*pyramid, uniform"),
        ({"kv_gqa_reduce": "sum"}, "'kv_gqa_reduce'.*mean, max"),
        ({"kv_score_threshold": 0.5}, "'kv_score_threshold'.*finite number < 0"),
        ({"kv_score_threshold": -6, "kv_compression": "streamingllm"},
         "'kv_score_threshold'.*allowed with"),
    ],
)
def test_bad_request_overrides_name_the_field(overrides, message):
    with pytest.raises(KVCompressionConfigError, match=message):
        ENGINE.with_request_overrides(overrides)


def test_decode_eviction_is_off_by_default_and_resolved_per_request():
    assert ENGINE.decode_eviction is None
    assert "decode=" not in ENGINE.describe()
    # a scored policy fits the decode-score reserve of a server with a decode budget and a
    # scoring decode policy; the window policy reserves none
    budgeted = ENGINE.with_request_overrides({"kv_decode_budget": 64})
    assert budgeted.decode_score_capacity == 0
    scoring = KVCompressionConfig.from_mapping({**budgeted.to_mapping(),
                                                "kv_decode_policy": "snapkv"})
    assert scoring.decode_score_capacity == 128
    h2o = scoring.with_request_overrides({"kv_decode_policy": "h2o"})
    rule = h2o.decode_eviction
    assert (rule.method.name, rule.budget, rule.interval, rule.recent) == ("h2o", 64, 64, 8)
    assert "decode=h2o/64+64" in h2o.describe()
    # the window policy may keep fewer generated tokens than the observation window
    window = ENGINE.with_request_overrides({"kv_decode_budget": 4, "kv_decode_interval": 2})
    assert (window.decode_eviction.method.name, window.decode_eviction.recent) == ("window", 4)
    off = window.with_request_overrides({"kv_compression": "none"})
    assert off.decode_budget == 4 and off.decode_eviction is None  # compression off: kept
    # a request that turns decode eviction off does not inherit a scoring engine's policy
    full = h2o.with_request_overrides({"kv_decode_budget": None})
    assert full.decode_eviction is None and full.decode_policy == "window"


def test_request_overrides_need_compression_on_the_engine():
    with pytest.raises(KVCompressionConfigError, match="--kv-compression"):
        KVCompressionConfig().with_request_overrides({"kv_budget": 64})


def test_every_flag_fills_its_field_and_the_policy_gets_the_shared_ones():
    given = {
        "kv_compression": "adakv", "kv_budget": 96, "kv_window": 16, "kv_pyramid_beta": 4,
        "kv_pooling": "avg", "kv_pooling_kernel": 5, "kv_sink_tokens": 2, "kv_page_size": 32,
        "kv_decode_policy": "h2o", "kv_decode_budget": 128, "kv_decode_interval": 8,
        "kv_decode_score_every": 4, "kv_admission_lookahead": 64, "kv_adakv_floor": 0.8,
        "kv_sharing_wait": 32,
        "kv_adakv_totals": "uniform",
        "kv_gqa_reduce": "max", "kv_reuse": "off", "kv_scoring": "window",
        "kv_reconstruct_chunk": 256, "kv_profile": "/Models/Some-Model/Profile.pt",
        "kv_surrogate": "/Models/Some-Model/Surrogate.pt",
        "kv_min_prompt": 64, "kv_budget_sharing": "model", "kv_score_threshold": -6.0,
    }
    config = KVCompressionConfig.from_mapping(given)
    for spec in FLAG_SPECS:
        assert getattr(config, spec.field) == given.get(spec.key), spec.key
    policy = config.policy
    assert (policy.method, policy.budget, policy.ratio, policy.window, policy.beta) == (
        "adakv", 96, None, 16, 4.0)
    assert (policy.pooling, policy.pooling_kernel, policy.sink_tokens) == ("avg", 5, 2)
    assert (policy.adakv_floor, policy.adakv_totals, policy.budget_shape) == (
        0.8, "uniform", "uniform")
    assert policy.budget_sharing == "model" and policy.score_threshold == -6.0


def test_the_config_mirrors_the_policy_settings_fields_with_the_same_defaults():
    """The flat user-facing config repeats PolicySettings' fields (it also accepts "none" and
    names flags in its errors): they must not drift apart."""
    import dataclasses

    from kvcompress.policies import PolicySettings

    config_fields = {f.name: f for f in dataclasses.fields(KVCompressionConfig)}
    shared = [f for f in dataclasses.fields(PolicySettings) if f.name in config_fields]
    assert {f.name for f in shared} >= {"method", "budget", "ratio", "window", "beta",
                                         "pooling", "pooling_kernel", "sink_tokens"}
    for field in shared:
        # method: required in the policy, "none" in the config; budget_sharing: "auto" in
        # the config, resolved for the policy
        if field.name not in ("method", "budget_sharing"):
            assert config_fields[field.name].default == field.default, field.name


def test_scoring_is_auto_by_default_resolved_at_start_window_until_then():
    default = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                                "kv_compression_ratio": 0.75})
    assert (default.scoring, default.reconstruct_chunk) == ("auto", 512)
    # auto is resolved by the engine's start (settings/resolution.py): it never
    # stands for a reconstruction pass
    assert default.resolved_scoring == "window" and not default.reconstructs(200)
    assert not default.reserves_reconstruction and not default.loads_surrogate
    assert "scoring=window" in default.describe()
    surrogate = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                                  "kv_compression_ratio": 0.75,
                                                  "kv_scoring": "surrogate"})
    assert surrogate.loads_surrogate and not surrogate.scores_window
    assert surrogate.resolved_budget_sharing == "model" and not surrogate.reconstructs(200)
    # a request asking for auto gets the engine's own choice
    assert surrogate.with_request_overrides({"kv_scoring": "auto"}).scoring == "surrogate"
    hybrid = surrogate.with_request_overrides({"kv_scoring": "hybrid-surrogate"})
    assert hybrid.loads_surrogate and hybrid.scores_window and not hybrid.reconstructs(200)
    assert hybrid.resolved_budget_sharing == "model"
    with pytest.raises(KVCompressionConfigError, match="kv_scoring.*surrogate needs"):
        default.with_request_overrides({"kv_scoring": "surrogate"})
    with pytest.raises(KVCompressionConfigError, match="whole engine"):
        surrogate.with_request_overrides({"kv_surrogate": "/elsewhere.pt"})
    default = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                                "kv_compression_ratio": 0.75,
                                                "kv_scoring": "hybrid"})
    config = default.with_request_overrides({"kv_scoring": "reconstruct"})
    assert config.reconstructs(200) and not config.scores_window
    # StreamingLLM keeps sinks and recent tokens: nothing to score, no pass
    streaming = config.with_request_overrides({"kv_compression": "streamingllm"})
    assert not streaming.reconstructs(200)
    # a budget the prompt fits in compresses nothing: no pass
    budget = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 256,
                                               "kv_scoring": "reconstruct"})
    assert not budget.reconstructs(256) and budget.reconstructs(257)
    assert not KVCompressionConfig().reserves_reconstruction
    window = config.with_request_overrides({"kv_scoring": "window"})
    assert window.scoring == "window" and not window.reconstructs(200)
    with pytest.raises(KVCompressionConfigError,
                       match=r"--kv-scoring.*window, surrogate, hybrid-surrogate, reconstruct"):
        KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_scoring": "q"})
    for chunk in (8, 9000):
        with pytest.raises(KVCompressionConfigError,
                           match=r"--kv-reconstruct-chunk.*\[16, 8192\]"):
            KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                              "kv_reconstruct_chunk": chunk})


def test_reconstruct_per_request_needs_the_engine_scratch_pages():
    window_engine = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                                      "kv_scoring": "window"})
    for scoring in ("reconstruct", "hybrid"):
        with pytest.raises(KVCompressionConfigError,
                           match=f"kv_scoring.*{scoring} needs.*--kv-scoring reconstruct"):
            window_engine.with_request_overrides({"kv_scoring": scoring})
    with pytest.raises(KVCompressionConfigError, match="whole engine"):
        ENGINE.with_request_overrides({"kv_reconstruct_chunk": 128})


def test_expected_scoring_reads_a_profile_and_per_request_needs_the_engines():
    """--kv-scoring expected: no window, no pass, a profile loaded once (its path keeps its
    case); per request only on a server that loaded one; --kv-profile is engine-wide."""
    engine = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                               "kv_scoring": "expected",
                                               "kv_profile": "/Models/P.pt"})
    assert engine.profile == "/Models/P.pt" and engine.loads_profile
    assert not engine.scores_window and not engine.reconstructs(200)
    assert not engine.reserves_reconstruction
    window = engine.with_request_overrides({"kv_scoring": "window"})
    assert window.scores_window and not window.loads_profile
    with pytest.raises(KVCompressionConfigError,
                       match="kv_scoring.*expected needs the query profile"):
        ENGINE.with_request_overrides({"kv_scoring": "expected"})
    with pytest.raises(KVCompressionConfigError, match="whole engine"):
        engine.with_request_overrides({"kv_profile": "/other.pt"})
    with pytest.raises(KVCompressionConfigError, match="--kv-profile.*a string"):
        KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_profile": 3})


def test_short_prompts_and_segments_are_kept_whole_even_with_a_ratio():
    """--kv-min-prompt: a ratio compresses prompts longer than the floor only; with a budget
    the budget is the floor; 0 compresses every prompt a ratio applies to."""
    ratio = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv",
                                              "kv_compression_ratio": 0.75})
    assert ratio.min_prompt == 128
    assert not ratio.compresses(128) and ratio.compresses(129)
    every = ratio.with_request_overrides({"kv_min_prompt": 0})
    assert every.compresses(1)
    budget = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", "kv_budget": 64,
                                               "kv_min_prompt": 100})
    assert not budget.compresses(64) and budget.compresses(65)
    with pytest.raises(KVCompressionConfigError, match=r"--kv-min-prompt.*>= 0"):
        KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_min_prompt": -1})


@pytest.mark.parametrize(
    ("settings", "sharing"),
    [
        ({}, "layer"),  # auto unresolved (resolved at start): the window's
        ({"kv_scoring": "surrogate"}, "model"),  # predicts a reconstruction's scores
        ({"kv_scoring": "hybrid"}, "model"),
        ({"kv_scoring": "window"}, "layer"),
        ({"kv_scoring": "expected"}, "layer"),
        ({"kv_scoring": "reconstruct", "kv_reuse": "off"}, "model"),
        ({"kv_budget_sharing": "layer"}, "layer"),
        ({"kv_budget_sharing": "model", "kv_scoring": "window"}, "model"),
        ({"kv_compression": "streamingllm"}, "layer"),  # no scores to share by
    ],
)
def test_auto_budget_sharing_is_model_wide_where_a_reconstruction_scores(settings, sharing):
    config = KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_compression_ratio": 0.75, **settings})
    assert config.resolved_budget_sharing == sharing
    assert config.policy.budget_sharing == sharing
    assert f"sharing={sharing}" in config.describe()


def test_a_score_threshold_replaces_the_default_budget_and_an_amount_given_caps_it():
    alone = KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_score_threshold": -6})
    assert alone.score_threshold == -6.0 and alone.budget is None and alone.ratio is None
    assert not alone.policy.capped and alone.policy.score_threshold == -6.0
    # Prompts over --kv-min-prompt are thresholded, shorter ones kept whole.
    assert alone.compresses(DEFAULT_MIN_PROMPT + 1) and not alone.compresses(DEFAULT_MIN_PROMPT)
    capped = KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_score_threshold": -6, "kv_budget": 512})
    assert capped.policy.capped and capped.budget == 512
    assert capped.compresses(300), "under its cap a prompt is still thresholded"
    assert KVCompressionConfig.from_mapping(alone.to_mapping()) == alone
    assert "threshold=-6 (no cap)" in alone.describe()


def test_a_requests_threshold_is_capped_only_by_an_amount_someone_gave():
    defaulted = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv"})
    assert defaulted.budget == DEFAULT_BUDGET and defaulted.budget_defaulted
    assert KVCompressionConfig.from_mapping(defaulted.to_mapping()) == defaulted
    request = {"kv_score_threshold": -6}
    assert not defaulted.with_request_overrides(request).policy.capped
    given = KVCompressionConfig.from_mapping({"kv_compression": "pyramidkv", "kv_budget": 256})
    assert given.with_request_overrides(request).budget == 256
    engine = KVCompressionConfig.from_mapping(
        {"kv_compression": "pyramidkv", "kv_score_threshold": -6})
    own_cap = engine.with_request_overrides({"kv_compression_ratio": 0.5})
    assert own_cap.ratio == 0.5 and own_cap.score_threshold == -6.0
    assert engine.with_request_overrides({"kv_score_threshold": -3}).score_threshold == -3.0
    assert engine.with_request_overrides({"kv_compression": "none"}).enabled is False
