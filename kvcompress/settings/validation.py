"""The checks of ``KVCompressionConfig.validate`` and of a request's overrides, in the order
they run: the first invalid setting is the one named, with its flag, its
``additional_config`` key and the allowed values. No vLLM imports."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NoReturn

from kvcompress.policies import COMPRESSION_METHODS, get_method
from kvcompress.policies.decode import DECODE_METHODS, DECODE_POLICIES, get_decode_method
from kvcompress.policies.methods.base import BUDGET_SHAPES
from kvcompress.policies.validation import POOLINGS
from kvcompress.settings.flags import (
    BUDGET_SHARING_CHOICES,
    CONFIG_KEYS,
    DEFAULT_DECODE_POLICY,
    GQA_REDUCES,
    METHODS,
    PAGE_SIZE_RANGE,
    RECONSTRUCT_CHUNK_RANGE,
    RECONSTRUCTING_SCORINGS,
    REQUEST_KEYS,
    REUSE_CHOICES,
    SCORINGS,
    SPEC_BY_KEY,
    SURROGATE_SCORINGS,
)

if TYPE_CHECKING:  # (the config imports this module)
    from kvcompress.settings.config import KVCompressionConfig


class KVCompressionConfigError(ValueError):
    """A compression setting is invalid; the message names the flag and allowed values."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key = key
        self.detail = detail



