"""The flag table: every user-facing setting's CLI flag, ``additional_config`` key, type,
choices, default, range and help, and how ``vllm serve --help`` groups them.

Every setting has a CLI flag (``--kv-budget``) and an ``additional_config`` key with the
same name in snake case (``kv_budget``). The few a user sets (``USER_FLAGS``: the method,
the budget or ratio, the decode budget) come first; the rest are ``TUNING_FLAGS``, with
measured defaults. The README's flags tables list the same two groups, row for row
(tests/test_readme.py).

No vLLM imports. Method names, their help and the policy defaults come from
``kvcompress.policies``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.policies import COMPRESSION_METHODS
from kvcompress.policies import METHODS as POLICY_METHODS
from kvcompress.policies.decode import DECODE_METHODS, DECODE_POLICIES
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
# Schedules a waiting request is held for a shared prefix (a segment being computed, or one
# filed uncompressed that it cannot adopt whole until it is compacted) before it goes on with
# a copy of its own. A schedule is one engine step: about 30-300 ms on a CPU here.
DEFAULT_SHARING_WAIT = 256
REUSE_CHOICES = ("on", "prompts", "off")
# Which prompt tokens a compressed head keeps is decided by scores: "window" (the prompt's
# last queries, question-aware), "reconstruct" (how much a reconstruction of the context
# attends to each token, query-agnostic: what later questions about it can rely on, at the
# cost of an extra pass), "hybrid" (the union of both rankings), "surrogate" (the
# reconstruction's scores predicted inside the prefill by a map made once per model,
# --kv-surrogate: query-agnostic with no extra pass), "hybrid-surrogate" (the union of the
# window's and the surrogate's rankings) or "expected" (the attention the model's average
# later query pays a key, from a query profile made once per model). "auto" is resolved when
# the engine starts (settings/resolution.py): surrogate where a kept cache can serve later
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


@dataclass(frozen=True)
class FlagGroup:
    """Flags shown together: one argument group of ``vllm serve --help`` (listed by
    ``--help=<title>``) and one table of the README."""

    title: str
    description: str
    specs: tuple[FlagSpec, ...]


# What to compress and how much: the settings a user sets.
_USER_SPECS: tuple[FlagSpec, ...] = (
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
        "kv_decode_budget", "--kv-decode-budget", "decode_budget", int,
        "Bound the cache during long generations: generated tokens each KV head keeps, "
        "besides its prompt part (which prompt compression governs and decode eviction never "
        "touches). >= 1, and > --kv-window for every policy but window. Off by default: every "
        "generated token is kept.",
    ),
)

# The amount and selection of prompt tokens, besides the budget or ratio.
_PROMPT_SELECTION_SPECS: tuple[FlagSpec, ...] = (
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
        "kv_min_prompt", "--kv-min-prompt", "min_prompt", int,
        "With --kv-compression-ratio or --kv-score-threshold: prompts of at most N tokens "
        "are kept whole, and so are the new tokens of a turn that continues a cached "
        "conversation (its question would otherwise be compressed before it is answered). "
        "With --kv-budget alone, prompts up to the budget are kept whole instead. >= 0; "
        f"default {DEFAULT_MIN_PROMPT}.",
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
)

# What scores the prompt tokens, and the passes and files that scoring needs.
_SCORING_SPECS: tuple[FlagSpec, ...] = (
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
        "'python -m kvcompress.profile_model MODEL' (a folder or a hub id). Default: the "
        "user's kvcompress cache (KVCOMPRESS_CACHE), then kvcompress_profile.pt in the model "
        "folder. The engine refuses a profile made for another model.",
    ),
    FlagSpec(
        "kv_surrogate", "--kv-surrogate", "surrogate", str,
        "With --kv-scoring surrogate or hybrid-surrogate (or auto): the model's score "
        "surrogate, made once by 'python -m kvcompress.profile_model MODEL' (a folder or a hub "
        "id). Default: the user's kvcompress cache (KVCOMPRESS_CACHE), then "
        "kvcompress_surrogate.pt in the model folder. The engine refuses a surrogate made "
        "for another model.",
    ),
)

# Which generated tokens a decode budget keeps, and how often they are scored and evicted.
_DECODE_SPECS: tuple[FlagSpec, ...] = (
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
)

# The shared page pool: page size, admission, reuse of finished requests' caches.
_POOL_SPECS: tuple[FlagSpec, ...] = (
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
        "kv_sharing_wait", "--kv-sharing-wait", "sharing_wait", int,
        "The longest a waiting request is held for a shared prefix, in engine steps: while "
        "a segment its prompt starts with is computed, or while one it shares only part of "
        "waits to be compacted. After that it prefills and compresses its own copy. >= 1; "
        f"default {DEFAULT_SHARING_WAIT}.",
    ),
    FlagSpec(
        "kv_reuse", "--kv-reuse", "reuse", str,
        "Multi-turn reuse: a finished request's compressed cache stays in the pool (evicted "
        "least-recently-used when pages are needed) and a later prompt that starts with its "
        "tokens adopts it and prefills only the rest (vLLM reports them as cached tokens). "
        "'on' (default): the cache of the prompt and the answer; 'prompts': of the prompt "
        "only, so the next turn computes the answer again and compresses it with its own "
        "new tokens (smaller caches and offload-tier writes, a few more tokens to prefill); "
        "'off'. --no-enable-prefix-caching also turns it off.",
        REUSE_CHOICES,
    ),
)

USER_FLAGS = FlagGroup(
    "kvcompress",
    "Per-head paged KV-cache compression (PyramidKV, SnapKV, StreamingLLM, Ada-KV): the "
    "method, how much each prompt keeps, and the decode budget; the rest are under "
    "--help=kvcompress-tuning. Each flag may also be given as an --additional-config key of "
    "the same name in snake case; a flag wins over the key. With a method set, "
    "--kv-offloading-size GiB (backend native) is kvcompress's own offload tier: conversations' "
    "compressed caches evicted from the pool go to host memory and are loaded back for the "
    "next turn; KV connectors (--kv-transfer-config) and --kv-offloading-backend lmcache are "
    "refused (they move whole vLLM blocks, not per-head pages).",
    _USER_SPECS,
)
TUNING_FLAGS = FlagGroup(
    "kvcompress-tuning",
    "Tuning of kvcompress's compression, with measured defaults: which prompt tokens are "
    "scored and kept, decode eviction, and the shared page pool. Each flag may also be given "
    "as an --additional-config key of the same name in snake case; a flag wins over the key.",
    _PROMPT_SELECTION_SPECS + _SCORING_SPECS + _DECODE_SPECS + _POOL_SPECS,
)
FLAG_GROUPS = (USER_FLAGS, TUNING_FLAGS)
FLAG_SPECS: tuple[FlagSpec, ...] = tuple(spec for group in FLAG_GROUPS for spec in group.specs)
CONFIG_KEYS = frozenset(spec.key for spec in FLAG_SPECS)
# Settings a single request may override (``SamplingParams.extra_args`` offline,
# ``vllm_xargs`` over HTTP). The page size and admission shape the shared pool: engine-wide.
# The reconstruction chunk sizes scratch pages reserved once for the engine.
# The query profile and the score surrogate are loaded once, at start.
REQUEST_KEYS = CONFIG_KEYS - {"kv_page_size", "kv_admission_lookahead", "kv_reuse",
                              "kv_sharing_wait",
                              "kv_reconstruct_chunk", "kv_profile", "kv_surrogate"}
SPEC_BY_KEY = {spec.key: spec for spec in FLAG_SPECS}

