"""What a quality run shows: the text table, the plot, and both redrawn from a saved JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import format_table, with_prefix_caching
from kvcompress.policies import METHODS


def replot(json_path: Path, png_path: Path) -> int:
    report = json.loads(json_path.read_text())
    print(render_run(report))
    plot(report["configs"], png_path, title=plot_title(report))
    print(f"wrote {png_path}")
    return 0


def render_run(report: Mapping[str, Any]) -> str:
    """A run's tables, headed by a line when its question-inside engines had prefix caching
    off (every inside run did before the setting was recorded; question outside needs it)."""
    workload = report["workload"]
    table = render_report(report["configs"], workload["tasks"])
    inside = "inside" in workload.get("question_positions", ["inside"])
    return with_prefix_caching(table, report.get("settings") or {}, unrecorded=not inside)


def render_report(rows: list[dict[str, Any]], tasks: Sequence[str]) -> str:
    """The table of each question position run (older JSON: inside only), then, when both
    ran, the two side by side."""
    modes = list(dict.fromkeys(row_position(row) for row in rows))
    if modes == ["inside"]:
        return render(rows, tasks)
    parts = [f"question {mode}:\n" + render([r for r in rows if row_position(r) == mode], tasks)
             for mode in modes]
    if len(modes) > 1:
        parts.append("question inside vs outside (accuracy, mean over tasks):\n"
                     + render_positions(rows))
    return "\n\n".join(parts)


def row_position(row: dict[str, Any]) -> str:
    return row.get("question", "inside")


def render_positions(rows: list[dict[str, Any]]) -> str:
    """One line per configuration: accuracy with the question inside and outside, their
    paired difference, and how many question-outside requests adopted their context."""
    outside = {row["label"]: row for row in rows if row_position(row) == "outside"}
    table = []
    for row in rows:
        twin = outside.get(row["label"])
        if row_position(row) != "inside" or twin is None:
            continue
        table.append({
            "label": row["label"], "kept_fraction": row.get("kept_fraction"),
            "scoring": _scorings(row, twin), "inside": row.get("accuracy"),
            "in_ci": _interval(row.get("interval")), "outside": twin.get("accuracy"),
            "out_ci": _interval(twin.get("interval")), "d": _difference(twin.get("vs_inside")),
            "adopted": _adopted(twin),
        })
    return format_table(table, [
        ("label", "config"), ("scoring", "scoring"), ("kept_fraction", "kept"),
        ("inside", "inside"), ("in_ci", "95% CI"), ("outside", "outside"),
        ("out_ci", "95% CI"), ("d", "outside - inside (paired 95%)"), ("adopted", "adopted")])


def _scorings(inside: dict[str, Any], outside: dict[str, Any]) -> str:
    """The scoring each mode ran with (``auto`` differs where the inside mode ran without
    prefix caching: window inside, hybrid outside)."""
    a, b = inside.get("scoring"), outside.get("scoring")
    if a is None and b is None:
        return ""
    return str(a) if a == b else f"{a} / {b}"


def _adopted(row: dict[str, Any]) -> str:
    """``hits/n`` of the question-outside requests that adopted their context's cache."""
    adoption = row.get("adoption")
    if not adoption:
        return ""
    if not adoption["applies"]:
        return "n/a (full)"
    text = f"{adoption['hits']}/{adoption['n']}"
    expected = adoption.get("expected_compressions", adoption["n"])
    missing = expected - adoption.get("contexts_compressed", expected)
    return f"{text} ({missing} not compressed)" if missing > 0 else text


def render(rows: list[dict[str, Any]], tasks: Sequence[str]) -> str:
    short = {t: t.replace("niah_", "").replace("variable_tracking", "vt")
             .replace("common_words", "cwe")[:10] for t in tasks}
    table = []
    for row in rows:
        flat = {**row, **{f"t:{t}": (row.get("per_task") or {}).get(t) for t in tasks},
                "ci": _interval(row.get("interval")), "d_full": _difference(row.get("vs_full")),
                "d_snap": _difference(row.get("vs_snapkv")), "adopted": _adopted(row)}
        if row.get("not_run"):
            flat["label"] = f"{row['label']} (=full)"
        table.append(flat)
    columns = [("label", "config"), ("kept_fraction", "kept"), ("n", "n")]
    columns += [(f"t:{t}", short[t]) for t in tasks]
    columns += [("accuracy", "mean"), ("ci", "95% CI"), ("retained", "retained"),
                ("d_full", "vs full (paired 95%)"), ("d_snap", "vs snapkv"),
                ("fidelity", "fidelity")]
    if any(row.get("adoption") for row in rows):
        columns.append(("adopted", "adopted"))
    return format_table(table, columns)


