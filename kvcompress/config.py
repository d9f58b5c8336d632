"""User-facing compression settings: one object, parsed from flags or additional_config.

Every setting has a CLI flag (``--kv-budget``) and an ``additional_config`` key with the
same name in snake case (``kv_budget``). Validation happens here, before any engine
process starts, and every error names the flag and the allowed values.

No vLLM imports: this module is shared by the engine, the tests and the vLLM glue. Method
names, their help and the policy defaults come from ``kvcompress.policies``; ``policy`` gives
the settings ``plan_keep`` takes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcompress.policies import COMPRESSION_METHODS, PolicySettings, get_method
from kvcompress.policies import METHODS as POLICY_METHODS
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
from kvcompress.policies.sharing import BUDGET_SHARINGS
from kvcompress.policies.validation import POOLINGS

# How the query heads sharing a KV head combine their window attention. "sum" ranks like
# "mean" (a constant factor), so users choose between these two.
GQA_REDUCES = ("mean", "max")

METHODS = ("none", *POLICY_METHODS)

# A method other than "none" given neither --kv-budget nor --kv-compression-ratio keeps
# this many tokens per KV head per layer on average (window included). 512 sits between
# the papers' small (64/128) and near-lossless (2048) settings: long prompts shrink a lot,
# short chat turns (< 512 tokens) are not touched at all.
DEFAULT_BUDGET = 512
DEFAULT_PAGE_SIZE = 16
AMX_PAGE_SIZE = 32  # the default where the CPU attention kernel runs on AMX tiles
DEFAULT_DECODE_POLICY = "window"
DEFAULT_DECODE_INTERVAL = 64  # evict generated tokens only every ~64 new tokens
PAGE_SIZE_RANGE = (4, 256)
# Decode growth reserved per running request when admitting a prefill: most answers are
# shorter, and a longer one that outgrows it is preempted (the cheapest to recompute first).
DEFAULT_ADMISSION_LOOKAHEAD = 512
REUSE_CHOICES = ("on", "off")
# Which prompt tokens a compressed head keeps is decided by scores: "window" (the prompt's
# last queries, question-aware), "reconstruct" (how much a reconstruction of the context
# attends to each token, query-agnostic: what later questions about it can rely on, at the
# cost of an extra pass), "hybrid" (the union of both rankings), "surrogate" (the
# reconstruction's scores predicted inside the prefill by a map made once per model,
# --kv-surrogate: query-agnostic with no extra pass), "hybrid-surrogate" (the union of the
# window's and the surrogate's rankings) or "expected" (the attention the model's average
# later query pays a key, from a query profile made once per model). "auto" is resolved when
# the engine starts (engine/engine_args.py): surrogate where a kept cache can serve later
# requests (--kv-reuse on) and the model has a surrogate, else window.
SCORINGS = ("auto", "window", "surrogate", "hybrid-surrogate", "reconstruct", "hybrid",
            "expected")
RECONSTRUCTING_SCORINGS = ("reconstruct", "hybrid")
SURROGATE_SCORINGS = ("surrogate", "hybrid-surrogate")
# Scorings whose scores compare across layers and heads (a reconstruction's, or their
# prediction): ``--kv-budget-sharing auto`` shares the budget model-wide for them.
QUERY_AGNOSTIC_SCORINGS = (*RECONSTRUCTING_SCORINGS, *SURROGATE_SCORINGS)
# Where a compressed prompt's budget may go; "auto" is "model" where a reconstruction or its
# surrogate scores the prompt (its scores compare across layers and heads), else the
# method's own "layer".
BUDGET_SHARING_CHOICES = ("auto", *BUDGET_SHARINGS)
DEFAULT_SCORING = "auto"  # measured: docs/methods.md, "Scoring, by measurement"
# Context tokens per reconstruction forward: bounds its activations (vLLM profiles a batch
# of max_num_batched_tokens) and the scratch pages it writes its own K/V into.
DEFAULT_RECONSTRUCT_CHUNK = 512
RECONSTRUCT_CHUNK_RANGE = (16, 8192)
# Prompts, and the new tokens of a turn continuing a cached conversation, this short are kept
# whole: a chat turn's question is gone before it is answered otherwise, for a few tokens per
# head (measured: docs/methods.md, "Scoring, by measurement").
DEFAULT_MIN_PROMPT = 128


class KVCompressionConfigError(ValueError):
    """A compression setting is invalid; the message names the flag and allowed values."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key = key
        self.detail = detail


