"""What docs/results.md shows: its sections (which result files, rendered by which of the
benchmarks' own table functions) and the README's headline rows.

Every JSON under benchmarks/results belongs to exactly one section. A section's prose is
benchmarks/results/notes/<key>.md; a line ``<!-- result: NAME -->`` there places that
result's table and provenance, the others follow the prose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks import (
    handoff,
    memory_sweep,
    serve_prefix,
    shared_context,
    shared_prefix,
    streaming_latency,
    throughput,
)
from benchmarks.multi_turn import report as multi_turn_report
from benchmarks.quality import report as quality_report
from benchmarks.report import RESULTS_DIR, with_prefix_caching
from benchmarks.studies import (
    compression_cost,
    decode_fidelity,
    hybrid_memory,
    scheduler_cost,
    step_overhead,
    surrogate_fit,
)

Report = Mapping[str, Any]


@dataclass(frozen=True)
class Section:
    key: str  # its notes file and the name the ledger (provenance.CHANGES) uses
    title: str
    files: tuple[str, ...]  # under benchmarks/results; a trailing "/*.json" takes a folder
    # the benchmark's table function; None: every result is a retired study's (RETIRED),
    # whose table is frozen
    render: Callable[[Report], str] | None = None


# ----------------------------------------------------------------------------- retired studies
@dataclass(frozen=True)
class RetiredStudy:
    """A study deleted once it had answered its question. Its results stay in the doc: each
    table as the study's own code rendered it, frozen in FROZEN_DIR/<result>.md (the result's
    name, ``.json`` -> ``.md``), with the commit that produced the result and the last commit
    whose tree still holds the study (``git show LAST:PATH``)."""

    path: str  # the deleted module, from the repository root
    question: str  # what it answered, and why that is no longer live
    last_commit: str  # the last commit that has ``path``
    produced_by: Mapping[str, str]  # result file -> the commit of the code that produced it


FROZEN_DIR = RESULTS_DIR / "frozen"
_BEFORE_RETIREMENT = "74d65df"  # main when the studies were split off (issue 42)

RETIRED: tuple[RetiredStudy, ...] = (
    RetiredStudy(
        "benchmarks/attention_analysis.py",
        "per-layer attention entropy and each method's attention recall vs budget on SmolLM2: "
        "whether the pyramid funnel holds there; the retention analysis and the quality "
        "tuning answered what it led to",
        _BEFORE_RETIREMENT, {"attention_analysis.json": "88225d6"}),
    RetiredStudy(
        "benchmarks/retention_analysis.py",
        "which (layer, KV head) rows keep a retrieval answer under each selection setting: "
        "it chose the selection defaults of f76a1c6 (pooling kernel 15, PyramidKV slope 2), "
        "which shipped",
        _BEFORE_RETIREMENT,
        # run on f76a1c6's working tree before it was committed (the JSON records no commit)
        {"quality_tuning/retention_grid.json": "f76a1c6",
         "quality_tuning/retention_kernels.json": "f76a1c6",
         "quality_tuning/retention_windows.json": "f76a1c6"}),
    RetiredStudy(
        "benchmarks/fp8_selection.py",
        "whether scores read from fp8 keys keep what unquantized keys keep: the tolerance it "
        "measured is stated in docs/methods.md, and fp8 pages are measured end to end by the "
        "quality benchmark (section fp8 pages with compression)",
        _BEFORE_RETIREMENT, {"fp8_selection.json": "a9a381f"}),
    RetiredStudy(
        "benchmarks/kvpress_reference.py",
        "whether SnapKV, Ada-KV and StreamingLLM configured like NVIDIA kvpress 0.5.5 select "
        "its tokens (they did, exactly); it needed an environment of its own "
        "(scripts/setup_kvpress_env.sh, retired with it)",
        _BEFORE_RETIREMENT, {"kvpress_reference.json": "55b7a54"}),
)


def retired_study(name: str) -> RetiredStudy | None:
    """The retired study that produced result ``name``, if one did."""
    return next((study for study in RETIRED if name in study.produced_by), None)


def _throughput(report: Report) -> str:
    return throughput.render_report(report)


def _memory_sweep(report: Report) -> str:
    return memory_sweep.render_report(report)


def _step_overhead(report: Report) -> str:
    return step_overhead.render(report["cases"])


def _scheduler_cost(report: Report) -> str:
    return scheduler_cost.render(report["results"])


def _surrogate_fit(report: Report) -> str:
    return surrogate_fit.render(report["results"])


def _decode_fidelity(report: Report) -> str:
    return with_prefix_caching(decode_fidelity.fidelity_table(report["configs"]),
                               report.get("settings") or {})


def _decode_recall(report: Report) -> str:
    return with_prefix_caching(decode_fidelity.recall_table(report["configs"]),
                               report.get("settings") or {})


def _quality(report: Report) -> str:
    # both question positions when a run has them (an inside-only run: the one table)
    return quality_report.render_run(report)


def _compression_cost(report: Report) -> str:
    return compression_cost.render(report["rows"])


def _hybrid_memory(report: Report) -> str:
    return with_prefix_caching(hybrid_memory.render(report["rows"]),
                               report.get("settings") or {})


def _multi_turn(report: Report) -> str:
    return multi_turn_report.render(report["configs"])


def _offload_tier(report: Report) -> str:
    return (multi_turn_report.render_tier(report["configs"]) + "\n\n"
            + multi_turn_report.render(report["configs"]))


def _handoff(report: Report) -> str:
    return handoff.render(report["configs"])


def _multi_turn_recall(report: Report) -> str:
    return (multi_turn_report.render_recall(report["configs"]) + "\n\n"
            + multi_turn_report.render(report["configs"]))


def _shared_context(report: Report) -> str:
    turns = report["workload"]["turns"]
    return "\n\n".join(f"{mode} mode (accuracy per turn [95% interval]):\n"
                       + shared_context.render(report["configs"], mode, turns)
                       for mode in report["workload"]["modes"])


def _fp8_pages(report: Report) -> str:
    """The fp8 section's results: a throughput run, a memory sweep or a quality run."""
    if report.get("benchmark") == "quality":
        return quality_report.render_run(report)
    if "--sweep-kv-memory" in report.get("command", ""):
        return _memory_sweep(report)
    return _throughput(report)


