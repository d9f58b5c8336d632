"""fp8 pages and selection: do scores from fp8 keys keep what scores from unquantized keys keep?

With ``--kv-cache-dtype fp8`` the observation-window scores read the keys the pages hold: fp8
codes of ``key / k_scale`` written by vLLM's CPU kernel (which rounds toward zero). This runs
the quality suite's prompts through the model in Hugging Face transformers (eager attention,
prefill only, fp32), scores every layer's prompt keys by its last ``window`` queries twice,
from the keys as computed and from the same keys after vLLM's own fp8 cache write (its CPU op,
at the scale vLLM uses for this model, 1.0 without checkpoint scales), and plans each method's
selection from both. Per (layer, KV head) row: the share of the unquantized selection the fp8
one also keeps (overlap), whether the two are identical, and the unquantized score mass the
fp8 selection keeps relative to the unquantized selection's (near-ties swapped cost nothing).
The model's forward itself stays unquantized here: only the scores' keys differ.

    python -m benchmarks.fp8_selection                  # ~5 min on 2 cores
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.attention_analysis import register_observed_attention
from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from benchmarks.specs import (
    benchmark_parser,
    default_model_dir,
    default_threads,
    model_shape,
    parse_ints,
    parse_names,
)
from kvcompress.settings.config import KVCompressionConfig

FP8_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")
DEFAULT_TASKS = "passkey,niah_single,niah_multikey,qa"  # the quality suite's
PAGE_SIZE = 32  # the vec kernel's fp8 pages


def vllm_fp8_keys(keys: Any, cache_dtype: str, scale: float = 1.0) -> Any:
    """``keys [N, D]`` as vLLM's CPU fp8 cache write stores them, decoded (times ``scale``):
    its own op writes them into fp8 pages, our page format reads them back."""
    import torch
    from vllm import _custom_ops as ops

    from kvcompress.attention.cpu_kernel import page_format_for

    num_tokens, head_size = keys.shape
    pages = -(-num_tokens // PAGE_SIZE)
    pool = torch.zeros(pages, 2, PAGE_SIZE, head_size, dtype=torch.uint8)
    key_cache, value_cache = pool.view(pages, 1, 2 * PAGE_SIZE, head_size).chunk(2, dim=2)
    tokens = keys.float().reshape(num_tokens, 1, head_size).contiguous()
    ops.cpu_attn_reshape_and_cache(tokens, tokens, key_cache, value_cache,
                                   torch.arange(num_tokens), "vec", k_scale=scale,
                                   v_scale=scale, kv_cache_dtype=cache_dtype)
    page_format = page_format_for("vec", cache_dtype)
    stored, _ = page_format.read_tokens(pool, torch.arange(num_tokens))
    return page_format.decode(stored) * scale


def window_probs(query: Any, keys: Any, window: int, scaling: float) -> Any:
    """Softmax rows ``[Hq, window, S]`` of the last ``window`` queries (``query [Hq, S, D]``)
    over ``keys [H, S, D]`` (query heads grouped onto KV heads), causal."""
    import torch

    num_q, length, _ = query.shape
    keys = keys.repeat_interleave(num_q // keys.shape[0], dim=0)
    logits = query[:, length - window:].float() @ keys.float().transpose(1, 2) * scaling
    positions = torch.arange(length - window, length)
    logits.masked_fill_(torch.arange(length)[None, :] > positions[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def selection_agreement(reference: Any, other: Any, scores: Any) -> dict[str, Any]:
    """Row-wise agreement of two plans (``(indices [L, H, K], counts [L, H])``; Ada-KV's
    counts may differ between them): the share of the reference's kept tokens the other
    keeps, identical rows, and the ``scores [L, H, S]`` mass the other keeps relative to the
    reference's."""
    import torch

    length = scores.shape[-1]
    masks = []
    for indices, counts in (reference, other):
        valid = torch.arange(indices.shape[-1]) < counts[..., None]
        target = torch.where(valid, indices, torch.full_like(indices, length))
        mask = torch.zeros((*indices.shape[:2], length + 1), dtype=torch.bool)
        masks.append(mask.scatter_(-1, target, True)[..., :length])
    common = (masks[0] & masks[1]).sum(-1).float()
    overlap = common / reference[1].clamp(min=1).float()
    mass = [(scores * mask).sum(-1) for mask in masks]
    identical = (masks[0] == masks[1]).all(-1)
    return {"overlap": overlap.flatten(), "identical": identical.flatten(),
            "mass": (mass[1] / mass[0].clamp(min=1e-30)).flatten()}


def build_parser():
    parser = benchmark_parser("benchmarks.fp8_selection", __doc__)
    parser.add_argument("--methods", default="pyramidkv,snapkv,adakv")
    parser.add_argument("--budgets", default="64,128")
    parser.add_argument("--cache-dtypes", default=",".join(FP8_CACHE_DTYPES))
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--lengths", default="320")
    parser.add_argument("--samples", type=int, default=12, help="prompts per task and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-json", type=Path, default=RESULTS_DIR / "fp8_selection.json")
    return parser