@dataclass(frozen=True)
class FlagSpec:
    """One user-facing setting: its CLI flag, config key, KVCompressionConfig field, type
    and help text."""

    key: str
    flag: str
    field: str
    type: type
    help: str
    choices: tuple[str, ...] | None = None


FLAG_SPECS: tuple[FlagSpec, ...] = (
    FlagSpec(
        "kv_compression", "--kv-compression", "method", str,
        "KV-cache compression method. 'none' (default) leaves vLLM untouched; "
        + "; ".join(f"'{method.name}' {method.summary}" for method in COMPRESSION_METHODS)
        + ".",
        METHODS,
    ),
    FlagSpec(
        "kv_budget", "--kv-budget", "budget", int,
        "Average tokens kept per KV head per layer after prefill, observation window "
        f"included (the papers' 'KV size': 64, 128, 2048...). Default {DEFAULT_BUDGET} when "
        "a method is set and --kv-compression-ratio is not. Exclusive with "
        "--kv-compression-ratio.",
    ),
    FlagSpec(
        "kv_compression_ratio", "--kv-compression-ratio", "ratio", float,
        "Fraction of each prompt's tokens to evict, 0 < R < 1 (0.875 = keep 1/8). "
        "Exclusive with --kv-budget.",
    ),
    FlagSpec(
        "kv_score_threshold", "--kv-score-threshold", "score_threshold", float,
        "Threshold eviction (after KVzap): every (layer, KV head) keeps each prompt token "
        "whose score s has ln(s) > T, besides its floor (the last --kv-window tokens and "
        "the first --kv-sink-tokens), so how much is kept follows the content. T: a finite "
        "number < 0, e.g. -6. s is the score the selection ranks, after --kv-pooling: with "
        "--kv-scoring reconstruct or expected an attention probability in (0, 1]; with "
        "window the sum of the window queries' probabilities (it may exceed 1); with hybrid "
        "the larger of the two. Alone it replaces the budget: prompts over --kv-min-prompt "
        "are thresholded and admission counts them whole. With --kv-budget or "
        "--kv-compression-ratio that amount caps what passes (split as the method and "
        "--kv-budget-sharing split it; the sinks count against it). Needs a method with "
        "scores. Off by default.",
    ),
    FlagSpec(
        "kv_window", "--kv-window", "window", int,
        "Observation window: the last W prompt tokens whose queries score the rest; "
        f"they are always kept. Default {DEFAULT_WINDOW}; must not exceed --kv-budget.",
    ),
    FlagSpec(
        "kv_pyramid_beta", "--kv-pyramid-beta", "beta", float,
        "PyramidKV slope: the top layer keeps (budget - window) / beta tokens besides the "
        f"window. >= 1; default {DEFAULT_BETA:g}. 1 gives uniform budgets.",
    ),
    FlagSpec(
        "kv_pooling", "--kv-pooling", "pooling", str,
        "1-D pooling of token scores before top-k, so neighbours of important tokens "
        f"survive too. Default {DEFAULT_POOLING}.",
        POOLINGS,
    ),
    FlagSpec(
        "kv_pooling_kernel", "--kv-pooling-kernel", "pooling_kernel", int,
        f"Pooling kernel size, odd, >= 1. Default {DEFAULT_POOLING_KERNEL}.",
    ),
    FlagSpec(
        "kv_sink_tokens", "--kv-sink-tokens", "sink_tokens", int,
        "StreamingLLM: number of initial 'attention sink' tokens always kept. "
        f">= 0; default {DEFAULT_SINK_TOKENS}.",
    ),
    FlagSpec(
        "kv_adakv_floor", "--kv-adakv-floor", "adakv_floor", float,
        "Ada-KV: every KV head first keeps its top ceil(F x its average share) tokens before "
        "the rest of the layer's total goes to the best scores of any head. 0 <= F <= 1 (1: "
        f"no sharing, SnapKV's top-k per head); default {DEFAULT_ADAKV_FLOOR:g}.",
    ),
    FlagSpec(
        "kv_adakv_totals", "--kv-adakv-totals", "adakv_totals", str,
        "Ada-KV: the per-layer totals its heads share: 'pyramid' (PyramidKV's schedule, "
        "shrinking with depth) or 'uniform' (every layer the same). Default "
        f"{DEFAULT_ADAKV_TOTALS}.",
        BUDGET_SHAPES,
    ),
    FlagSpec(
        "kv_budget_sharing", "--kv-budget-sharing", "budget_sharing", str,
        "Where a compressed prompt's budget goes, whatever the method's total: 'layer' keeps "
        "the method's own split (each layer its budget; Ada-KV's heads share their layer's); "
        "'model' lets every layer, KV head and token compete for the whole total by score "
        "(KVzip's pair-level eviction: the heads the context needs keep most of it; needs a "
        "method with scores). 'auto' (default) is 'model' where a reconstruction or its "
        "surrogate scores the prompt (--kv-scoring reconstruct, hybrid or surrogate, and auto "
        "where it resolves to surrogate), 'layer' otherwise.",
        BUDGET_SHARING_CHOICES,
    ),
    FlagSpec(
        "kv_gqa_reduce", "--kv-gqa-reduce", "gqa_reduce", str,
        "How the query heads that share a KV head combine their observation-window "
        "attention into that head's token scores: 'mean' or 'max' (a token one query head "
        f"needs survives even if the others ignore it). Default {DEFAULT_GROUP_REDUCE}.",
        GQA_REDUCES,
    ),
    FlagSpec(
        "kv_decode_policy", "--kv-decode-policy", "decode_policy", str,
        "With --kv-decode-budget: which generated tokens each KV head keeps during long "
        "generations; "
        + "; ".join(f"'{method.name}' {method.summary}" for method in DECODE_METHODS)
        + f". All but window always keep the newest --kv-window generated tokens. Default "
        f"{DEFAULT_DECODE_POLICY}.",
        DECODE_POLICIES,
    ),
    FlagSpec(
        "kv_decode_budget", "--kv-decode-budget", "decode_budget", int,
        "Bound the cache during long generations: generated tokens each KV head keeps, "
        "besides its prompt part (which prompt compression governs and decode eviction never "
        "touches). >= 1, and > --kv-window for every policy but window. Off by default: every "
        "generated token is kept.",
    ),
    FlagSpec(
        "kv_decode_interval", "--kv-decode-interval", "decode_interval", int,
        "With --kv-decode-budget: evict once a KV head holds this many generated tokens more "
        "than the budget, i.e. at most every K decode steps (amortized cost). >= 1; default "
        f"{DEFAULT_DECODE_INTERVAL}.",
    ),
    FlagSpec(
        "kv_decode_score_every", "--kv-decode-score-every", "decode_score_every", int,
        "With --kv-decode-policy h2o: score every K-th decode step only, each scored step "
        "counting K times (the attention mass is sampled, not summed: about K times cheaper, "
        "approximate); 1 (default) scores every step exactly. The other policies ignore it "
        "(anchors scores every step, snapkv and rkv their window's steps). Integer >= 1.",
    ),
    FlagSpec(
        "kv_page_size", "--kv-page-size", "page_size", int,
        "Tokens per page of the per-head paged KV cache (one page holds one KV head of "
        f"one layer). Power of two in [{PAGE_SIZE_RANGE[0]}, {PAGE_SIZE_RANGE[1]}]; "
        f"default {AMX_PAGE_SIZE} on a CPU with AMX tiles running bf16 (vLLM's amx attention "
        f"kernel, which needs pages of multiples of 32) or with fp8 pages on CPU "
        f"(--kv-cache-dtype fp8: a multiple of 32 is required there), else {DEFAULT_PAGE_SIZE}.",
    ),
    FlagSpec(
        "kv_admission_lookahead", "--kv-admission-lookahead", "admission_lookahead", int,
        "Admission without preemption thrash: a prompt starts its prefill only when its "
        "uncompressed pages fit beside the running requests' pages plus their growth over "
        "their next N generated tokens (fewer when their max_tokens or decode budget ends "
        "sooner). 0 admits whenever the pages are free now, as vLLM does. >= 0; default "
        f"{DEFAULT_ADMISSION_LOOKAHEAD}.",
    ),
    FlagSpec(
        "kv_reuse", "--kv-reuse", "reuse", str,
        "Multi-turn reuse: a finished request's compressed cache stays in the pool (evicted "
        "least-recently-used when pages are needed) and a later prompt that starts with its "
        "tokens adopts it and prefills only the rest (vLLM reports them as cached tokens). "
        "'on' (default) or 'off'; --no-enable-prefix-caching also turns it off.",
        REUSE_CHOICES,
    ),
    FlagSpec(
        "kv_scoring", "--kv-scoring", "scoring", str,
        "Which tokens a compressed KV head keeps, whatever the method decides how many: "
        "'surrogate' scores each prompt token by the attention a reconstruction of the "
        "context would pay it, predicted inside the prefill from the token's key and value "
        "by a map made once per model (--kv-surrogate; query-agnostic, no extra pass: later "
        "questions and reused caches can rely on what is kept); 'reconstruct' runs that "
        "reconstruction (KVzip-style, one extra pass over the prompt); 'window' by the "
        "attention of the prompt's last --kv-window tokens (question-aware, no extra pass: "
        "best for one question per prompt); 'hybrid' keeps what ranks high by window or "
        "reconstruct (the extra pass too), 'hybrid-surrogate' by window or surrogate (no "
        "extra pass); 'expected' by the attention the model's queries to "
        "come are expected to pay it, from a query profile made once per model (--kv-profile;"
        " query-agnostic, no extra pass); 'auto' is surrogate where finished caches "
        "are reused (--kv-reuse on) and the model has a surrogate, window otherwise (logged "
        f"at start). Default {DEFAULT_SCORING}.",
        SCORINGS,
    ),
    FlagSpec(
        "kv_reconstruct_chunk", "--kv-reconstruct-chunk", "reconstruct_chunk", int,
        "With --kv-scoring reconstruct or hybrid: prompt tokens reconstructed per extra "
        "forward (each "
        "chunk attends to the whole prompt). Bounds that pass's activations and scratch "
        "pages; capped at --max-num-batched-tokens. Chunks are scheduled work: they count "
        "in a step's token budget, after the decoding requests, while their request waits "
        "to decode. Integer in "
        f"[{RECONSTRUCT_CHUNK_RANGE[0]}, {RECONSTRUCT_CHUNK_RANGE[1]}]; default "
        f"{DEFAULT_RECONSTRUCT_CHUNK}.",
    ),
    FlagSpec(
        "kv_profile", "--kv-profile", "profile", str,
        "With --kv-scoring expected: the model's query profile, made once by "
        "'python -m kvcompress.profile_model MODEL_DIR'. Default: kvcompress_profile.pt in "
        "the model folder. The engine refuses a profile made for another model.",
    ),
    FlagSpec(
        "kv_surrogate", "--kv-surrogate", "surrogate", str,
        "With --kv-scoring surrogate or hybrid-surrogate (or auto): the model's score "
        "surrogate, made once by 'python -m kvcompress.profile_model MODEL_DIR'. Default: "
        "kvcompress_surrogate.pt in the model folder. The engine refuses a surrogate made "
        "for another model.",
    ),
    FlagSpec(
        "kv_min_prompt", "--kv-min-prompt", "min_prompt", int,
        "With --kv-compression-ratio or --kv-score-threshold: prompts of at most N tokens "
        "are kept whole, and so are the new tokens of a turn that continues a cached "
        "conversation (its question would otherwise be compressed before it is answered). "
        "With --kv-budget alone, prompts up to the budget are kept whole instead. >= 0; "
        f"default {DEFAULT_MIN_PROMPT}.",
    ),
)
CONFIG_KEYS = frozenset(spec.key for spec in FLAG_SPECS)
# Settings a single request may override (``SamplingParams.extra_args`` offline,
# ``vllm_xargs`` over HTTP). The page size and admission shape the shared pool: engine-wide.
# The reconstruction chunk sizes scratch pages reserved once for the engine.
# The query profile and the score surrogate are loaded once, at start.
REQUEST_KEYS = CONFIG_KEYS - {"kv_page_size", "kv_admission_lookahead", "kv_reuse",
                              "kv_reconstruct_chunk", "kv_profile", "kv_surrogate"}
