"""The compression settings as one validated object, built from flags, ``additional_config``
or a request's overrides.

Validation happens here, before any engine process starts, and every error names the flag
and the allowed values. The flags themselves (types, choices, defaults, help) are
``settings.flags``; what ``auto`` stands for is ``settings.resolution``. ``policy`` gives the
settings ``plan_keep`` takes.

No vLLM imports: this module is shared by the engine, the tests and the vLLM glue.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from kvcompress.policies import COMPRESSION_METHODS, PolicySettings, get_method
from kvcompress.policies.decode import (
    DECODE_METHODS,
    DECODE_POLICIES,
    DecodeEviction,
    get_decode_method,
)
from kvcompress.policies.methods.base import BUDGET_SHAPES
from kvcompress.policies.settings import (
    DEFAULT_ADAKV_FLOOR,
    DEFAULT_ADAKV_TOTALS,
    DEFAULT_BETA,
    DEFAULT_GROUP_REDUCE,
    DEFAULT_POOLING,
    DEFAULT_POOLING_KERNEL,
    DEFAULT_SINK_TOKENS,
    DEFAULT_WINDOW,
)
from kvcompress.policies.validation import POOLINGS
from kvcompress.settings.flags import (
    BUDGET_SHARING_CHOICES,
    CONFIG_KEYS,
    DEFAULT_ADMISSION_LOOKAHEAD,
    DEFAULT_BUDGET,
    DEFAULT_DECODE_INTERVAL,
    DEFAULT_DECODE_POLICY,
    DEFAULT_MIN_PROMPT,
    DEFAULT_RECONSTRUCT_CHUNK,
    DEFAULT_SCORING,
    DEFAULT_SHARING_WAIT,
    FLAG_SPECS,
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
from kvcompress.settings.resolution import budget_sharing_in_force, scoring_in_force


class KVCompressionConfigError(ValueError):
    """A compression setting is invalid; the message names the flag and allowed values."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key = key
        self.detail = detail


