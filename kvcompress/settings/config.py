"""The compression settings as one validated object, built from flags, ``additional_config``
or a request's overrides.

Validation happens before any engine process starts (``settings.validation``), and every
error names the flag and the allowed values. The flags themselves (types, choices, defaults,
help) are ``settings.flags``; what ``auto`` stands for is ``settings.resolution``.
``policy`` gives the settings ``plan_keep`` takes.

No vLLM imports: this module is shared by the engine, the tests and the vLLM glue.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcompress.policies import PolicySettings, get_method
from kvcompress.policies.decode import (
    DecodeEviction,
    get_decode_method,
)
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
from kvcompress.settings import validation
from kvcompress.settings.flags import (
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
    RECONSTRUCTING_SCORINGS,
    SPEC_BY_KEY,
    SURROGATE_SCORINGS,
)
from kvcompress.settings.resolution import budget_sharing_in_force, scoring_in_force
from kvcompress.settings.validation import KVCompressionConfigError


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
        given = {k: validation.coerce(k, v) for k, v in values.items()
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
        validation.check_method_and_amount(self, explicit_keys or set())
        validation.check_prompt_selection(self)
        validation.check_decode(self)
        validation.check_pool_and_scoring(self)

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
        validation.check_request_may_override(self, overrides)
        if str(overrides.get("kv_scoring", "")).lower() == "auto":
            overrides["kv_scoring"] = self.resolved_scoring  # the engine's own choice
        validation.check_request_scoring(self, str(overrides.get("kv_scoring", "")).lower())
        resolved = KVCompressionConfig.from_mapping(validation.request_mapping(self, overrides),
                                                    source="request")
        validation.check_decode_score_capacity(self, resolved)
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