def _shared_prefix(report: Report) -> str:
    return shared_prefix.render(report["configs"])


def _streaming_latency(report: Report) -> str:
    return streaming_latency.render(report["rows"])


def _serve_prefix(report: Report) -> str:
    return serve_prefix.render_report(report)


SECTIONS: tuple[Section, ...] = (
    Section("throughput", "Throughput against vanilla vLLM",
            ("throughput_defaults.json", "throughput_system_prompt.json", "throughput.json",
             "throughput_2threads.json",
             "throughput_vec16_pages.json", "throughput_2threads_vec16_pages.json",
             "throughput_avx2_float32.json", "throughput_2threads_avx2_float32.json"),
            _throughput),
    Section("tensor_parallel", "Tensor parallelism", ("throughput_tp2.json",), _throughput),
    Section("memory_sweep", "KV memory sweep",
            ("throughput_memory_sweep.json", "throughput_memory_sweep_avx2_float32.json",
             "throughput_memory_sweep_decode_policies.json"),
            _memory_sweep),
    Section("step_overhead", "Host work per step", ("step_overhead.json",), _step_overhead),
    Section("scheduler_cost", "The scheduler with a long waiting queue",
            ("scheduler_cost.json",), _scheduler_cost),
    Section("surrogate_fit", "Surrogate fit", ("surrogate_fit.json",), _surrogate_fit),
    Section("long_generation", "Long generations",
            ("throughput_long_generation.json", "throughput_long_generation_intel_amx.json",
             "throughput_long_generation_window.json",
             "throughput_long_generation_decode_cost_before.json",
             "throughput_long_generation_decode_cost.json",
             "throughput_long_generation_policies.json"), _throughput),
    Section("decode_fidelity", "Decode-time fidelity",
            ("decode_fidelity.json", "decode_fidelity_policies.json"), _decode_fidelity),
    Section("decode_recall", "Decode-time recall",
            ("decode_recall.json", "decode_recall_256.json", "decode_recall_512.json",
             "decode_recall_policies.json"),
            _decode_recall),
    Section("paging_overhead", "Per-head paging with nothing evicted", ("overhead.json",),
            _throughput),
    Section("quality", "Quality", ("quality.json",), _quality),
    Section("quality_tuning", "Selection defaults, by measurement",
            ("quality_tuning/*.json",), _quality),
    Section("quality_budget_sharing", "Single questions with the reuse defaults",
            ("quality_budget_sharing.json", "quality_surrogate.json",
             "quality_threshold.json"), _quality),
    Section("quality_question_outside", "The question outside the context",
            ("quality_question_outside.json", "quality_question_outside_256.json"), _quality),
    Section("kvpress_reference", "Against NVIDIA kvpress", ("kvpress_reference.json",)),
    Section("fp8_selection", "Scores from fp8 keys", ("fp8_selection.json",)),
    Section("fp8_pages", "fp8 pages with compression",
            ("throughput_fp8.json", "throughput_memory_sweep_fp8.json", "quality_fp8.json"),
            _fp8_pages),
    Section("attention_analysis", "Attention analysis", ("attention_analysis.json",)),
    Section("compression_cost", "Compression cost", ("compression_cost.json",),
            _compression_cost),
    Section("hybrid_memory", "Hybrid model memory", ("hybrid_memory_gemma3.json",),
            _hybrid_memory),
    Section("multi_turn", "Multi-turn reuse", ("multi_turn.json", "multi_turn_uncompressed.json"),
            _multi_turn),
    Section("offload_tier", "Offload tier", ("offload_tier.json", "offload_tier_prompts.json",
                                             "offload_tier_chat.json"),
            _offload_tier),
    Section("handoff", "Prefill/decode hand-off", ("handoff.json", "handoff_concurrent.json"),
            _handoff),
    Section("multi_turn_recall", "Multi-turn recall",
            ("multi_turn_recall.json", "multi_turn_recall_budgets.json",
             "multi_turn_recall_prompts.json"), _multi_turn_recall),
    Section("shared_context", "Scoring across turns", ("shared_context.json",
                                                        "shared_context_hybrid.json",
                                                        "shared_context_defaults.json",
                                                        "shared_context_expected.json",
                                                        "shared_context_variants.json",
                                                        "shared_context_sharing.json",
                                                        "shared_context_surrogate.json",
                                                        "shared_context_segments.json",
                                                        "shared_context_later_turns.json",
                                                        "shared_context_natural.json"),
            _shared_context),
    Section("streaming_latency", "Streaming latency while long prompts arrive",
            ("streaming_latency.json", "streaming_latency_inline_passes.json"),
            _streaming_latency),
    Section("shared_prefix", "A prefix shared by running requests",
            ("shared_prefix_system_prompt.json", "shared_prefix_segments.json",
             "shared_prefix.json",
             "shared_prefix_n4_scoring.json"), _shared_prefix),
    # a folder: the section stands (its notes say how to run it) before its first result
    Section("serve_prefix", "A shared prefix over HTTP (vllm bench serve)",
            ("serve_prefix/*.json",), _serve_prefix),
)