@dataclass(frozen=True)
class KVCompressionConfig:
    """Validated compression settings (see settings.flags for the meaning of each field)."""

    method: str = "none"
    budget: int | None = None
    ratio: float | None = None
    window: int = DEFAULT_WINDOW
    beta: float = DEFAULT_BETA
    pooling: str = DEFAULT_POOLING
    pooling_kernel: int = DEFAULT_POOLING_KERNEL
    sink_tokens: int = DEFAULT_SINK_TOKENS
    adakv_floor: float = DEFAULT_ADAKV_FLOOR
    adakv_totals: str = DEFAULT_ADAKV_TOTALS
    budget_sharing: str = "auto"
    gqa_reduce: str = DEFAULT_GROUP_REDUCE
    page_size: int | None = None  # None: the platform's default (engine/vllm_layout.py)
    decode_policy: str = DEFAULT_DECODE_POLICY
    decode_budget: int | None = None
    decode_interval: int = DEFAULT_DECODE_INTERVAL
    decode_score_every: int = 1
    admission_lookahead: int = DEFAULT_ADMISSION_LOOKAHEAD
    sharing_wait: int = DEFAULT_SHARING_WAIT
    reuse: str = "on"
    scoring: str = DEFAULT_SCORING
    reconstruct_chunk: int = DEFAULT_RECONSTRUCT_CHUNK
    profile: str = ""  # the query profile's path; "" = beside the model
    surrogate: str = ""  # the score surrogate's path; "" = beside the model
    min_prompt: int = DEFAULT_MIN_PROMPT
    score_threshold: float | None = None
    # Not a setting: the budget is DEFAULT_BUDGET because no amount (and no threshold) was
    # given. A request's threshold then replaces it rather than being capped by it.
    budget_defaulted: bool = dataclasses.field(default=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def compresses(self, prompt_len: int) -> bool:
        """Whether a prompt (or a continuation's new segment) of this length is compacted
        after its prefill. A budget alone keeps prompts up to it whole; a ratio or a score
        threshold (even under a budget cap) those up to --kv-min-prompt."""
        by_length = self.ratio is not None or self.score_threshold is not None
        floor = self.min_prompt if by_length else (self.budget or 0)
        return self.enabled and prompt_len > floor

    def reconstructs(self, prompt_len: int) -> bool:
        """Whether a prompt of this length is scored by reconstructing it (an extra pass)
        rather than by its observation window."""
        return (self.resolved_scoring in RECONSTRUCTING_SCORINGS
                and self.compresses(prompt_len) and self.policy.compression_method.needs_scores)

    @property
    def resolved_scoring(self) -> str:
        """The scoring in force: ``auto`` is resolved when the engine starts (to surrogate or
        window); unresolved, it stands for window."""
        return scoring_in_force(self.scoring)

    @property
    def resolved_budget_sharing(self) -> str:
        """The sharing ``auto`` stands for: model-wide where a reconstruction scores."""
        method_scores = self.enabled and get_method(self.method).needs_scores
        return budget_sharing_in_force(self.budget_sharing, method_scores, self.resolved_scoring)

    @property
    def scores_window(self) -> bool:
        """Whether the observation window's queries score the prompt (window, hybrid,
        hybrid-surrogate)."""
        return self.resolved_scoring in ("window", "hybrid", "hybrid-surrogate")

    @property
    def loads_profile(self) -> bool:
        """Whether the engine loads a query profile (--kv-scoring expected)."""
        return self.enabled and self.resolved_scoring == "expected"

    @property
    def loads_surrogate(self) -> bool:
        """Whether the engine loads a score surrogate (--kv-scoring surrogate or
        hybrid-surrogate)."""
        return self.enabled and self.resolved_scoring in SURROGATE_SCORINGS

    @property
    def reserves_reconstruction(self) -> bool:
        """Whether the engine keeps scratch pages for reconstruction passes."""
        return self.enabled and self.resolved_scoring in RECONSTRUCTING_SCORINGS

    @functools.cached_property
    def policy(self) -> PolicySettings:
        """The settings ``plan_keep`` takes (computed once: configs are shared by many steps)."""
        if not self.enabled:
            raise ValueError("kv_compression is 'none': there is no policy to plan with")
        fields = {name: getattr(self, name) for name in _POLICY_FIELDS}
        return PolicySettings(**fields, budget_sharing=self.resolved_budget_sharing)

    @functools.cached_property
    def decode_eviction(self) -> DecodeEviction | None:
        """How this request evicts generated tokens; None when it keeps them all (no
        --kv-decode-budget, or compression off)."""
        if not self.enabled or self.decode_budget is None:
            return None
        return DecodeEviction(
            get_decode_method(self.decode_policy), self.decode_budget, self.decode_interval,
            recent=min(self.window, self.decode_budget),
        )

    @property
    def decode_score_capacity(self) -> int:
        """Generated offsets a request's decode-score accumulator may hold on this engine
        (0: none): the engine's --kv-decode-budget + --kv-decode-interval where its
        --kv-decode-policy scores, what the score reserve taken from the KV-cache memory is
        sized for (``engine.scoring_memory``). A policy that scores nothing (window)
        reserves nothing."""
        return self.decode_eviction.capacity if self.decode_score_accumulators else 0

    @property
    def decode_score_accumulators(self) -> int:
        """Accumulators each scored request holds on this engine: 0 where its decode policy
        scores nothing, 2 for anchors (its anchor mass apart), else 1."""
        eviction = self.decode_eviction
        if eviction is None or not eviction.method.needs_scores:
            return 0
        return 2 if eviction.method.scores_anchors else 1

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any] | None, source: str = "engine"
    ) -> KVCompressionConfig:
        """Build from ``additional_config``-style keys; ignores keys that are not ours.

        Keys that look like ours (``kv_...``) but are unknown are rejected, so a typo
        never silently runs with defaults. ``source`` ("engine" or "request") only
        changes how errors name the setting.
        """
        values = dict(values or {})
        unknown = sorted(k for k in values if k.startswith("kv_") and k not in CONFIG_KEYS)
        if unknown:
            where = "the request" if source == "request" else "additional_config"
            raise KVCompressionConfigError(
                f"unknown kvcompress setting(s) {unknown} in {where}; "
                f"known keys: {sorted(CONFIG_KEYS)}"
            )
        try:
            return cls._from_known_keys(values)
        except KVCompressionConfigError as error:
            if source != "request":
                raise
            message = (
                f"invalid per-request setting '{error.key}': {error.detail}"
                if error.key else f"per-request settings rejected: {error}"
            )
            raise KVCompressionConfigError(message, error.key, error.detail) from None

    @classmethod
    def _from_known_keys(cls, values: dict[str, Any]) -> KVCompressionConfig:
        given = {k: _coerce(k, v) for k, v in values.items()
                 if k in CONFIG_KEYS and v is not None}
        fields = {SPEC_BY_KEY[key].field: value for key, value in given.items()}
        amount_given = "budget" in fields or "ratio" in fields
        # A score threshold needs no amount: given one, it caps the threshold (policies/
        # threshold.py); else nothing does.
        if (fields.get("method", "none") != "none" and not amount_given
                and "score_threshold" not in fields):
            fields["budget"] = DEFAULT_BUDGET
            fields["budget_defaulted"] = True
        config = cls(**fields)  # the field defaults are the documented ones
        config.validate(explicit_keys=set(given))
        return config

    def validate(self, explicit_keys: set[str] | None = None) -> None:
        """Raise KVCompressionConfigError, naming the flag, for the first invalid setting
        (``explicit_keys``: the ones given, for the checks of settings given together)."""
        _check_method_and_amount(self, explicit_keys or set())
        _check_prompt_selection(self)
        _check_decode(self)
        _check_pool_and_scoring(self)

    def with_request_overrides(self, extra_args: Mapping[str, Any] | None) -> KVCompressionConfig:
        """This engine config with one request's ``kv_*`` overrides applied (validated).

        A request giving a budget or a ratio replaces the engine's amount (they stay
        exclusive); ``kv_compression: none`` keeps the request's whole cache. A request's
        ``kv_score_threshold`` is capped by the engine's amount only where the engine was
        given one (--kv-budget, --kv-compression-ratio), not by the default budget.
        """
        overrides = {k: v for k, v in (extra_args or {}).items() if k.startswith("kv_")}
        if not overrides:
            return self
        _check_request_may_override(self, overrides)
        if str(overrides.get("kv_scoring", "")).lower() == "auto":
            overrides["kv_scoring"] = self.resolved_scoring  # the engine's own choice
        _check_request_scoring(self, str(overrides.get("kv_scoring", "")).lower())
        resolved = KVCompressionConfig.from_mapping(_request_mapping(self, overrides),
                                                    source="request")
        _check_decode_score_capacity(self, resolved)
        return resolved

    def to_mapping(self) -> dict[str, Any]:
        """The ``additional_config`` keys that reproduce this config exactly (a defaulted
        budget is left out: it stays a default, which a request's threshold replaces)."""
        mapping = {spec.key: getattr(self, spec.field) for spec in FLAG_SPECS}
        if self.budget_defaulted:
            mapping["kv_budget"] = None
        return mapping

    def describe(self) -> str:
        amount = (f"budget={self.budget}" if self.budget is not None
                  else f"ratio={self.ratio}" if self.ratio is not None else "no cap")
        if self.score_threshold is not None:
            amount = f"threshold={self.score_threshold:g} ({amount})"
        return (
            f"method={self.method} {amount} window={self.window} beta={self.beta:g} "
            f"pooling={self.pooling}/{self.pooling_kernel} sinks={self.sink_tokens} "
            f"gqa={self.gqa_reduce} scoring={self.resolved_scoring} "
            f"sharing={self.resolved_budget_sharing} "
            + (f"adakv_floor={self.adakv_floor:g} adakv_totals={self.adakv_totals} "
               if self.method == "adakv" else "")
            + f"page_size={self.page_size or 'auto'}"
            + (f" decode={self.decode_policy}/{self.decode_budget}+{self.decode_interval}"
               if self.decode_budget is not None else "")
        )


