"""From request records to figures: per turn and per configuration, ratios to vanilla and
to the same configuration without reuse, and recall accuracy."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.multi_turn.configs import RunConfig
from benchmarks.multi_turn.workload import Conversation

RATIO_KEYS = ("output_tok_s", "ttft_mean", "ttft_later_turns", "ttft_last_turn",
              "prefill_mean", "computed_prompt_tokens", "elapsed_s")


def _mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def per_turn(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Figures of each turn number over the conversations."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        mine = [r for r in records if r["turn"] == turn]
        prompt = sum(r["prompt_tokens"] for r in mine)
        cached = sum(r["cached_tokens"] for r in mine)
        context = sum(r["context_tokens"] for r in mine)
        ttfts = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        rows.append({
            "turn": turn,
            "requests": len(mine),
            "ttft_mean": _mean(ttfts),
            "ttft_p50": statistics.median(ttfts) if ttfts else None,
            "ttft_max": max(ttfts) if ttfts else None,
            "ttft_vllm_mean": _mean([r.get("ttft_vllm_s") for r in mine]),
            "queue_mean": _mean([r["queue_s"] for r in mine]),
            "prefill_mean": _mean([r["prefill_s"] for r in mine]),
            "prompt_tokens_mean": prompt / len(mine),
            "cached_tokens_mean": cached / len(mine),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": prompt - cached,
            "cached_share": cached / prompt if prompt else 0.0,
            "context_match_share": (sum(r["context_match"] for r in mine) / context
                                    if context else None),
            "context_exact": (sum(r["context_match"] == r["context_tokens"] for r in mine)
                              / len(mine) if context else None),
            "preemptions": sum(r["preemptions"] for r in mine),
        })
    return rows


def summarize(records: Sequence[Mapping[str, Any]], elapsed: float) -> dict[str, Any]:
    """A configuration's totals and per-turn figures from its request records."""
    turns = per_turn(records)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    output = sum(r["output_tokens"] for r in records)
    context = sum(r["context_tokens"] for r in records)
    return {
        "elapsed_s": elapsed,
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "output_tokens": output,
        "output_tok_s": output / elapsed if elapsed > 0 else 0.0,
        "total_tok_s": (prompt + output) / elapsed if elapsed > 0 else 0.0,
        "ttft_mean": _mean([r["ttft_s"] for r in records]),
        "ttft_last_turn": turns[-1]["ttft_mean"] if turns else None,
        "ttft_later_turns": _mean([r["ttft_s"] for r in records
                                   if turns and r["turn"] > turns[0]["turn"]]),
        "queue_mean": _mean([r["queue_s"] for r in records]),
        "prefill_mean": _mean([r["prefill_s"] for r in records]),
        "context_match_share": sum(r["context_match"] for r in records) / context
        if context else None,
        "request_preemptions": sum(r["preemptions"] for r in records),
        "per_turn": turns,
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


def ratios(row: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Each of RATIO_KEYS and the TTFT of every turn, over ``base``'s (None without it)."""
    if base is None or not row.get("ok") or not base.get("ok"):
        return None
    out: dict[str, Any] = {key: ratio(row.get(key), base.get(key)) for key in RATIO_KEYS}
    theirs = {t["turn"]: t for t in base["per_turn"]}
    out["ttft_per_turn"] = [ratio(t["ttft_mean"], theirs.get(t["turn"], {}).get("ttft_mean"))
                            for t in row["per_turn"]]
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_vanilla``: over ``vanilla`` (prefix caching on). ``vs_no_reuse``: a kvcompress
    configuration with reuse on (or prompts) over the same one with reuse off (None for the
    others)."""
    vanilla = next((r for r in rows if r["label"] == "vanilla"), None)
    for row in rows:
        row["vs_vanilla"] = ratios(row, vanilla)
        twin = None
        if row.get("reuse") in ("on", "prompts"):
            twin = next((r for r in rows if r.get("reuse") == "off"
                         and r["base_label"] == row["base_label"]), None)
        row["vs_no_reuse"] = ratios(row, twin)
        tierless = None
        if row.get("offload_gib"):
            tierless = next((r for r in rows if r["label"] == row["tierless_label"]), None)
        row["vs_no_tier"] = ratios(row, tierless)


def add_tier_figures(rows: list[dict[str, Any]], kv_bytes_per_token: int) -> None:
    """Per configuration with a tier: bytes written to it per conversation, and their share
    of what the conversation's whole context takes uncompressed (what vanilla's blocks
    would hold of it: its longest prompt and answer, at ``kv_bytes_per_token``)."""
    for row in rows:
        offload = row.get("offload")
        if not row.get("ok") or not offload:
            continue
        longest: dict[int, int] = {}
        for record in row["records"]:
            context = record["prompt_tokens"] + record["output_tokens"]
            longest[record["conversation"]] = max(longest.get(record["conversation"], 0),
                                                  context)
        written = offload.get("saved_bytes", 0) / len(longest)
        uncompressed = kv_bytes_per_token * sum(longest.values()) / len(longest)
        row["tier"] = {"bytes_per_conversation": written,
                       "uncompressed_bytes_per_conversation": uncompressed,
                       "share_of_uncompressed": written / uncompressed,
                       "loaded_bytes_per_conversation": offload.get("loaded_bytes", 0)
                       / len(longest), **offload}


def recall_scores(records: Sequence[Mapping[str, Any]],
                  conversations: Sequence[Conversation]) -> list[float]:
    """Per conversation (in order): 1 if its last answer holds every reference."""
    from benchmarks.quality.scoring import score

    last = {r["conversation"]: r for r in records if r.get("text") is not None}
    return [score(last[c.index]["text"], c.references, "all") if c.index in last else 0.0
            for c in conversations]


def add_recall(rows: list[dict[str, Any]], conversations: Sequence[Conversation]) -> None:
    """Accuracy, its Wilson interval, and paired differences to vanilla and to no reuse."""
    from benchmarks.quality.scoring import paired_difference, wilson_interval

    for row in rows:
        if row.get("ok"):
            scores = recall_scores(row["records"], conversations)
            row["recall"] = {"accuracy": _mean(scores), "interval": wilson_interval(scores),
                             "scores": scores}
    vanilla = next((r for r in rows if r["label"] == "vanilla" and r.get("recall")), None)
    for row in rows:
        if not row.get("recall"):
            continue
        scores = row["recall"]["scores"]
        row["recall"]["vs_vanilla"] = (paired_difference(scores, vanilla["recall"]["scores"])
                                       if vanilla else None)
        twin = next((r for r in rows if r.get("recall") and r.get("reuse") == "off"
                     and row.get("reuse") == "on" and r["base_label"] == row["base_label"]),
                    None)
        row["recall"]["vs_no_reuse"] = (paired_difference(scores, twin["recall"]["scores"])
                                        if twin else None)



def config_row(config: RunConfig, outcome: Any) -> dict[str, Any]:
    spec = config.spec
    row: dict[str, Any] = {
        "label": config.label, "base_label": config.base_label, "method": spec.method,
        "budget": spec.budget, "ratio": spec.ratio, "reuse": config.reuse,
        "prefix_caching": config.prefix_caching, "offload_gib": config.offload_gib,
        "tierless_label": config.tierless_label, "ok": outcome.error is None,
        "error": outcome.error, "job_seconds": outcome.seconds,
    }
    if outcome.result is not None:
        result = dict(outcome.result)
        records = result.pop("records")
        row.update(summarize(records, result.pop("elapsed_s")))
        row.update(result)
        row["records"] = records
    return row