def coerce(key: str, value: Any) -> Any:
    """A value from a flag, additional_config or a request, as its setting's type (string
    choices are case-insensitive; their ranges are checked by ``validate``)."""
    spec = SPEC_BY_KEY[key]
    if spec.type is str:
        if not isinstance(value, str):
            fail(key, f"got {value!r}; allowed: "
                  + (", ".join(spec.choices) if spec.choices else "a string"))
        return value.lower() if spec.choices else value
    if spec.type is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            fail(key, f"got {value!r}; allowed: an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            fail(key, f"got {value!r}; allowed: an integer")
    try:
        return float(value)
    except (TypeError, ValueError):
        fail(key, f"got {value!r}; allowed: a number")


def fail(key: str, detail: str) -> NoReturn:
    """Raise the error for setting ``key``, naming its flag and its additional_config key."""
    spec = SPEC_BY_KEY[key]
    raise KVCompressionConfigError(
        f"invalid {spec.flag} (additional_config '{key}'): {detail}", key, detail
    )


# Validation, in the order ``validate`` runs it: the first invalid setting is the one named.

def check_method_and_amount(config: KVCompressionConfig, explicit_keys: set[str]) -> None:
    """The method, and the budget or ratio (exclusive when both are given)."""
    if config.method not in METHODS:
        fail("kv_compression", f"got {config.method!r}; allowed: {', '.join(METHODS)}")
    if "kv_budget" in explicit_keys and "kv_compression_ratio" in explicit_keys:
        raise KVCompressionConfigError(
            "--kv-budget and --kv-compression-ratio are exclusive: give one of them "
            f"(got --kv-budget {config.budget} and --kv-compression-ratio {config.ratio})"
        )
    if config.budget is not None and config.budget <= 0:
        fail("kv_budget", f"got {config.budget}; allowed: an integer >= 1")
    if config.ratio is not None and not (0.0 < config.ratio < 1.0):
        fail("kv_compression_ratio", f"got {config.ratio}; allowed: 0 < R < 1")


def check_prompt_selection(config: KVCompressionConfig) -> None:
    """Which prompt tokens a compressed head keeps: window, pyramid slope, pooling, sinks,
    Ada-KV's sharing, budget sharing, score threshold, GQA reduction."""
    if config.window < 1:
        fail("kv_window", f"got {config.window}; allowed: an integer >= 1")
    if config.budget is not None and config.window > config.budget:
        fail(
            "kv_window",
            f"got {config.window}, larger than --kv-budget {config.budget}; "
            f"allowed: 1 <= window <= budget",
        )
    if not (config.beta >= 1.0) or math.isinf(config.beta):
        fail("kv_pyramid_beta", f"got {config.beta}; allowed: a finite number >= 1")
    if config.pooling not in POOLINGS:
        fail("kv_pooling", f"got {config.pooling!r}; allowed: {', '.join(POOLINGS)}")
    if config.pooling_kernel < 1 or config.pooling_kernel % 2 == 0:
        fail("kv_pooling_kernel", f"got {config.pooling_kernel}; allowed: an odd integer >= 1")
    if config.sink_tokens < 0:
        fail("kv_sink_tokens", f"got {config.sink_tokens}; allowed: an integer >= 0")
    if not (0.0 <= config.adakv_floor <= 1.0):
        fail("kv_adakv_floor", f"got {config.adakv_floor}; allowed: a number in [0, 1]")
    if config.adakv_totals not in BUDGET_SHAPES:
        fail("kv_adakv_totals",
               f"got {config.adakv_totals!r}; allowed: {', '.join(BUDGET_SHAPES)}")
    if config.budget_sharing not in BUDGET_SHARING_CHOICES:
        fail("kv_budget_sharing", f"got {config.budget_sharing!r}; allowed: "
               f"{', '.join(BUDGET_SHARING_CHOICES)}")
    if (config.budget_sharing == "model" and config.enabled
            and not get_method(config.method).needs_scores):
        fail("kv_budget_sharing", f"'model' shares the budget by score and "
               f"{config.method} scores no tokens; allowed with it: auto, layer")
    check_threshold(config)
    if config.gqa_reduce not in GQA_REDUCES:
        fail("kv_gqa_reduce", f"got {config.gqa_reduce!r}; allowed: {', '.join(GQA_REDUCES)}")


def check_threshold(config: KVCompressionConfig) -> None:
    threshold = config.score_threshold
    if threshold is None:
        return
    if not (math.isfinite(threshold) and threshold < 0):
        fail("kv_score_threshold",
               f"got {threshold}; allowed: a finite number < 0 (the natural log of a "
               "score: reconstruction scores are probabilities, at most 1), e.g. -6")
    if config.enabled and not get_method(config.method).needs_scores:
        scored = ", ".join(m.name for m in COMPRESSION_METHODS if m.needs_scores)
        fail("kv_score_threshold",
               f"got {threshold} with --kv-compression {config.method}, which scores no "
               f"tokens; allowed with: {scored}")


def check_decode(config: KVCompressionConfig) -> None:
    """Decode eviction: the policy, its interval and scoring period, and its budget."""
    if config.decode_policy not in DECODE_POLICIES:
        fail("kv_decode_policy",
               f"got {config.decode_policy!r}; allowed: {', '.join(DECODE_POLICIES)}")
    if config.decode_interval < 1:
        fail("kv_decode_interval", f"got {config.decode_interval}; allowed: an integer >= 1")
    if config.decode_score_every < 1:
        fail("kv_decode_score_every",
               f"got {config.decode_score_every}; allowed: an integer >= 1")
    scored = get_decode_method(config.decode_policy).needs_scores
    if config.decode_budget is None:
        if scored:
            scored_names = " or ".join(m.name for m in DECODE_METHODS if m.needs_scores)
            fail("kv_decode_policy",
                   f"got {config.decode_policy!r} without --kv-decode-budget; allowed: "
                   f"--kv-decode-policy {scored_names} together with --kv-decode-budget N")
        return
    if config.decode_budget < 1:
        fail("kv_decode_budget", f"got {config.decode_budget}; allowed: an integer >= 1")
    if scored and config.decode_budget <= config.window:
        # The newest `window` generated tokens are always kept: a budget that holds only
        # them leaves nothing to choose by score (that is --kv-decode-policy window).
        fail("kv_decode_budget",
               f"got {config.decode_budget} with --kv-decode-policy {config.decode_policy} and "
               f"--kv-window {config.window}; allowed: an integer > --kv-window (the newest "
               "window tokens are always kept, the rest are chosen by score)")


def check_pool_and_scoring(config: KVCompressionConfig) -> None:
    """Reuse, the short-prompt floor, admission, the scoring, the reconstruction chunk and
    the page size."""
    if config.reuse not in REUSE_CHOICES:
        fail("kv_reuse", f"got {config.reuse!r}; allowed: {', '.join(REUSE_CHOICES)}")
    if config.min_prompt < 0:
        fail("kv_min_prompt", f"got {config.min_prompt}; allowed: an integer >= 0")
    if config.admission_lookahead < 0:
        fail("kv_admission_lookahead",
               f"got {config.admission_lookahead}; allowed: an integer >= 0")
    if config.sharing_wait < 1:
        fail("kv_sharing_wait", f"got {config.sharing_wait}; allowed: an integer >= 1")
    if config.scoring not in SCORINGS:
        fail("kv_scoring", f"got {config.scoring!r}; allowed: {', '.join(SCORINGS)}")
    low, high = RECONSTRUCT_CHUNK_RANGE
    if not (low <= config.reconstruct_chunk <= high):
        fail("kv_reconstruct_chunk",
               f"got {config.reconstruct_chunk}; allowed: an integer in [{low}, {high}]")
    low, high = PAGE_SIZE_RANGE
    size = config.page_size
    if size is not None and (not (low <= size <= high) or size & (size - 1)):
        fail("kv_page_size", f"got {size}; allowed: a power of two in [{low}, {high}]")


# A request's overrides, checked against what the engine was started with.

def check_request_may_override(engine: KVCompressionConfig, overrides: dict[str, Any]) -> None:
    """Compression is on, and every override is a per-request setting."""
    if not engine.enabled:
        raise KVCompressionConfigError(
            "per-request kv_* settings need a server started with --kv-compression"
        )
    engine_only = sorted(set(overrides) & (CONFIG_KEYS - REQUEST_KEYS))
    if engine_only:
        raise KVCompressionConfigError(
            f"per-request setting rejected: {engine_only} can only be set for the "
            "whole engine (flag or additional_config)"
        )


def check_request_scoring(engine: KVCompressionConfig, asked: str) -> None:
    """A request's scoring needs what the engine loaded or reserved at start: scratch pages
    for a reconstruction, the surrogate, the query profile."""
    if asked in RECONSTRUCTING_SCORINGS and not engine.reserves_reconstruction:
        raise KVCompressionConfigError(
            f"invalid per-request setting 'kv_scoring': {asked} needs the scratch pages "
            "of a server started with --kv-scoring reconstruct or hybrid (this one runs "
            f"--kv-scoring {engine.scoring}); allowed: {engine.scoring}", "kv_scoring",
            f"allowed: {engine.scoring}")
    if asked in SURROGATE_SCORINGS and not engine.loads_surrogate:
        raise KVCompressionConfigError(
            f"invalid per-request setting 'kv_scoring': {asked} needs the score surrogate "
            "of a server started with --kv-scoring surrogate, hybrid-surrogate or auto "
            f"with a surrogate (this one runs --kv-scoring {engine.scoring}); allowed: "
            f"window or {engine.scoring}", "kv_scoring", f"allowed: window or {engine.scoring}")
    if asked == "expected" and not engine.loads_profile:
        raise KVCompressionConfigError(
            "invalid per-request setting 'kv_scoring': expected needs the query profile "
            "of a server started with --kv-scoring expected (this one runs --kv-scoring "
            f"{engine.scoring}); allowed: {engine.scoring}", "kv_scoring",
            f"allowed: {engine.scoring}")


def request_mapping(engine: KVCompressionConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """The engine's settings with the request's on top."""
    merged = engine.to_mapping()
    if "kv_budget" in overrides or "kv_compression_ratio" in overrides:
        merged["kv_budget"] = merged["kv_compression_ratio"] = None
    merged.update(overrides)
    if "kv_decode_budget" in overrides and overrides["kv_decode_budget"] is None \
            and "kv_decode_policy" not in overrides:
        # No decode eviction for this request: the engine's decode policy has nothing to
        # pick (and a scoring one would be refused without a budget).
        merged["kv_decode_policy"] = DEFAULT_DECODE_POLICY
    return merged


def check_decode_score_capacity(engine: KVCompressionConfig,
                                 request: KVCompressionConfig) -> None:
    """A request whose decode policy scores must fit its accumulators in the engine's
    reserve: budget + interval at most the engine's, and anchors' second accumulator
    only where the engine keeps one."""
    eviction = request.decode_eviction
    if eviction is None or not eviction.method.needs_scores:
        return
    capacity = engine.decode_score_capacity
    if capacity and request.decode_score_accumulators > engine.decode_score_accumulators:
        detail = (f"got {eviction.method.name} on a server started with "
                  f"--kv-decode-policy {engine.decode_policy}; allowed: a policy with one "
                  "score accumulator (h2o, snapkv, rkv), or anchors on a server started "
                  "with --kv-decode-policy anchors (its reserve holds anchors' second "
                  "accumulator)")
        raise KVCompressionConfigError(
            f"invalid per-request setting 'kv_decode_policy': {detail}", "kv_decode_policy",
            detail)
    if eviction.capacity <= capacity:
        return
    if not capacity:
        allowed = ("a scored decode policy needs a server started with --kv-decode-budget "
                   "and a scoring --kv-decode-policy (its budget + interval size the "
                   "decode-score reserve; window reserves none)")
    else:
        allowed = (f"kv_decode_budget + kv_decode_interval <= {capacity} (the server's "
                   "--kv-decode-budget + --kv-decode-interval, what its decode-score "
                   "reserve holds)")
    detail = (f"got {eviction.budget} + interval {eviction.interval} with "
              f"kv_decode_policy {eviction.method.name}; allowed: {allowed}")
    raise KVCompressionConfigError(
        f"invalid per-request setting 'kv_decode_budget': {detail}", "kv_decode_budget",
        detail)
