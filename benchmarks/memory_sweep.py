"""``benchmarks.throughput --sweep-kv-memory``: vanilla and kvcompress across KV memory, from
a pool that holds one uncompressed request to one that holds them all.

Compression pays where KV memory limits how many requests run at once; with ample memory
every configuration runs the whole workload together and compression only costs its scoring.
Each memory point runs every configuration back to back on the same prompts (the throughput
worker, one engine per job); ratios are to vanilla at the same point. JSON + PNG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, format_table, with_prefix_caching

# Defaults when sweeping (flags given still win): a lighter workload than the single run,
# so six memory points x two configurations finish in about half an hour on one CPU thread.
SWEEP_DEFAULTS = {
    "configs": "vanilla,pyramidkv:r=0.875",
    "num_prompts": 12, "input_len": 512, "output_len": 64,
    "measure_cap": False,
    "output_json": RESULTS_DIR / "throughput_memory_sweep.json",
}
DEFAULT_MULTIPLES = "1.5,2,3,4,6,12"  # pool sizes in uncompressed requests (kvcompress
# needs a little more than one: its rows round up to whole pages, and it keeps a scoring reserve)


def parse_multiples(text: str) -> list[float]:
    try:
        values = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SystemExit(
            f"--sweep-points: expected comma-separated numbers, got {text!r}") from None
    if not values or values[0] < 1:
        raise SystemExit(
            f"--sweep-points: each pool must hold at least one request, got {text!r}")
    return values


def pool_tokens(multiples: Sequence[float], request_tokens: int) -> list[int]:
    """KV-cache sizes in uncompressed tokens: each multiple of the longest request."""
    return [int(round(multiple * request_tokens)) for multiple in multiples]


def job_id(tokens: int, label: str) -> str:
    return f"{tokens}:{label}"


def render_report(report: Mapping[str, Any]) -> str:
    """The sweep's table, headed by a line when it ran with prefix caching off (every sweep
    before the setting was recorded did)."""
    return with_prefix_caching(render(report["configs"]), report.get("settings") or {})


def render(rows: list[dict[str, Any]]) -> str:
    table = [{**row, "out_x": (row.get("vs_vanilla") or {}).get("output_tok_s"),
              "gib_x": (row.get("vs_vanilla") or {}).get("tokens_per_gib_used")}
             for row in rows]
    columns = [("kv_cache_tokens", "KV tokens"), ("label", "config"),
               ("output_tok_s", "out tok/s"), ("out_x", "x van"), ("peak_running", "peak run"),
               ("mean_running", "mean run"), ("preemptions", "preempt"),
               ("tokens_per_gib_used", "tok/GiB"), ("gib_x", "x van"),
               ("elapsed_s", "time s")]
    return format_table(table, columns)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(row["label"] for row in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("output_tok_s", "output tok/s"), ("peak_running", "peak running requests"),
              ("preemptions", "preemptions"))
    for ax, (key, ylabel) in zip(axes, panels):
        for index, label in enumerate(labels):
            points = sorted((row["kv_cache_tokens"], row[key]) for row in rows
                            if row["label"] == label and row.get("ok"))
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", color=f"C{index}", label=label)
        ax.set_xlabel("KV cache (uncompressed tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
