"""Needle retention: which (layer, KV head) rows keep the answer, per configuration.

Where the quality suite says *that* a configuration loses a retrieval task, this says *where*:
for passkey / needle prompts the answer's tokens are known, so after each configuration's
selection (``kvcompress.policies.plan_keep``, on the engine's own window scores) we can count,
per layer, the KV heads that still hold one whole copy of the answer. A pyramid that starves
its upper layers shows up as rows lost in those layers; a window or pooling problem as losses
spread over all of them.

The model runs once per prompt in Hugging Face transformers (eager attention, prefill only);
the window rows of the last ``max window`` queries are kept and every configuration is planned
from them, so a sweep of many configurations costs little more than one.

    python -m benchmarks.retention_analysis --configs snapkv:64,pyramidkv:64+pyramid_beta=4
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.attention_analysis import (
    analyze_input,
    install_attention,
    load_model,
    window_scores,
)
from benchmarks.quality.tasks import Sample, make_samples
from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from benchmarks.specs import (
    benchmark_parser,
    default_model_dir,
    default_threads,
    model_shape,
    parse_ints,
    parse_names,
    parse_specs,
)
from kvcompress.settings.config import KVCompressionConfig

RETRIEVAL_TASKS = ("passkey", "niah_single", "niah_multikey")


def answer_positions(sample: Sample, offsets: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Token positions of every copy of the (single) answer in the context, the question
    excluded: one list per copy, from the tokenizer's character offsets."""
    context_end = sample.prompt.rindex("\n\n")
    answer = sample.answers[0]
    copies = []
    start = sample.prompt.find(answer)
    while 0 <= start < context_end:
        stop = start + len(answer)
        copies.append([i for i, (a, b) in enumerate(offsets) if a < stop and b > start])
        start = sample.prompt.find(answer, stop)
    return copies


def rows_holding_answer(kept: Any, counts: Any, copies: list[list[int]]) -> Any:
    """Bool [L, H]: the row keeps every token of at least one copy of the answer."""
    import torch

    valid = torch.arange(kept.shape[-1]) < counts[..., None]
    holds = torch.zeros(counts.shape, dtype=torch.bool)
    for copy in copies:
        present = [((kept == position) & valid).any(-1) for position in copy]
        holds |= torch.stack(present).all(0)
    return holds


def retention(config: KVCompressionConfig, rows: dict[int, Any], copies: list[list[int]],
              num_kv_heads: int) -> Any:
    """Bool [L, H] for one configuration on one prompt: its selection planned from the
    engine-equivalent scores of the last ``config.window`` recorded window rows."""
    import torch

    from kvcompress.policies import plan_keep

    length = next(iter(rows.values())).shape[-1]
    scores = torch.stack([
        window_scores(rows[layer][:, -config.window:, :], num_kv_heads, config.gqa_reduce)
        for layer in sorted(rows)
    ])
    plan = plan_keep(config.policy, [length], [scores], num_layers=scores.shape[0],
                     num_kv_heads=num_kv_heads)
    return rows_holding_answer(plan.indices[0], plan.counts[0], copies)


def build_parser():
    parser = benchmark_parser("benchmarks.retention_analysis", __doc__)
    parser.add_argument("--configs", required=True,
                        help="configurations as in the quality suite, e.g. pyramidkv:64,"
                             "pyramidkv:64+pyramid_beta=4,snapkv:64+window=16")
    parser.add_argument("--tasks", default="passkey,niah_single")
    parser.add_argument("--lengths", default="320")
    parser.add_argument("--samples", type=int, default=24, help="prompts per task and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-json", type=Path,
                        default=RESULTS_DIR / "retention_analysis.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        specs = [s for s in parse_specs(args.configs) if not s.is_vanilla]
        tasks = parse_names(args.tasks, list(RETRIEVAL_TASKS), "--tasks")
        # resolved (and validated) once: every prompt is planned with them
        configs = [KVCompressionConfig.from_mapping(s.additional_config()) for s in specs]
    except ValueError as error:  # KVCompressionConfigError included
        raise SystemExit(f"--configs: {error}") from None
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads or default_threads())
    model_dir = args.model or default_model_dir()
    num_kv_heads = model_shape(model_dir)["num_kv_heads"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = make_samples(tasks, parse_ints(args.lengths), args.samples, args.seed,
                           lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    install_attention()
    model = load_model(model_dir, "float32", "cpu")
    widest_window = max(config.window for config in configs)  # recorded once, sliced per config
    held: dict[str, list[Any]] = {spec.label: [] for spec in specs}
    for sample in samples:
        encoded = tokenizer(sample.prompt, return_offsets_mapping=True)
        copies = answer_positions(sample, encoded["offset_mapping"])
        ids = torch.tensor([encoded["input_ids"]])
        recorder, _ = analyze_input(model, ids, new_tokens=0, window=widest_window,
                                    num_kv_heads=num_kv_heads)
        for spec, config in zip(specs, configs):
            held[spec.label].append(retention(config, recorder.window_rows, copies,
                                              num_kv_heads))
    rows = []
    for spec in specs:
        stacked = torch.stack(held[spec.label]).float()  # [prompts, L, H]
        rows.append({
            "label": spec.label,
            "rows_holding": float(stacked.mean()),
            "prompts_all_rows": float((stacked.flatten(1).min(1).values == 1).float().mean()),
            "per_layer": stacked.mean(dim=(0, 2)).tolist(),
        })
    report = {"benchmark": "retention_analysis", "command": command_string(),
              "machine": machine_info("cpu"),
              "settings": {"model": model_dir, "tasks": tasks, "lengths": args.lengths,
                           "samples": args.samples, "seed": args.seed},
              "configs": rows, "runtime_s": time.perf_counter() - started}
    write_json(args.output_json, report)
    print(render(rows))
    print(f"\nwrote {args.output_json} ({report['runtime_s']:.0f} s)")
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    """Share of rows holding the answer, overall, by thirds of the depth, and whole prompts."""
    table = []
    for row in rows:
        layers = row["per_layer"]
        third = max(1, len(layers) // 3)
        parts = [layers[:third], layers[third:-third] or layers, layers[-third:]]
        table.append({"label": row["label"], "all": row["rows_holding"],
                      "low": sum(parts[0]) / len(parts[0]), "mid": sum(parts[1]) / len(parts[1]),
                      "high": sum(parts[2]) / len(parts[2]),
                      "whole": row["prompts_all_rows"]})
    return format_table(table, [("label", "config"), ("all", "rows holding answer"),
                                ("low", "lower third"), ("mid", "middle"), ("high", "upper"),
                                ("whole", "prompts: every row")])


if __name__ == "__main__":
    sys.exit(main())
