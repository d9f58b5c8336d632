"""Scoring: each output against its sample's answers, and against the full cache's output;
per-configuration rows (accuracy, share of the full cache's accuracy retained, fidelity)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from benchmarks.quality.tasks import Sample
from benchmarks.specs import CompressionSpec


def contains(text: str, reference: str) -> bool:
    """``reference`` as a whole word / number in ``text`` (case-insensitive)."""
    pattern = r"(?<![A-Za-z0-9])" + re.escape(reference) + r"(?![A-Za-z0-9])"
    return re.search(pattern, text, flags=re.IGNORECASE) is not None


def score(text: str, answers: Sequence[str], metric: str) -> float:
    found = [contains(text, answer) for answer in answers]
    if metric == "any":
        return float(any(found))
    return sum(found) / len(found)


def prefix_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of the reference (full-cache) greedy tokens reproduced before the first change."""
    if not reference:
        return 1.0
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same / len(reference)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(scores: Sequence[float], z: float = Z_95) -> list[float] | None:
    """95% Wilson score interval of the mean of ``scores`` in [0, 1]. Scores of tasks that
    give partial credit ("all" with several answers) count as fractional successes."""
    n = len(scores)
    if n == 0:
        return None
    p = sum(scores) / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def paired_difference(scores: Sequence[float], others: Sequence[float],
                      z: float = Z_95) -> dict[str, float] | None:
    """Mean of ``scores - others`` over the same prompts, with a 95% normal interval: the
    same prompts run under both configurations, so their difference is measured per prompt
    (tighter than comparing two independent intervals)."""
    n = len(scores)
    if n == 0 or len(others) != n:
        return None
    diffs = [a - b for a, b in zip(scores, others)]
    centre = sum(diffs) / n
    spread = math.sqrt(sum((d - centre) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = z * spread / math.sqrt(n)
    return {"mean": centre, "low": centre - half, "high": centre + half, "n": n}


def summarize_config(samples: Sequence[Sample], outputs: Sequence[dict[str, Any]],
                     reference: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    """Accuracy per task and per (task, length), mean over tasks, fidelity to the reference."""
    scores = [score(o["text"], s.answers, s.metric) for s, o in zip(samples, outputs)]
    tasks = list(dict.fromkeys(s.task for s in samples))
    lengths = sorted({s.length for s in samples})
    per_task = {t: mean([x for s, x in zip(samples, scores) if s.task == t]) for t in tasks}
    per_length = {
        f"{t}@{n}": mean([x for s, x in zip(samples, scores) if s.task == t and s.length == n])
        for t in tasks for n in lengths
    }
    result: dict[str, Any] = {
        "accuracy": mean([per_task[t] for t in tasks]),  # macro average over tasks
        "n": len(scores),
        # Over all prompts (the macro average when every task has as many prompts).
        "interval": wilson_interval(scores),
        "per_task": per_task,
        "per_task_n": {t: sum(s.task == t for s in samples) for t in tasks},
        "per_task_interval": {
            t: wilson_interval([x for s, x in zip(samples, scores) if s.task == t]) for t in tasks
        },
        "per_task_length": per_length,
        "per_length": {
            str(n): mean([x for s, x in zip(samples, scores) if s.length == n]) for n in lengths
        },
        "scores": scores,
    }
    if reference is not None:
        agree = [prefix_agreement(o["token_ids"], r["token_ids"])
                 for o, r in zip(outputs, reference)]
        exact = [float(o["token_ids"] == r["token_ids"]) for o, r in zip(outputs, reference)]
        result["fidelity"] = mean(agree)
        result["exact_match_full"] = mean(exact)
    return result


def add_retained(rows: list[dict[str, Any]], full: dict[str, Any]) -> None:
    """Fraction of the full cache's accuracy kept, overall and per task (None if full is 0)."""
    for row in rows:
        if not row.get("ok"):
            continue
        base = full.get("accuracy")
        row["retained"] = row["accuracy"] / base if base else None
        row["retained_per_task"] = {
            task: (acc / full["per_task"][task] if full["per_task"].get(task) else None)
            for task, acc in row["per_task"].items()
        }


# Every row is compared, prompt by prompt, with the full cache and with this method at the
# same budget or ratio (the strongest uniform baseline in the papers).
BASELINE_METHOD = "snapkv"


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """``vs_full`` and ``vs_snapkv``: paired differences in accuracy over the same prompts
    (SnapKV with the row's own explicit scoring when it ran, else plain SnapKV)."""
    full = rows[0] if rows and rows[0].get("ok") and rows[0]["method"] == "none" else None
    baselines = {(r["budget"], r["ratio"], _scoring(r)): r for r in rows
                 if _is_baseline(r) and r.get("ok")}
    for row in rows:
        if not row.get("ok"):
            continue
        if full is not None and row is not full:
            row["vs_full"] = paired_difference(row["scores"], full["scores"])
        baseline = (baselines.get((row["budget"], row["ratio"], _scoring(row)))
                    or baselines.get((row["budget"], row["ratio"], None)))
        if baseline is not None and baseline is not row:
            row[f"vs_{BASELINE_METHOD}"] = paired_difference(row["scores"], baseline["scores"])


def _scoring(row: dict[str, Any]) -> str | None:
    """The row's explicit ``kv_scoring`` setting (None: the engine's default)."""
    return (row.get("options") or {}).get("kv_scoring")


def _is_baseline(row: dict[str, Any]) -> bool:
    """SnapKV with no settings of its own but a scoring."""
    scoring = _scoring(row)
    options = () if scoring is None else (("kv_scoring", scoring),)
    return row.get("series") == series_name(CompressionSpec(BASELINE_METHOD, budget=1,
                                                            options=options))


def evicts_nothing(spec: CompressionSpec, prompt_lens: Sequence[int]) -> bool:
    """A budget >= every prompt keeps every prompt whole (ratios always evict)."""
    return spec.budget is not None and spec.budget >= max(prompt_lens)


def collect_rows(samples: Sequence[Sample], specs: Sequence[CompressionSpec],
                 results: dict[str, Any], prompt_lens: Sequence[int]) -> list[dict[str, Any]]:
    full = results.get("vanilla")
    reference = full.result["outputs"] if full is not None and full.result else None
    rows = []
    for spec in specs:
        row: dict[str, Any] = {"label": spec.label, "method": spec.method, "budget": spec.budget,
                               "ratio": spec.ratio, "options": dict(spec.options),
                               "series": series_name(spec)}
        outcome = results.get(spec.label)
        if outcome is None and evicts_nothing(spec, prompt_lens) and reference is not None:
            row.update(ok=True, not_run="budget >= every prompt: nothing evicted, full cache")
            row.update(summarize_config(samples, reference, reference))
        elif outcome is None or outcome.error is not None:
            row.update(ok=False, error=getattr(outcome, "error", "not run"))
        else:
            row.update(ok=True, generate_s=outcome.result["generate_s"],
                       job_seconds=outcome.seconds)
            row.update(summarize_config(samples, outcome.result["outputs"], reference))
            row["outputs"] = [o["text"] for o in outcome.result["outputs"]]
            row["measured_kept_fraction"] = outcome.result.get("measured_kept_fraction")
        # A threshold's share is data-dependent: the workers' measure stands for it.
        row["kept_fraction"] = (kept_fraction(spec, prompt_lens)
                                if not spec.thresholded else row.get("measured_kept_fraction"))
        rows.append(row)
    if rows and rows[0]["ok"]:
        add_retained(rows, rows[0])
    add_comparisons(rows)
    return rows


def series_name(spec: CompressionSpec) -> str:
    """What a plot line is: the method with its own settings, across budgets or ratios."""
    return spec.method + "".join(f"+{key.removeprefix('kv_')}={value}"
                                 for key, value in spec.options)


def kept_fraction(spec: CompressionSpec, prompt_lens: Sequence[int]) -> float:
    """Mean share of each prompt's cache kept (window included) at this budget or ratio
    (nominal; a score threshold's is measured: ``measured_kept_fraction``)."""
    if spec.is_vanilla:
        return 1.0
    if spec.ratio is not None:
        return 1.0 - spec.ratio
    return mean([min(1.0, spec.budget / n) for n in prompt_lens]) or 1.0
