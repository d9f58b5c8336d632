"""Where a result comes from (command, commit, machine, date, as its JSON recorded them, or
"not recorded") and whether it is stale: the ledger of changes that alter what a benchmark
measures, and the rule that applies it.

The rule, mechanical and decided by the JSON and this file alone (so ``--check`` gives the
same answer on every checkout):

1. A result whose JSON records no date or no command is stale: it cannot be placed against
   the ledger or reproduced as it ran.
2. A result is stale when a ledger entry for its section is dated after the run started
   (``machine.date``, taken when the run starts), unless the entry names the result as
   measured on that change before it was committed (``measured_by``). An entry may be
   limited to runs of some dtypes (``dtypes``: the AMX page layout only picks bf16 pages)
   and to results of some benchmarks (``benchmarks``, the JSON's ``benchmark``: a section
   may show results of a benchmark the change does not touch), or to some results by name
   or section (``results``: one workload among a section's others).

A change that alters what a benchmark measures (a default, an algorithm, the work per step)
adds an entry here; docs/results.md then marks every older result of the sections it names.
Re-running the benchmark (its JSON gets a newer date) clears the marker.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.report import ISA_FLAGS

NOT_RECORDED = "not recorded"

# Sections whose results come from a vLLM engine running the embedded model (what a change
# to the engine's defaults can move).
ENGINE_SECTIONS = (
    "throughput", "tensor_parallel", "memory_sweep", "long_generation", "paging_overhead",
    "decode_fidelity", "decode_recall", "quality", "compression_cost", "hybrid_memory",
    "multi_turn", "multi_turn_recall", "shared_context", "offload_tier", "handoff",
)
COMPRESSED_THROUGHPUT = ("throughput", "tensor_parallel", "memory_sweep", "long_generation")


@dataclass(frozen=True)
class Change:
    """A change that alters what the results of ``sections`` measure."""

    commit: str
    since: str  # ISO time of the commit: runs started before it measured the code before it
    what: str
    sections: tuple[str, ...]
    dtypes: tuple[str, ...] = ()  # only runs in these dtypes (empty: every run)
    measured_by: tuple[str, ...] = ()  # results run on this change before it was committed
    benchmarks: tuple[str, ...] = ()  # only results of these benchmarks (empty: every one)
    # only these results, or every result of these sections (empty: every result)
    results: tuple[str, ...] = ()

    @property
    def time(self) -> datetime.datetime:
        return parse_time(self.since)

    def applies(self, section: str, name: str, dtype: str | None,
                started: datetime.datetime, benchmark: str | None = None) -> bool:
        return (section in self.sections and started < self.time
                and name not in self.measured_by
                and (not self.dtypes or dtype in self.dtypes)
                and (not self.benchmarks or benchmark in self.benchmarks)
                and (not self.results or name in self.results or section in self.results))


CHANGES: tuple[Change, ...] = (
    Change("d81c81a", "2026-12-01T17:04:11+00:00",
           "admission by future page peak (`--kv-admission-lookahead`): compressed requests "
           "are no longer preempted and recomputed uncompressed",
           (*COMPRESSED_THROUGHPUT, "paging_overhead")),
    Change("f76a1c6", "2026-12-01T20:57:18+00:00",
           "selection defaults: max pooling kernel 15 (was 7), PyramidKV slope 2 (was 20); "
           "the same tokens per request, spread differently over layers",
           (*COMPRESSED_THROUGHPUT, "quality", "attention_analysis", "compression_cost",
            "kvpress_reference"),
           # its working tree ran the default-profile quality run (b9797b9 says so)
           measured_by=("quality.json",)),
    Change("5d3feec", "2026-12-02T09:36:32+00:00",
           "decode scores (`h2o`, `snapkv`) read K pages with one index_select: the same "
           "sums in another order, the scoring pass about twice as fast",
           ("long_generation", "decode_fidelity", "decode_recall")),
    Change("cc7438b", "2026-12-02T14:31:07+00:00",
           "step page tables by width class kept between steps (7692af2, 1b1b506) and the "
           "admission check over the running batch at once: less host work per step",
           ("step_overhead", "paging_overhead")),
    Change("c1e03b8", "2026-12-02T14:48:16+00:00",
           "AMX page layout: `--kv-page-size` 32 on CPUs with AMX tiles in bf16, where "
           "vLLM's amx attention kernel reads the pages (prefill attention ~3.2x faster)",
           ENGINE_SECTIONS, dtypes=("bfloat16",)),
    Change("de8a03a", "2026-12-03T08:01:21+00:00",
           "reuse: an adoption copies a cached entry only from free pages, else takes it "
           "over, so no adoption evicts another conversation's entry",
           ("multi_turn", "multi_turn_recall")),
    Change("3be77cf", "2026-12-03T08:29:06+00:00",
           "`--kv-scoring` default: with reuse on (the default with prefix caching) each "
           "compressed prompt is scored by `hybrid` (window + a reconstruction pass; `auto` "
           "since c8323d3), where these runs scored by the window alone",
           ("multi_turn", "multi_turn_recall")),
    Change("5fdd555", "2026-12-03T09:03:21+00:00",
           "hybrid scoring pools each source before the rank union (pooling after it spread "
           "either source's top and lost single-question retrieval)",
           ("shared_context",)),
    Change("6fdf583", "2026-12-03T14:19:13+00:00",
           "decode scores (`h2o`, `snapkv`): index tensors built once per step, a fixed "
           "handful of batched operations per layer (the pass ~3.5x cheaper); their "
           "accumulators reserved out of the KV memory (fewer pages for a scored decode "
           "policy)", ("long_generation",)),
    Change("5b9d2d3", "2026-12-03T14:50:52+00:00",
           "`--kv-budget-sharing auto`: a prompt a reconstruction scored (`reconstruct`, "
           "`hybrid`, and `auto` with reuse on) shares its total model-wide instead of each "
           "method's per-layer split",
           ("shared_context", "multi_turn", "multi_turn_recall", "quality_question_outside")),
    Change("3038c88", "2026-12-04T05:40:18+00:00",
           "prefix caching on, vLLM's default, in every benchmark engine (was off unless a "
           "benchmark asked; now `--no-prefix-caching`): kvcompress's `--kv-reuse` on with it, "
           "so `--kv-scoring auto` is `hybrid` (a reconstruction pass per compressed prompt) "
           "and `--kv-budget-sharing auto` is `model`; vanilla reuses repeated prefixes",
           (*COMPRESSED_THROUGHPUT, "paging_overhead", "fp8_pages", "decode_fidelity",
            "decode_recall", "quality", "quality_tuning", "quality_budget_sharing",
            "quality_question_outside", "hybrid_memory"),
           # the engines it changed (quality_tuning also shows transformers-only analyses)
           benchmarks=("throughput", "decode_fidelity", "decode_recall", "quality",
                       "hybrid_memory")),
    Change("a937a9e", "2026-12-04T05:52:30+00:00",
           "`--kv-scoring auto` with reuse on is a score surrogate inside the prefill (no "
           "reconstruction pass; `hybrid-surrogate`, with the window, until the next entry) "
           "where the model has a surrogate, else `window`: was `hybrid` (a reconstruction "
           "pass per compressed prompt)",
           (*COMPRESSED_THROUGHPUT, "paging_overhead", "fp8_pages", "quality",
            "quality_budget_sharing", "quality_question_outside", "compression_cost",
            "multi_turn", "multi_turn_recall", "shared_context", "shared_prefix")),
    Change("c2a7336", "2026-12-04T06:22:13+00:00",
           "`--kv-scoring auto` with reuse on and a surrogate is `surrogate` alone (was "
           "`hybrid-surrogate`: its union with the window)",
           (*COMPRESSED_THROUGHPUT, "paging_overhead", "fp8_pages", "quality",
            "quality_budget_sharing", "quality_question_outside", "compression_cost",
            "multi_turn", "multi_turn_recall", "shared_context", "shared_prefix"),
           # the runs that chose it: their `+scoring=surrogate` rows are what auto now runs
           measured_by=("quality_surrogate.json", "shared_context_surrogate.json")),
    Change("9bbdc34", "2026-12-04T11:09:20+00:00",
           "admission counts the worst spread of a budget shared model-wide (each row keeps "
           "at least its window, in whole pages) and each tensor-parallel rank's own pages: "
           "fewer requests admitted at once where `--kv-budget-sharing auto` is `model` (the "
           "surrogate's and a reconstruction's scores)",
           (*COMPRESSED_THROUGHPUT, "multi_turn", "multi_turn_recall", "shared_prefix")),
    Change("242d21f", "2026-12-04T11:40:34+00:00",
           "prefix-cache entries that waiting requests will adopt are evicted last, the one "
           "needed latest first (was least recently used first)",
           ("multi_turn", "multi_turn_recall", "shared_prefix")),
    Change("aa6b849", "2026-12-04T13:57:26+00:00",
           "pages are reference-counted and an adopter reads a cached entry's whole pages in "
           "place, copying one partial page a row (was: a copy of the whole entry, or a "
           "handover when free pages could not take the copy)",
           ("multi_turn", "multi_turn_recall", "shared_prefix")),
    Change("f251d03", "2026-12-04T14:32:36+00:00",
           "waiting requests that share a prefix compute and compress it once (a segment "
           "request of its own) and wait for it, then read it in place (was: each prefilled "
           "and compressed its own copy)",
           ("shared_prefix", "shared_context"),
           measured_by=("shared_prefix_segments.json", "shared_prefix_system_prompt.json",
                        "shared_context_segments.json")),
    Change("0d65399", "2026-12-04T17:20:42+00:00",
           "every waiting request that starts with a segment being computed waits for it (was: "
           "only the first 64 the grouping scans; the rest prefilled the prefix again)",
           ("shared_prefix", "serve_prefix"),
           measured_by=("shared_prefix_system_prompt.json",)),
    Change("ec0203e", "2026-12-04T17:31:40+00:00",
           "an adopter's full-sequence admission check counts its adopted prefix as cached "
           "(was: as pages it needed, so a second reader of a held entry was admitted only if "
           "the pool could take the prefix again)",
           ("throughput", "multi_turn", "multi_turn_recall", "shared_prefix", "serve_prefix"),
           measured_by=("shared_prefix_system_prompt.json",)),
    Change("4ddabc0", "2026-12-04T17:39:11+00:00",
           "the surrogate scores a segment request's tokens at their distance from its readers' "
           "questions (was: from the segment's own end)",
           ("shared_prefix", "shared_context", "serve_prefix"),
           measured_by=("shared_context_segments.json", "shared_prefix_system_prompt.json")),
    Change("27de419", "2026-12-04T21:06:33+00:00",
           "serve_prefix's prefill tokens count kvcompress's segment requests (was: vLLM's "
           "prompt counters only, which do not see them)",
           ("serve_prefix",)),
    Change("b526c69", "2026-12-05T00:00:54+00:00",
           "a shared prefix's segment is filed uncompressed and compacted in place once the "
           "readers admitted with it prefilled over all of it (was: compacted before anyone "
           "read it); an adopter scored by the surrogate alone holds and reserves scores of "
           "its new tokens only (was: of its whole prompt)",
           ("multi_turn", "multi_turn_recall", "shared_prefix", "shared_context",
            "serve_prefix"),
           measured_by=("shared_context_segments.json",)),
    Change("8286544", "2026-12-05T00:37:26+00:00",
           "the scoring gate counts only readers of a shared prefix still uncompressed at "
           "their own tokens, other adopters at their whole prompt again (b526c69 counted "
           "every surrogate-scored adopter at its own tokens)",
           ("multi_turn", "multi_turn_recall", "shared_prefix", "serve_prefix"),
           # segment readers are counted as in b526c69's runs
           measured_by=("shared_context_segments.json",)),
    Change("9d7e4be", "2026-12-05T03:47:26+00:00",
           "a shared prefix's segment ends on the last whole 16-token block of the tokens its "
           "readers share (was: at their exact common prefix), and a request sharing less "
           "than a pending segment waits for its compaction before a segment of its own",
           ("shared_prefix", "shared_context", "serve_prefix", "throughput"),
           results=("shared_prefix", "shared_context", "serve_prefix",
                    "throughput_system_prompt.json")),
    Change("290fa77", "2026-12-05T07:15:24+00:00",
           "a prompt that completes while nothing else runs or waits is compacted a step "
           "late, and what the requests waiting by then share with it is forked off its "
           "pages as a pending segment (was: compacted at once, the prefix computed again "
           "by a segment request for the others)",
           ("shared_prefix", "serve_prefix"),
           results=("serve_prefix", "shared_prefix_system_prompt.json"),
           # its working tree (438611f+dirty) ran the prefix_repetition run
           measured_by=("serve_prefix/serve_prefix_readme_command.json",)),
    Change("6c5a276", "2026-12-05T10:52:44+00:00",
           "a shared prefix's segment ends on whole pages as well as whole 16-token blocks "
           "(was: 16-token blocks only, which on 32-token pages left a partial page a row that "
           "readers copied and the filed segment was evicted for)",
           # only 32-token pages change: bf16 on AMX (no sharing result ran on fp8 pages)
           ("shared_prefix", "shared_context", "serve_prefix", "throughput"),
           dtypes=("bfloat16",),
           results=("shared_prefix", "shared_context_segments.json", "serve_prefix",
                    "throughput_system_prompt.json")),
    Change("b228a21", "2026-12-07T03:55:27+00:00",
           "issue 51: a request gets a second shared segment only if longer than one computed "
           "for it, a hold for a shared prefix lasts at most --kv-sharing-wait steps, and the "
           "scheduler's lookups and grouping are remembered between steps (pending segments "
           "know their pages by id since 4617157: only nested prefixes, which died before)",
           ("shared_prefix", "shared_context", "serve_prefix", "throughput"),
           results=("shared_prefix", "shared_context_segments.json", "serve_prefix",
                    "throughput_system_prompt.json", "throughput_defaults.json")),
    Change("831c138", "2026-12-07T06:48:35+00:00",
           "issue 51: a request held for a shared prefix is skipped by vLLM's waiting loop in "
           "its place (was: taken out of the queue and put back), and parked or deferred "
           "requests stay in running with no tokens (was: taken out of it); the same holds "
           "and grants, but the queue's order after a step with holds and preemptions differs",
           ("shared_prefix", "shared_context", "serve_prefix", "throughput"),
           results=("shared_prefix", "shared_context_segments.json", "serve_prefix",
                    "throughput_system_prompt.json", "throughput_defaults.json",
                    "shared_context_later_turns.json")),
    Change("0beef87", "2026-12-07T10:30:18+00:00",
           "issue 52: the embedded model's score surrogate (what `auto` scores with, reuse on) "
           "is refitted with squared terms on four kinds of text (synthetic, prose, code, "
           "chat) by a one-forward teacher: what `surrogate` and `auto` keep differs; speed "
           "does not move (4D + 5 multiply-adds per token and head instead of 2D + 5)",
           ("shared_context", "quality_budget_sharing"),
           measured_by=("shared_context_natural.json", "shared_context_later_turns.json"),
           results=("shared_context_surrogate.json", "shared_context_segments.json",
                    "shared_context_later_turns.json", "shared_context_natural.json",
                    "quality_surrogate.json", "quality_threshold.json")),
)


def parse_time(text: str) -> datetime.datetime:
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.astimezone(datetime.timezone.utc)


def show_time(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class Provenance:
    """What a result's JSON says about its run; None where it says nothing."""

    command: str | None
    commit: str | None
    started: datetime.datetime | None
    cpu_model: str | None
    cpu_count: int | None
    isa: tuple[str, ...] | None
    gpu: str | None
    dtype: str | None
    versions: str | None
    runtime_s: float | None
    benchmark: str | None = None  # the JSON's ``benchmark``: which one wrote it

    @classmethod
    def of(cls, report: Mapping[str, Any]) -> Provenance:
        machine = report.get("machine") or {}
        settings = report.get("settings") or {}
        date = machine.get("date") or report.get("date")
        isa = machine.get("isa")
        versions = ", ".join(f"{name} {machine[name]}" for name in ("vllm", "torch")
                             if machine.get(name))
        runtime = report.get("runtime_s", report.get("seconds"))
        return cls(
            command=report.get("command"),
            commit=machine.get("commit") or report.get("commit"),
            started=parse_time(date) if date else None,
            cpu_model=machine.get("cpu_model"),
            cpu_count=machine.get("cpu_count"),
            isa=tuple(isa) if isa is not None else None,
            gpu=machine.get("gpu"),
            dtype=settings.get("dtype"),
            versions=versions or None,
            runtime_s=float(runtime) if isinstance(runtime, (int, float)) else None,
            benchmark=report.get("benchmark"),
        )

    @property
    def machine(self) -> str:
        """CPU model, cores, ISA, GPU, dtype and versions, each "not recorded" if missing."""
        if self.cpu_model is None:
            return NOT_RECORDED
        cores = f" ({self.cpu_count} CPUs)" if self.cpu_count else ""
        if self.isa is None:
            isa = f"ISA {NOT_RECORDED}"
        else:
            isa = "ISA " + (" ".join(self.isa) or "none of " + " ".join(ISA_FLAGS))
        parts = [f"{self.cpu_model}{cores}", isa]
        if self.gpu:
            parts.append(self.gpu)
        if self.dtype:
            parts.append(self.dtype)
        if self.versions:
            parts.append(self.versions)
        return ", ".join(parts)

    @property
    def short_machine(self) -> str:
        """The CPU model and dtype, for the README's headline table."""
        model = (self.cpu_model or NOT_RECORDED).replace("(R)", "")
        model = " ".join(model.replace("Processor", "").split())
        return f"{model}, {self.dtype}" if self.dtype else model


def stale_reasons(section: str, name: str, report: Mapping[str, Any]) -> list[str]:
    """Why the result ``name`` (its path under benchmarks/results) of ``section`` is stale;
    empty when it is current."""
    run = Provenance.of(report)
    reasons = []
    if run.started is None:
        reasons.append("its JSON records no date (nor machine): it cannot be placed against "
                       "the changes since")
    if run.command is None:
        reasons.append("its JSON records no command")
    if run.started is not None:
        reasons.extend(
            f"ran before {change.commit} ({show_time(change.time)}): {change.what}"
            for change in CHANGES
            if change.applies(section, name, run.dtype, run.started, run.benchmark))
    return reasons