# Every setting the policy takes that the engine config carries (the rest keep the policy's
# defaults): one list, so a new policy knob with a flag reaches plan_keep without glue.
_POLICY_FIELDS = tuple(
    field.name for field in dataclasses.fields(PolicySettings)
    if field.name in {f.name for f in dataclasses.fields(KVCompressionConfig)}
    and field.name != "budget_sharing"  # passed resolved
)


def _coerce(key: str, value: Any) -> Any:
    """A value from a flag, additional_config or a request, as its setting's type (string
    choices are case-insensitive; their ranges are checked by ``validate``)."""
    spec = SPEC_BY_KEY[key]
    if spec.type is str:
        if not isinstance(value, str):
            _fail(key, f"got {value!r}; allowed: "
                  + (", ".join(spec.choices) if spec.choices else "a string"))
        return value.lower() if spec.choices else value
    if spec.type is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            _fail(key, f"got {value!r}; allowed: an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            _fail(key, f"got {value!r}; allowed: an integer")
    try:
        return float(value)
    except (TypeError, ValueError):
        _fail(key, f"got {value!r}; allowed: a number")


def _fail(key: str, detail: str) -> NoReturn:
    """Raise the error for setting ``key``, naming its flag and its additional_config key."""
    spec = SPEC_BY_KEY[key]
    raise KVCompressionConfigError(
        f"invalid {spec.flag} (additional_config '{key}'): {detail}", key, detail
    )


# Validation, in the order ``validate`` runs it: the first invalid setting is the one named.

def _check_method_and_amount(config: KVCompressionConfig, explicit_keys: set[str]) -> None:
    """The method, and the budget or ratio (exclusive when both are given)."""
    if config.method not in METHODS:
        _fail("kv_compression", f"got {config.method!r}; allowed: {', '.join(METHODS)}")
    if "kv_budget" in explicit_keys and "kv_compression_ratio" in explicit_keys:
        raise KVCompressionConfigError(
            "--kv-budget and --kv-compression-ratio are exclusive: give one of them "
            f"(got --kv-budget {config.budget} and --kv-compression-ratio {config.ratio})"
        )
    if config.budget is not None and config.budget <= 0:
        _fail("kv_budget", f"got {config.budget}; allowed: an integer >= 1")
    if config.ratio is not None and not (0.0 < config.ratio < 1.0):
        _fail("kv_compression_ratio", f"got {config.ratio}; allowed: 0 < R < 1")


def _check_prompt_selection(config: KVCompressionConfig) -> None:
    """Which prompt tokens a compressed head keeps: window, pyramid slope, pooling, sinks,
    Ada-KV's sharing, budget sharing, score threshold, GQA reduction."""
    if config.window < 1:
        _fail("kv_window", f"got {config.window}; allowed: an integer >= 1")
    if config.budget is not None and config.window > config.budget:
        _fail(
            "kv_window",
            f"got {config.window}, larger than --kv-budget {config.budget}; "
            f"allowed: 1 <= window <= budget",
        )
    if not (config.beta >= 1.0) or math.isinf(config.beta):
        _fail("kv_pyramid_beta", f"got {config.beta}; allowed: a finite number >= 1")
    if config.pooling not in POOLINGS:
        _fail("kv_pooling", f"got {config.pooling!r}; allowed: {', '.join(POOLINGS)}")
    if config.pooling_kernel < 1 or config.pooling_kernel % 2 == 0:
        _fail("kv_pooling_kernel", f"got {config.pooling_kernel}; allowed: an odd integer >= 1")
    if config.sink_tokens < 0:
        _fail("kv_sink_tokens", f"got {config.sink_tokens}; allowed: an integer >= 0")
    if not (0.0 <= config.adakv_floor <= 1.0):
        _fail("kv_adakv_floor", f"got {config.adakv_floor}; allowed: a number in [0, 1]")
    if config.adakv_totals not in BUDGET_SHAPES:
        _fail("kv_adakv_totals",
               f"got {config.adakv_totals!r}; allowed: {', '.join(BUDGET_SHAPES)}")
    if config.budget_sharing not in BUDGET_SHARING_CHOICES:
        _fail("kv_budget_sharing", f"got {config.budget_sharing!r}; allowed: "
               f"{', '.join(BUDGET_SHARING_CHOICES)}")
    if (config.budget_sharing == "model" and config.enabled
            and not get_method(config.method).needs_scores):
        _fail("kv_budget_sharing", f"'model' shares the budget by score and "
               f"{config.method} scores no tokens; allowed with it: auto, layer")
    _check_threshold(config)
    if config.gqa_reduce not in GQA_REDUCES:
        _fail("kv_gqa_reduce", f"got {config.gqa_reduce!r}; allowed: {', '.join(GQA_REDUCES)}")


def _check_threshold(config: KVCompressionConfig) -> None:
    threshold = config.score_threshold
    if threshold is None:
        return
    if not (math.isfinite(threshold) and threshold < 0):
        _fail("kv_score_threshold",
               f"got {threshold}; allowed: a finite number < 0 (the natural log of a "
               "score: reconstruction scores are probabilities, at most 1), e.g. -6")
    if config.enabled and not get_method(config.method).needs_scores:
        scored = ", ".join(m.name for m in COMPRESSION_METHODS if m.needs_scores)
        _fail("kv_score_threshold",
               f"got {threshold} with --kv-compression {config.method}, which scores no "
               f"tokens; allowed with: {scored}")


def _check_decode(config: KVCompressionConfig) -> None:
    """Decode eviction: the policy, its interval and scoring period, and its budget."""
    if config.decode_policy not in DECODE_POLICIES:
        _fail("kv_decode_policy",
               f"got {config.decode_policy!r}; allowed: {', '.join(DECODE_POLICIES)}")
    if config.decode_interval < 1:
        _fail("kv_decode_interval", f"got {config.decode_interval}; allowed: an integer >= 1")
    if config.decode_score_every < 1:
        _fail("kv_decode_score_every",
               f"got {config.decode_score_every}; allowed: an integer >= 1")
    scored = get_decode_method(config.decode_policy).needs_scores
    if config.decode_budget is None:
        if scored:
            scored_names = " or ".join(m.name for m in DECODE_METHODS if m.needs_scores)
            _fail("kv_decode_policy",
                   f"got {config.decode_policy!r} without --kv-decode-budget; allowed: "
                   f"--kv-decode-policy {scored_names} together with --kv-decode-budget N")
        return
    if config.decode_budget < 1:
        _fail("kv_decode_budget", f"got {config.decode_budget}; allowed: an integer >= 1")
    if scored and config.decode_budget <= config.window:
        # The newest `window` generated tokens are always kept: a budget that holds only
        # them leaves nothing to choose by score (that is --kv-decode-policy window).
        _fail("kv_decode_budget",
               f"got {config.decode_budget} with --kv-decode-policy {config.decode_policy} and "
               f"--kv-window {config.window}; allowed: an integer > --kv-window (the newest "
               "window tokens are always kept, the rest are chosen by score)")


def _check_pool_and_scoring(config: KVCompressionConfig) -> None:
    """Reuse, the short-prompt floor, admission, the scoring, the reconstruction chunk and
    the page size."""
    if config.reuse not in REUSE_CHOICES:
        _fail("kv_reuse", f"got {config.reuse!r}; allowed: {', '.join(REUSE_CHOICES)}")
    if config.min_prompt < 0:
        _fail("kv_min_prompt", f"got {config.min_prompt}; allowed: an integer >= 0")
    if config.admission_lookahead < 0:
        _fail("kv_admission_lookahead",
               f"got {config.admission_lookahead}; allowed: an integer >= 0")
    if config.sharing_wait < 1:
        _fail("kv_sharing_wait", f"got {config.sharing_wait}; allowed: an integer >= 1")
    if config.scoring not in SCORINGS:
        _fail("kv_scoring", f"got {config.scoring!r}; allowed: {', '.join(SCORINGS)}")
    low, high = RECONSTRUCT_CHUNK_RANGE
    if not (low <= config.reconstruct_chunk <= high):
        _fail("kv_reconstruct_chunk",
               f"got {config.reconstruct_chunk}; allowed: an integer in [{low}, {high}]")
    low, high = PAGE_SIZE_RANGE
    size = config.page_size
    if size is not None and (not (low <= size <= high) or size & (size - 1)):
        _fail("kv_page_size", f"got {size}; allowed: a power of two in [{low}, {high}]")


# A request's overrides, checked against what the engine was started with.

def _check_request_may_override(engine: KVCompressionConfig, overrides: dict[str, Any]) -> None:
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


def _check_request_scoring(engine: KVCompressionConfig, asked: str) -> None:
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


def _request_mapping(engine: KVCompressionConfig, overrides: dict[str, Any]) -> dict[str, Any]:
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


def _check_decode_score_capacity(engine: KVCompressionConfig,
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