# ----------------------------------------------------------------------------- headline
@dataclass(frozen=True)
class Headline:
    """One row of the README's headline table: a figure read from one result."""

    what: str
    section: str
    file: str
    figure: Callable[[Report], str]


def _config(report: Report, label: str) -> Mapping[str, Any]:
    """The row of configuration ``label`` (of the random workload, where a throughput run
    measured several)."""
    rows = report.get("configs") or report.get("rows") or []
    for row in rows:
        if row.get("label") == label and row.get("workload") in (None, "random"):
            return row
    raise KeyError(f"no configuration {label!r} in the result")


def _speedup(label: str) -> Callable[[Report], str]:
    def figure(report: Report) -> str:
        mine, vanilla = _config(report, label), _config(report, "vanilla")
        return (f"**{mine['vs_vanilla']['output_tok_s']:.2f}x** vanilla's output tok/s; "
                f"{mine['preemptions']} preemptions (vanilla {vanilla['preemptions']})")
    return figure


def _speedup_and_ample(label: str) -> Callable[[Report], str]:
    def figure(report: Report) -> str:
        mine = _config(report, label)["vs_vanilla"]["output_tok_s"]
        ample = _config(report, throughput.AMPLE_LABEL)["vs_vanilla"]["output_tok_s"]
        return (f"**{mine:.2f}x** vanilla's output tok/s, **{mine / ample:.2f}x** vanilla "
                f"with KV memory for every request")
    return figure


def _long_generation(report: Report) -> str:
    window = _config(report, "pyramidkv:256@window:256")["vs_vanilla"]["output_tok_s"]
    ample = _config(report, throughput.AMPLE_LABEL)["vs_vanilla"]["output_tok_s"]
    return (f"**{window:.2f}x** vanilla's output tok/s (vanilla with memory for every "
            f"request: {ample:.2f}x)")