_SPEC_BY_KEY = {spec.key: spec for spec in FLAG_SPECS}


@dataclass(frozen=True)
class KVCompressionConfig:
    """Validated compression settings (see FLAG_SPECS for the meaning of each field)."""

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
        return _resolve_scoring(self.scoring)

    @property
    def resolved_budget_sharing(self) -> str:
        """The sharing ``auto`` stands for: model-wide where a reconstruction scores."""
        if self.budget_sharing != "auto":
            return self.budget_sharing
        scored = self.enabled and get_method(self.method).needs_scores
        return "model" if scored and self.resolved_scoring in QUERY_AGNOSTIC_SCORINGS else "layer"

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
        given = {k: _coerce(k, v) for k, v in values.items() if k in CONFIG_KEYS and v is not None}
        fields = {_SPEC_BY_KEY[key].field: value for key, value in given.items()}
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
        explicit_keys = explicit_keys or set()
        if self.method not in METHODS:
            _fail("kv_compression", f"got {self.method!r}; allowed: {', '.join(METHODS)}")
        if "kv_budget" in explicit_keys and "kv_compression_ratio" in explicit_keys:
            raise KVCompressionConfigError(
                "--kv-budget and --kv-compression-ratio are exclusive: give one of them "
                f"(got --kv-budget {self.budget} and --kv-compression-ratio {self.ratio})"
            )
        if self.budget is not None and self.budget <= 0:
            _fail("kv_budget", f"got {self.budget}; allowed: an integer >= 1")
        if self.ratio is not None and not (0.0 < self.ratio < 1.0):
            _fail("kv_compression_ratio", f"got {self.ratio}; allowed: 0 < R < 1")
        if self.window < 1:
            _fail("kv_window", f"got {self.window}; allowed: an integer >= 1")
        if self.budget is not None and self.window > self.budget:
            _fail(
                "kv_window",
                f"got {self.window}, larger than --kv-budget {self.budget}; "
                f"allowed: 1 <= window <= budget",
            )
        if not (self.beta >= 1.0) or math.isinf(self.beta):
            _fail("kv_pyramid_beta", f"got {self.beta}; allowed: a finite number >= 1")
        if self.pooling not in POOLINGS:
            _fail("kv_pooling", f"got {self.pooling!r}; allowed: {', '.join(POOLINGS)}")
        if self.pooling_kernel < 1 or self.pooling_kernel % 2 == 0:
            _fail("kv_pooling_kernel", f"got {self.pooling_kernel}; allowed: an odd integer >= 1")
        if self.sink_tokens < 0:
            _fail("kv_sink_tokens", f"got {self.sink_tokens}; allowed: an integer >= 0")
        if not (0.0 <= self.adakv_floor <= 1.0):
            _fail("kv_adakv_floor", f"got {self.adakv_floor}; allowed: a number in [0, 1]")
        if self.adakv_totals not in BUDGET_SHAPES:
            _fail("kv_adakv_totals",
                  f"got {self.adakv_totals!r}; allowed: {', '.join(BUDGET_SHAPES)}")
        if self.budget_sharing not in BUDGET_SHARING_CHOICES:
            _fail("kv_budget_sharing", f"got {self.budget_sharing!r}; allowed: "
                  f"{', '.join(BUDGET_SHARING_CHOICES)}")
        if (self.budget_sharing == "model" and self.enabled
                and not get_method(self.method).needs_scores):
            _fail("kv_budget_sharing", f"'model' shares the budget by score and "
                  f"{self.method} scores no tokens; allowed with it: auto, layer")
        self._validate_threshold()
        if self.gqa_reduce not in GQA_REDUCES:
            _fail("kv_gqa_reduce", f"got {self.gqa_reduce!r}; allowed: {', '.join(GQA_REDUCES)}")
        self._validate_decode()
        if self.reuse not in REUSE_CHOICES:
            _fail("kv_reuse", f"got {self.reuse!r}; allowed: {', '.join(REUSE_CHOICES)}")
        if self.min_prompt < 0:
            _fail("kv_min_prompt", f"got {self.min_prompt}; allowed: an integer >= 0")
        if self.admission_lookahead < 0:
            _fail("kv_admission_lookahead",
                  f"got {self.admission_lookahead}; allowed: an integer >= 0")
        if self.scoring not in SCORINGS:
            _fail("kv_scoring", f"got {self.scoring!r}; allowed: {', '.join(SCORINGS)}")
        low, high = RECONSTRUCT_CHUNK_RANGE
        if not (low <= self.reconstruct_chunk <= high):
            _fail("kv_reconstruct_chunk",
                  f"got {self.reconstruct_chunk}; allowed: an integer in [{low}, {high}]")
        low, high = PAGE_SIZE_RANGE
        size = self.page_size
        if size is not None and (not (low <= size <= high) or size & (size - 1)):
            _fail("kv_page_size", f"got {size}; allowed: a power of two in [{low}, {high}]")

    def _validate_threshold(self) -> None:
        threshold = self.score_threshold
        if threshold is None:
            return
        if not (math.isfinite(threshold) and threshold < 0):
            _fail("kv_score_threshold",
                  f"got {threshold}; allowed: a finite number < 0 (the natural log of a "
                  "score: reconstruction scores are probabilities, at most 1), e.g. -6")
        if self.enabled and not get_method(self.method).needs_scores:
            scored = ", ".join(m.name for m in COMPRESSION_METHODS if m.needs_scores)
            _fail("kv_score_threshold",
                  f"got {threshold} with --kv-compression {self.method}, which scores no "
                  f"tokens; allowed with: {scored}")

    def _validate_decode(self) -> None:
        if self.decode_policy not in DECODE_POLICIES:
            _fail("kv_decode_policy",
                  f"got {self.decode_policy!r}; allowed: {', '.join(DECODE_POLICIES)}")
        if self.decode_interval < 1:
            _fail("kv_decode_interval", f"got {self.decode_interval}; allowed: an integer >= 1")
        if self.decode_score_every < 1:
            _fail("kv_decode_score_every",
                  f"got {self.decode_score_every}; allowed: an integer >= 1")
        scored = get_decode_method(self.decode_policy).needs_scores
        if self.decode_budget is None:
            if scored:
                scored_names = " or ".join(m.name for m in DECODE_METHODS if m.needs_scores)
                _fail("kv_decode_policy",
                      f"got {self.decode_policy!r} without --kv-decode-budget; allowed: "
                      f"--kv-decode-policy {scored_names} together with --kv-decode-budget N")
            return
        if self.decode_budget < 1:
            _fail("kv_decode_budget", f"got {self.decode_budget}; allowed: an integer >= 1")
        if scored and self.decode_budget <= self.window:
            # The newest `window` generated tokens are always kept: a budget that holds only
            # them leaves nothing to choose by score (that is --kv-decode-policy window).
            _fail("kv_decode_budget",
                  f"got {self.decode_budget} with --kv-decode-policy {self.decode_policy} and "
                  f"--kv-window {self.window}; allowed: an integer > --kv-window (the newest "
                  "window tokens are always kept, the rest are chosen by score)")

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
        if not self.enabled:
            raise KVCompressionConfigError(
                "per-request kv_* settings need a server started with --kv-compression"
            )
        engine_only = sorted(set(overrides) & (CONFIG_KEYS - REQUEST_KEYS))
        if engine_only:
            raise KVCompressionConfigError(
                f"per-request setting rejected: {engine_only} can only be set for the "
                "whole engine (flag or additional_config)"
            )
        if str(overrides.get("kv_scoring", "")).lower() == "auto":
            overrides["kv_scoring"] = self.resolved_scoring  # the engine's own choice
        asked = _resolve_scoring(str(overrides.get("kv_scoring", "")).lower())
        if asked in RECONSTRUCTING_SCORINGS and not self.reserves_reconstruction:
            raise KVCompressionConfigError(
                f"invalid per-request setting 'kv_scoring': {asked} needs the scratch pages "
                "of a server started with --kv-scoring reconstruct or hybrid (this one runs "
                f"--kv-scoring {self.scoring}); allowed: {self.scoring}", "kv_scoring",
                f"allowed: {self.scoring}")
        if asked in SURROGATE_SCORINGS and not self.loads_surrogate:
            raise KVCompressionConfigError(
                f"invalid per-request setting 'kv_scoring': {asked} needs the score surrogate "
                "of a server started with --kv-scoring surrogate, hybrid-surrogate or auto "
                f"with a surrogate (this one runs --kv-scoring {self.scoring}); allowed: "
                f"window or {self.scoring}", "kv_scoring", f"allowed: window or {self.scoring}")
        if asked == "expected" and not self.loads_profile:
            raise KVCompressionConfigError(
                "invalid per-request setting 'kv_scoring': expected needs the query profile "
                "of a server started with --kv-scoring expected (this one runs --kv-scoring "
                f"{self.scoring}); allowed: {self.scoring}", "kv_scoring",
                f"allowed: {self.scoring}")
        merged = self.to_mapping()
        if "kv_budget" in overrides or "kv_compression_ratio" in overrides:
            merged["kv_budget"] = merged["kv_compression_ratio"] = None
        merged.update(overrides)
        if "kv_decode_budget" in overrides and overrides["kv_decode_budget"] is None \
                and "kv_decode_policy" not in overrides:
            # No decode eviction for this request: the engine's decode policy has nothing to
            # pick (and a scoring one would be refused without a budget).
            merged["kv_decode_policy"] = DEFAULT_DECODE_POLICY
        resolved = KVCompressionConfig.from_mapping(merged, source="request")
        self._check_decode_score_capacity(resolved)
        return resolved

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

    def _check_decode_score_capacity(self, request: KVCompressionConfig) -> None:
        """A request whose decode policy scores must fit its accumulators in the engine's
        reserve: budget + interval at most the engine's, and anchors' second accumulator
        only where the engine keeps one."""
        eviction = request.decode_eviction
        if eviction is None or not eviction.method.needs_scores:
            return
        capacity = self.decode_score_capacity
        if capacity and request.decode_score_accumulators > self.decode_score_accumulators:
            detail = (f"got {eviction.method.name} on a server started with "
                      f"--kv-decode-policy {self.decode_policy}; allowed: a policy with one "
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


def _resolve_scoring(scoring: str) -> str:
    """``auto`` not resolved at start (engine_args.resolve_auto_scoring): window."""
    return "window" if scoring == "auto" else scoring


def _coerce(key: str, value: Any) -> Any:
    spec = _SPEC_BY_KEY[key]
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


def _fail(key: str, detail: str) -> None:
    spec = _SPEC_BY_KEY[key]
    raise KVCompressionConfigError(
        f"invalid {spec.flag} (additional_config '{key}'): {detail}", key, detail
    )