def _interval(interval: Sequence[float] | None) -> str:
    return "" if not interval else f"{interval[0]:.2f}-{interval[1]:.2f}"


def _difference(difference: dict[str, float] | None) -> str:
    if not difference:
        return ""
    half = (difference["high"] - difference["low"]) / 2
    return f"{difference['mean']:+.2f} ± {half:.2f}"


def plot_title(header: dict[str, Any]) -> str:
    work = header["workload"]
    return (f"{Path(header['settings']['model']).name}: {len(work['tasks'])} tasks, lengths "
            f"{','.join(map(str, work['lengths']))}, {work['samples_per_task_length']} "
            f"samples each")


def row_series(row: dict[str, Any]) -> str:
    """The method with its settings (older JSON: no series), and where the question was
    when it is not inside the prompt."""
    series = row.get("series") or row["method"]
    return series if row_position(row) == "inside" else series + OUTSIDE_SUFFIX


OUTSIDE_SUFFIX = ", question outside"


def plot_series(rows: list[dict[str, Any]]) -> list[str]:
    """Methods in registry order first, then their variants in the order run."""
    names = list(dict.fromkeys(row_series(r) for r in rows if r["method"] != "none"))
    order = {method: index for index, method in enumerate(METHODS)}
    return sorted(names, key=lambda name: (
        order.get(name.removesuffix(OUTSIDE_SUFFIX).split("+")[0], len(order)), "+" in name,
        name.endswith(OUTSIDE_SUFFIX)))


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = rows[0] if rows and rows[0]["label"] == "vanilla" and rows[0]["ok"] else None
    by_ratio = any(r.get("ratio") is not None for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, ylabel in ((axes[0], "accuracy", "accuracy (mean over tasks)"),
                            (axes[1], "fidelity", "fidelity to full cache")):
        for index, series in enumerate(plot_series(rows)):
            color = f"C{index % 10}"
            ran = sorted((r["ratio"] if by_ratio else r["budget"], r[key]) for r in rows
                         if row_series(r) == series and r["ok"] and r.get(key) is not None
                         and not r.get("not_run"))
            skipped = sorted((r["budget"], r[key]) for r in rows
                             if row_series(r) == series and r.get("not_run"))
            if ran:  # question outside: dotted
                ax.plot(*zip(*ran), marker="o", color=color, label=series,
                        linestyle=":" if series.endswith(OUTSIDE_SUFFIX) else "-")
            if key == "accuracy":  # 95% Wilson intervals
                bars = [(r["ratio"] if by_ratio else r["budget"], r[key], r["interval"])
                        for r in rows if row_series(r) == series and r["ok"]
                        and r.get("interval") and not r.get("not_run")]
                for x, y, (low, high) in bars:  # (at 0 or 1 a bound may pass y by 1e-17)
                    ax.errorbar([x], [y], yerr=[[max(0.0, y - low)], [max(0.0, high - y)]],
                                color=color, capsize=3, alpha=0.6)
            if skipped:  # budget >= every prompt: the full cache, drawn hollow and unlinked
                ax.plot(*zip(*skipped), marker="o", linestyle="none", color=color,
                        markerfacecolor="none")
        if full is not None and full.get(key) is not None:
            ax.axhline(full[key], color="black", linestyle="--", label="full cache")
        if not by_ratio:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("fraction of prompt evicted" if by_ratio else "KV budget (tokens / head)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        if any(r.get("not_run") for r in rows):
            ax.text(0.99, 0.01, "hollow: budget >= every prompt (= full cache, not run)",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