def record_keys_and_queries(model: Any, input_ids: Any) -> dict[int, tuple[Any, Any, float]]:
    """Per layer: (queries [Hq, S, D], keys [H, S, D], scaling) of one prefill, post-RoPE."""
    import torch

    recorded: dict[int, tuple[Any, Any, float]] = {}

    def observe(module: Any, query: Any, key: Any, weights: Any, scaling: float) -> None:
        recorded[module.layer_idx] = (query[0].clone(), key[0].clone(), scaling)

    register_observed_attention("kvcompress_fp8_selection", observe)
    model.set_attn_implementation("kvcompress_fp8_selection")
    with torch.no_grad():
        model(input_ids=input_ids)
    return recorded


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    from benchmarks.quality.tasks import TASKS, make_samples

    try:
        methods = parse_names(args.methods, ["pyramidkv", "snapkv", "adakv"], "--methods")
        cache_dtypes = parse_names(args.cache_dtypes, list(FP8_CACHE_DTYPES), "--cache-dtypes")
        tasks = parse_names(args.tasks, list(TASKS), "--tasks")
        configs = {(method, budget): KVCompressionConfig.from_mapping(
            {"kv_compression": method, "kv_budget": budget})
            for method in methods for budget in parse_ints(args.budgets)}
    except ValueError as error:
        raise SystemExit(str(error)) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompress.policies import plan_keep
    from kvcompress.policies.scores import aggregate_window_probs

    torch.set_num_threads(args.threads or default_threads())
    model_dir = args.model or default_model_dir()
    num_kv_heads = model_shape(model_dir)["num_kv_heads"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = make_samples(tasks, parse_ints(args.lengths), args.samples, args.seed,
                           lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for sample in samples:
        ids = torch.tensor([tokenizer.encode(sample.prompt)])
        recorded = record_keys_and_queries(model, ids)
        layers = sorted(recorded)
        for cache_dtype in ["auto", *cache_dtypes]:
            scores_by_window: dict[int, Any] = {}
            for config in configs.values():
                window = config.window
                if window in scores_by_window:
                    continue
                rows = []
                for layer in layers:
                    query, keys, scaling = recorded[layer]
                    if cache_dtype != "auto":
                        keys = vllm_fp8_keys(keys.reshape(-1, keys.shape[-1]),
                                             cache_dtype).view(keys.shape)
                    probs = window_probs(query, keys, window, scaling)
                    grouped = probs.view(num_kv_heads, -1, *probs.shape[1:])
                    rows.append(aggregate_window_probs(grouped, config.gqa_reduce))
                scores_by_window[window] = torch.stack(rows)
            for (method, budget), config in configs.items():
                scores = scores_by_window[config.window]
                plan = plan_keep(config.policy, [scores.shape[-1]], [scores],
                                 num_layers=len(layers), num_kv_heads=num_kv_heads)
                results.setdefault((cache_dtype, method, budget), []).append(
                    {"plan": plan, "scores": scores})
    rows = []
    for cache_dtype in cache_dtypes:
        for method, budget in configs:
            agreement: dict[str, list[Any]] = {"overlap": [], "identical": [], "mass": []}
            for ours, reference in zip(results[cache_dtype, method, budget],
                                       results["auto", method, budget]):
                measured = selection_agreement(
                    (reference["plan"].indices[0], reference["plan"].counts[0]),
                    (ours["plan"].indices[0], ours["plan"].counts[0]), reference["scores"])
                for key, value in measured.items():
                    agreement[key].append(value)
            overlap = torch.cat(agreement["overlap"])
            rows.append({
                "label": f"{method}:{budget} {cache_dtype}",
                "cache_dtype": cache_dtype, "method": method, "budget": budget,
                "overlap_mean": float(overlap.mean()),
                "overlap_p5": float(overlap.quantile(0.05)),
                "overlap_min": float(overlap.min()),
                "rows_identical": float(torch.cat(agreement["identical"]).float().mean()),
                "mass_kept_mean": float(torch.cat(agreement["mass"]).mean()),
                "mass_kept_min": float(torch.cat(agreement["mass"]).min()),
            })
    report = {"benchmark": "fp8_selection", "command": command_string(),
              "machine": machine_info("cpu"),
              "settings": {"model": model_dir, "tasks": tasks, "lengths": args.lengths,
                           "samples": args.samples, "seed": args.seed, "k_scale": 1.0},
              "configs": rows, "runtime_s": time.perf_counter() - started}
    write_json(args.output_json, report)
    print(render(rows))
    print(f"\nwrote {args.output_json} ({report['runtime_s']:.0f} s)")
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    return format_table(rows, [
        ("label", "selection, pages"), ("overlap_mean", "kept in common (mean)"),
        ("overlap_p5", "5th percentile row"), ("overlap_min", "worst row"),
        ("rows_identical", "rows identical"), ("mass_kept_mean", "score mass kept (mean)"),
        ("mass_kept_min", "score mass kept (worst row)"),
    ], digits=3)


if __name__ == "__main__":
    sys.exit(main())