def _quality(report: Report) -> str:
    kept = [_config(report, f"pyramidkv:{budget}")["retained"] for budget in (64, 128)]
    return (f"PyramidKV keeps **{100 * kept[0]:.0f}%** / {100 * kept[1]:.0f}% of the full "
            f"cache's accuracy at budget 64 / 128")


def _multi_turn(report: Report) -> str:
    reuse = _config(report, "pyramidkv:r=0.75+reuse=on")["vs_vanilla"]["output_tok_s"]
    return f"**{reuse:.2f}x** the output tok/s of vanilla with its prefix cache"


def _later_turns(report: Report) -> str:
    row = _config(report, "pyramidkv:r=0.75+scoring=auto+reuse=on")
    return (f"**{shared_context.later_turns_of_full(row):.2f}x** the full cache's accuracy on "
            f"turns 2-5, {row['tok_s_ratio']:.2f}x vanilla's tok/s")


def _served(report: Report) -> str:
    """A serve_prefix result: its last side against vanilla."""
    run = report["runs"][-1]
    ratios, figures = run["vs_vanilla"], run["figures"]
    # (Cached tokens over every chat: with a segment request all of them read the prefix;
    # the benchmark's cached_per_reader assumes the first computes it.)
    cached = figures["cached_tokens"] / figures["completed"]
    return (f"**{ratios['output_throughput']:.2f}x** vanilla's output tok/s, time to first "
            f"token {ratios['mean_ttft_ms']:.2f}x; {cached:.0f} of the "
            f"{figures['prefix_len']} prefix tokens cached per chat")


def _hybrid_memory(report: Report) -> str:
    return ", ".join(f"**{row['x_vanilla']:.2f}x** less KV at {row['prompt_len']} tokens"
                     for row in report["rows"])


HEADLINES: tuple[Headline, ...] = (
    Headline("Throughput with every default (`--kv-compression pyramidkv "
             "--kv-compression-ratio 0.875`; prefix caching on, so `auto` scoring is the "
             "score surrogate; 16 prompts of 1024 in / 256 out, 180 MB of KV), "
             "one engine thread", "throughput", "throughput_defaults.json",
             _speedup_and_ample("pyramidkv:r=0.875")),
    Headline("Throughput, 8x compression (24 prompts of 1024 in / 128 out, KV memory for 3 "
             "uncompressed requests), one engine thread", "throughput", "throughput.json",
             _speedup("pyramidkv:r=0.875")),
    Headline("The same, two engine threads", "throughput", "throughput_2threads.json",
             _speedup("pyramidkv:r=0.875")),
    Headline("The same at tensor parallel 2 (both engines TP 2; SmolLM2-shaped random "
             "Llama with 4 KV heads)", "tensor_parallel", "throughput_tp2.json",
             _speedup("pyramidkv:r=0.875")),
    Headline("Long generations (256 in / 1024 out), each head keeping 256 generated tokens "
             "(`window`)", "long_generation", "throughput_long_generation.json",
             _long_generation),
    Headline("Quality: passkey, needles and QA at 320 tokens, 120 prompts per cell",
             "quality", "quality.json", _quality),
    Headline("32 chats sharing a ~1.5k-token system prompt (130 MB of KV), the README's "
             "serve command (`--kv-compression pyramidkv`: budget 512, the system prompt "
             "computed and compressed once and read by every chat)", "throughput",
             "throughput_system_prompt.json", _speedup("pyramidkv:512")),
    Headline("The same chats over HTTP: `vllm serve` with the README's serve command "
             "(float32), `vllm bench serve` sending all 32 at once", "serve_prefix",
             "serve_prefix/serve_prefix_chats_readme_command.json", _served),
    Headline("Multi-turn chat (10 conversations x 5 turns, KV memory for 3), PyramidKV 4x "
             "with `--kv-reuse on`", "multi_turn", "multi_turn.json", _multi_turn),
    Headline("Later turns of chats about natural-text documents (60 conversations x 5 turns, "
             "each turn reusing the last one's compressed cache), PyramidKV 4x with every "
             "default (`auto` scoring: the score surrogate)", "shared_context",
             "shared_context_natural.json", _later_turns),
    Headline("Gemma 3 270M (sliding-window layers), one request decoding, PyramidKV at 128",
             "hybrid_memory", "hybrid_memory_gemma3.json", _hybrid_memory),
)
