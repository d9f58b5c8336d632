"""What a multi-turn run shows: the summary and per-turn tables, the recall table, the plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import format_table


def render(rows: Sequence[Mapping[str, Any]]) -> str:
    summary = []
    for row in rows:
        van, own = row.get("vs_vanilla") or {}, row.get("vs_no_reuse") or {}
        tierless, tier = row.get("vs_no_tier") or {}, row.get("tier") or {}
        summary.append({
            **row,
            "out_van": van.get("output_tok_s"), "out_own": own.get("output_tok_s"),
            "ttft_van": van.get("ttft_mean"), "ttft_own": own.get("ttft_mean"),
            "later_van": van.get("ttft_later_turns"),
            "later_tier": tierless.get("ttft_later_turns"),
            "last_van": van.get("ttft_last_turn"), "last_own": own.get("ttft_last_turn"),
            "cached_pct": 100 * row["cached_share"] if row.get("ok") else None,
            "tier_mb": (None if not tier else tier["bytes_per_conversation"] / 1e6),
            "tier_share": tier.get("share_of_uncompressed"),
        })
    table = format_table(summary, [
        ("label", "config"), ("output_tok_s", "out tok/s"), ("out_van", "x van"),
        ("out_own", "x no-reuse"), ("ttft_mean", "TTFT s"), ("ttft_van", "x van"),
        ("ttft_own", "x no-reuse"), ("ttft_later_turns", "TTFT later"), ("later_van", "x van"),
        ("later_tier", "x no-tier"), ("ttft_last_turn", "TTFT last"), ("last_van", "x van"),
        ("last_own", "x no-reuse"), ("prompt_tokens", "prompt tok"),
        ("cached_tokens", "cached tok"), ("cached_pct", "cached %"),
        ("preemptions", "preempt"), ("peak_running", "peak run"), ("elapsed_s", "time s"),
        ("tier_mb", "tier MB/conv"), ("tier_share", "x uncompressed"),
    ])
    turns = []
    for row in rows:
        van = (row.get("vs_vanilla") or {}).get("ttft_per_turn") or []
        own = (row.get("vs_no_reuse") or {}).get("ttft_per_turn") or []
        for index, turn in enumerate(row.get("per_turn") or []):
            turns.append({
                "label": row["label"], **turn,
                "match_pct": (None if turn["context_match_share"] is None
                              else 100 * turn["context_match_share"]),
                "ttft_van": van[index] if index < len(van) else None,
                "ttft_own": own[index] if index < len(own) else None,
            })
    per_turn_table = format_table(turns, [
        ("label", "config"), ("turn", "turn"), ("ttft_mean", "TTFT s"), ("ttft_van", "x van"),
        ("ttft_own", "x no-reuse"), ("queue_mean", "queue s"), ("prefill_mean", "prefill s"),
        ("prompt_tokens_mean", "prompt tok"), ("cached_tokens_mean", "cached tok"),
        ("match_pct", "ctx match %"), ("preemptions", "preempt"),
    ], digits=2)
    return (f"{table}\n\nper turn (means over conversations; ctx match: common token prefix "
            f"with the previous prompt + answer):\n{per_turn_table}")


def render_tier(rows: Sequence[Mapping[str, Any]]) -> str:
    """The offload tier's part: later turns' TTFT against vanilla and the same configuration
    without the tier, output tok/s against vanilla, and what went to and from the tier per
    conversation against the conversation's whole context uncompressed."""
    table = []
    for row in rows:
        tier = row.get("tier")
        if not tier:
            continue
        van, tierless = row.get("vs_vanilla") or {}, row.get("vs_no_tier") or {}
        table.append({
            "label": row["label"], "later_van": van.get("ttft_later_turns"),
            "later_tier": tierless.get("ttft_later_turns"), "out_van": van.get("output_tok_s"),
            "written_mb": tier["bytes_per_conversation"] / 1e6,
            "uncompressed_mb": tier["uncompressed_bytes_per_conversation"] / 1e6,
            "share": tier["share_of_uncompressed"],
            "loaded_mb": tier["loaded_bytes_per_conversation"] / 1e6,
            "saved": tier.get("saved_entries"), "loaded": tier.get("loaded_entries"),
            "dropped": tier.get("dropped_entries"),
            "held_mb": tier.get("held_bytes", 0) / 1e6,
        })
    return format_table(table, [
        ("label", "config"), ("later_van", "TTFT later x van"),
        ("later_tier", "x no-tier"), ("out_van", "out tok/s x van"),
        ("written_mb", "MB written/conv"), ("uncompressed_mb", "MB uncompressed/conv"),
        ("share", "written / uncompressed"), ("loaded_mb", "MB loaded/conv"),
        ("saved", "entries saved"), ("loaded", "loaded"), ("dropped", "dropped"),
        ("held_mb", "MB held at end"),
    ], digits=3)


def render_recall(rows: Sequence[Mapping[str, Any]]) -> str:
    table = []
    for row in rows:
        recall = row.get("recall") or {}
        interval = recall.get("interval")
        van, own = recall.get("vs_vanilla") or {}, recall.get("vs_no_reuse") or {}
        last = (row.get("per_turn") or [{}])[-1]
        table.append({
            "label": row["label"], "accuracy": recall.get("accuracy"),
            "interval": f"{interval[0]:.2f}-{interval[1]:.2f}" if interval else None,
            "vs_van": van.get("mean"), "vs_own": own.get("mean"),
            "n": len(recall.get("scores") or []), "cached": last.get("cached_tokens_mean"),
            "prompt": last.get("prompt_tokens_mean"),
        })
    return "recall (pass key from turn 1, asked in the last turn):\n" + format_table(table, [
        ("label", "config"), ("accuracy", "accuracy"), ("interval", "95% CI"),
        ("vs_van", "- vanilla"), ("vs_own", "- no-reuse"), ("n", "n"),
        ("prompt", "last prompt tok"), ("cached", "last cached tok"),
    ])


def plot_title(report: Mapping[str, Any]) -> str:
    w = report["workload"]
    return (f"{Path(report['settings']['model']).name}: {w['num_conversations']} conversations x "
            f"{w['turns']} turns, {w['user_tokens']} user + {w['answer_tokens']} answer tokens, "
            f"KV {report['settings']['kv_cache_capacity_tokens']} tokens")


def plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> bool:
    """TTFT and prefilled / cached tokens per turn; False without matplotlib or results."""
    rows = [row for row in rows if row.get("ok")]
    try:
        import matplotlib
    except ImportError:
        return False
    if not rows:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for index, row in enumerate(rows):
        turns = [t["turn"] for t in row["per_turn"]]
        color = f"C{index}"
        left.plot(turns, [t["ttft_mean"] for t in row["per_turn"]], marker="o", color=color,
                  label=row["label"])
        right.plot(turns, [t["prompt_tokens_mean"] - t["cached_tokens_mean"]
                           for t in row["per_turn"]], marker="o", color=color,
                   label=f"{row['label']} prefilled")
        right.plot(turns, [t["cached_tokens_mean"] for t in row["per_turn"]], marker="x",
                   linestyle="--", color=color, label=f"{row['label']} cached")
    left.set_ylabel("mean time to first token (s)")
    right.set_ylabel("tokens per request")
    for ax in (left, right):
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    left.legend()
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

