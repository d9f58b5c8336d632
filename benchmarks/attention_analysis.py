"""Attention analysis on long inputs with Hugging Face transformers (eager attention).

Two pictures, from the embedded model (or ``--model``) run directly in transformers:

1. Pyramidal information funneling: per layer, the entropy of the attention distributions of
   late prompt queries (nats, and normalized by log of the keys visible), the mass on the top
   2% of keys and on the first 4 tokens (attention sinks). PyramidKV's observation is that
   attention spreads widely in lower layers and concentrates in upper ones (entropy falls).
2. Attention recall vs budget: the prompt is scored like the engine does (the last ``window``
   prompt queries' softmax probabilities, GQA-mean, summed), ``kvcompress.policies.plan_keep``
   picks the kept tokens per (layer, KV head) for each method and budget, and the recall is the
   share of the attention mass that the *later* queries (the model's own greedy continuation)
   put on prompt tokens which falls on kept ones, averaged over queries, heads and layers.
   An "oracle" row keeps, per head, the tokens those later queries attend to most (uniform
   budgets): an upper bound for any uniform selection.

    python -m benchmarks.attention_analysis                    # defaults: ~5-10 min on 2 cores
    python -m benchmarks.attention_analysis --length 2048 --inputs qa

Inputs are the quality benchmark's synthetic long-context prompts (seeded). Attention weights
are never kept whole: a custom attention function (eager attention plus statistics) reduces
them layer by layer.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.quality.tasks import TASKS, make_samples
from benchmarks.report import (
    RESULTS_DIR,
    command_string,
    format_table,
    machine_info,
    write_json,
)
from benchmarks.specs import (
    benchmark_parser,
    default_model_dir,
    default_threads,
    model_shape,
    parse_ints,
    parse_names,
)
from kvcompress.policies import METHODS

DEFAULT_BUDGETS = "64,128,256,512,1024,2048"
ATTENTION_NAME = "kvcompress_analysis"
SINK_TOKENS = 4
TOP_SHARE = 0.02
_ACTIVE: dict[str, Any] = {"recorder": None}  # the Recorder the attention function reports to


# ----------------------------------------------------------------------------- statistics
def entropy_stats(probs: Any, positions: Any) -> dict[str, Any]:
    """Per-head statistics of attention rows ``probs [H, Q, S]`` of queries at ``positions``
    (causal: query at p sees keys 0..p). Returns [H] tensors (mean over the queries)."""
    import torch

    probs = probs.float()
    visible = (positions + 1).float()  # [Q]
    logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    entropy = -(probs * logp).sum(-1)  # [H, Q]
    normalized = entropy / visible.clamp(min=2).log()
    k = max(1, math.ceil(TOP_SHARE * int(positions.min()) + 1))
    top_mass = probs.topk(k, dim=-1).values.sum(-1)
    sink_mass = probs[..., :SINK_TOKENS].sum(-1)
    return {
        "entropy": entropy.mean(-1),
        "normalized_entropy": normalized.mean(-1),
        "top_mass": top_mass.mean(-1),
        "sink_mass": sink_mass.mean(-1),
    }


def window_scores(window_probs: Any, num_kv_heads: int, group_reduce: str = "mean") -> Any:
    """Engine-equivalent raw scores [H_kv, S] from window rows [H_q, W, S] (the query heads of
    a KV head combined by ``group_reduce``, the window summed)."""
    from kvcompress.policies import aggregate_window_probs

    num_q, window, length = window_probs.shape
    grouped = window_probs.float().reshape(num_kv_heads, num_q // num_kv_heads, window, length)
    return aggregate_window_probs(grouped, group_reduce)


def kept_mask(indices: Any, counts: Any, length: int) -> Any:
    """Boolean [L, H, S] from KeepPlan indices [L, H, K] and counts [L, H]."""
    import torch

    valid = torch.arange(indices.shape[-1]) < counts[..., None]
    # padding goes to an extra column that is cut off (writing False at a real position
    # could erase a kept token that another slot set)
    target = torch.where(valid, indices, torch.full_like(indices, length))
    mask = torch.zeros((*indices.shape[:2], length + 1), dtype=torch.bool)
    mask.scatter_(-1, target, True)
    return mask[..., :length]


def recall(later: Any, mask: Any) -> Any:
    """Per-layer recall [L]: later-query mass on kept prompt tokens / mass on the prompt.

    later: [L, H_q, T, S] attention of T later queries over the S prompt keys.
    mask:  [L, H_kv, S] kept tokens; query head h_kv * G + g reads KV head h_kv.
    """
    group = later.shape[1] // mask.shape[1]
    per_query_head = mask.repeat_interleave(group, dim=1)[:, :, None, :]  # [L, H_q, 1, S]
    kept = (later * per_query_head).sum(-1)
    total = later.sum(-1).clamp(min=1e-30)
    return (kept / total).mean(dim=(1, 2))


def oracle_mask(later: Any, num_kv_heads: int, budget: int, window: int) -> Any:
    """Uniform budget, hindsight: per (layer, KV head) the window plus the prefix tokens the
    later queries attend to most."""
    import torch

    layers, num_q, _, length = later.shape
    mass = later.sum(2).reshape(layers, num_kv_heads, num_q // num_kv_heads, length).sum(2)
    mask = torch.zeros((layers, num_kv_heads, length), dtype=torch.bool)
    mask[..., length - window:] = True
    quota = max(0, min(budget, length) - window)
    if quota:
        top = mass[..., : length - window].topk(quota, dim=-1).indices
        mask.scatter_(-1, top, True)
    return mask


def method_recalls(scores: Any, later: Any, *, methods: Sequence[str], budgets: Sequence[int],
                   window: int, num_kv_heads: int) -> dict[str, dict[int, list[float]]]:
    """{method: {budget: per-layer recall}} for plan_keep's selections (and the oracle)."""
    from kvcompress.policies import PolicySettings, plan_keep

    layers, _, length = scores.shape
    out: dict[str, dict[int, list[float]]] = {}
    for method in methods:
        out[method] = {}
        for budget in budgets:
            policy = PolicySettings(method, budget=budget, window=window)
            plan = plan_keep(policy, [length], [scores], num_layers=layers,
                             num_kv_heads=num_kv_heads)
            mask = kept_mask(plan.indices[0], plan.counts[0], length)
            out[method][budget] = recall(later, mask).tolist()
    out["oracle"] = {
        b: recall(later, oracle_mask(later, num_kv_heads, b, window)).tolist() for b in budgets
    }
    return out


# ----------------------------------------------------------------------------- recording
@dataclass
class Recorder:
    """Receives every layer's attention weights; keeps only reductions."""

    prompt_len: int
    window: int
    num_kv_heads: int
    max_stat_queries: int = 256
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    window_rows: dict[int, Any] = field(default_factory=dict)
    later_rows: dict[int, list[Any]] = field(default_factory=dict)

    def observe(self, layer: int, weights: Any) -> None:
        import torch

        rows = weights[0].float()  # [H_q, T_q, S]
        if rows.shape[1] > 1:  # prefill: the whole prompt at once
            q = self.prompt_len
            start = q // 2  # late queries only: early ones see few keys
            stride = max(1, (q - start) // self.max_stat_queries)
            positions = torch.arange(start, q, stride, device=rows.device)
            self.stats[layer] = entropy_stats(rows[:, positions, :], positions)
            self.window_rows[layer] = rows[:, q - self.window: q, :q].clone()
        else:  # one decode step: a later query
            self.later_rows.setdefault(layer, []).append(rows[:, 0, : self.prompt_len].clone())


def register_observed_attention(name: str,
                                observe: Callable[[Any, Any, Any, Any, float], None]) -> None:
    """Register eager attention under ``name`` (transformers' ``AttentionInterface``, the
    official extension point) that calls ``observe(module, query, key, weights, scaling)``
    after each layer attends (post-RoPE query and key, the softmax weights)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                  scaling: float, dropout: float = 0.0, **kwargs: Any) -> tuple[Any, Any]:
        output, weights = eager_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        observe(module, query, key, weights, scaling)
        return output, None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)


def install_attention() -> None:
    """Register eager attention that also reports its weights to the active recorder."""

    def observe(module: Any, query: Any, key: Any, weights: Any, scaling: float) -> None:
        recorder = _ACTIVE["recorder"]
        if recorder is not None:
            recorder.observe(module.layer_idx, weights)

    register_observed_attention(ATTENTION_NAME, observe)


def analyze_input(model: Any, input_ids: Any, *, new_tokens: int, window: int,
                  num_kv_heads: int, on_token: Any = None) -> tuple[Recorder, list[int]]:
    """Greedy decoding of ``new_tokens`` after the prompt, recording attention throughout."""
    import torch

    recorder = Recorder(prompt_len=input_ids.shape[1], window=window, num_kv_heads=num_kv_heads)
    _ACTIVE["recorder"] = recorder
    generated: list[int] = []
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, use_cache=True)
            cache = out.past_key_values
            for _ in range(new_tokens):
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                if on_token is not None:
                    on_token()
                out = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                            use_cache=True)
                cache = out.past_key_values
    finally:
        _ACTIVE["recorder"] = None
    return recorder, generated


def stack_layers(recorder: Recorder) -> tuple[Any, Any, dict[str, Any]]:
    """(scores [L, H_kv, S], later [L, H_q, T, S], per-layer stats {name: [L, H]})."""
    import torch

    layers = sorted(recorder.window_rows)
    scores = torch.stack([window_scores(recorder.window_rows[i], recorder.num_kv_heads)
                          for i in layers])
    later = torch.stack([torch.stack(recorder.later_rows[i], dim=1) for i in layers])
    names = recorder.stats[layers[0]].keys()
    stats = {name: torch.stack([recorder.stats[i][name] for i in layers]) for name in names}
    return scores, later, stats


# ----------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("benchmarks.attention_analysis", __doc__)
    parser.add_argument("--inputs", default="qa,niah_multikey",
                        help="quality-benchmark tasks used as long inputs (one prompt each)")
    parser.add_argument("--samples", type=int, default=1, help="prompts per input task")
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=24,
                        help="greedy tokens generated after the prompt (the later queries)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--window", type=int, default=8, help="observation window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="torch dtype of the model")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: cores - 1)")
    parser.add_argument("--output-json", type=Path,
                        default=RESULTS_DIR / "attention_analysis.json")
    parser.add_argument("--plot", type=Path, default=RESULTS_DIR / "attention_analysis.png")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def load_model(model_dir: str, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=ATTENTION_NAME
    )
    return model.to(device).eval()


def run(args: argparse.Namespace) -> str:
    """Run the analysis; writes JSON + PNG and returns the text report."""
    started = time.perf_counter()
    model_dir = args.model or default_model_dir()
    shape = model_shape(model_dir)
    budgets = parse_ints(args.budgets)
    methods = parse_names(args.methods, METHODS, "--methods")
    tasks = parse_names(args.inputs, list(TASKS), "--inputs")
    context = shape["max_position_embeddings"]
    if context and args.length + args.new_tokens > context:
        raise ValueError(f"--length + --new-tokens exceeds the model's context ({context})")
    if not 1 <= args.window <= min(budgets):
        raise ValueError(f"--window must be in [1, smallest budget], got {args.window}")

    import torch  # heavy imports only once the arguments are known to be good
    from tqdm import tqdm
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads or default_threads())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = make_samples(tasks, [args.length], args.samples, args.seed,
                           lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    install_attention()
    model = load_model(model_dir, args.dtype, device)
    kv_heads = shape["num_kv_heads"]

    per_input = []
    stats_sum: dict[str, Any] = {}
    recalls_all: list[dict[str, dict[int, list[float]]]] = []
    bar = tqdm(total=len(samples) * (args.new_tokens + 1), desc="attention", unit="fwd",
               disable=args.no_progress, mininterval=0.5 if sys.stderr.isatty() else 30.0)
    for sample in samples:
        ids = torch.tensor([tokenizer.encode(sample.prompt)], device=device)
        t0 = time.perf_counter()
        recorder, generated = analyze_input(model, ids, new_tokens=args.new_tokens,
                                            window=args.window, num_kv_heads=kv_heads,
                                            on_token=lambda: bar.update(1))
        bar.update(1)
        scores, later, stats = stack_layers(recorder)
        recalls = method_recalls(scores.cpu(), later.cpu(), methods=methods, budgets=budgets,
                                 window=args.window, num_kv_heads=kv_heads)
        recalls_all.append(recalls)
        for name, value in stats.items():
            stats_sum[name] = stats_sum.get(name, 0) + value.mean(-1).cpu()  # mean over heads
        per_input.append({
            "task": sample.task, "prompt_tokens": int(ids.shape[1]),
            "continuation": tokenizer.decode(generated), "seconds": time.perf_counter() - t0,
            "recall_mean": {m: {str(b): sum(v) / len(v) for b, v in r.items()}
                            for m, r in recalls.items()},
        })
    bar.close()

    layer_stats = {name: (value / len(samples)).tolist() for name, value in stats_sum.items()}
    recall_layers = average_recalls(recalls_all)
    recall_mean = {m: {b: sum(v) / len(v) for b, v in r.items()} for m, r in recall_layers.items()}
    report = {
        "benchmark": "attention_analysis",
        "command": command_string(),
        "machine": machine_info(device),
        "settings": {
            "model": model_dir, "dtype": args.dtype, "length": args.length,
            "new_tokens": args.new_tokens, "window": args.window, "budgets": budgets,
            "methods": methods, "inputs": tasks, "samples": args.samples, "seed": args.seed,
            "selection": selection_defaults(),
        },
        "layer_stats": layer_stats,
        "entropy_slope_per_layer": slope(layer_stats["normalized_entropy"]),
        "recall": {m: {str(b): v for b, v in r.items()} for m, r in recall_mean.items()},
        "recall_per_layer": {m: {str(b): v for b, v in r.items()}
                             for m, r in recall_layers.items()},
        "pyramid_gain_over_snapkv_pct": {
            str(b): 100 * (recall_mean["pyramidkv"][b] - recall_mean["snapkv"][b])
            for b in budgets if "pyramidkv" in recall_mean and "snapkv" in recall_mean
        },
        "inputs": per_input,
        "runtime_s": time.perf_counter() - started,
    }
    write_outputs(report, args.output_json, args.plot)
    return f"command: {report['command']}\n" + render(report) + \
        f"\n\nwrote {args.output_json} and {args.plot} ({report['runtime_s']:.0f} s)"


def selection_defaults() -> str:
    from kvcompress.policies import settings

    return (f"plan_keep defaults: {settings.DEFAULT_POOLING} pooling kernel "
            f"{settings.DEFAULT_POOLING_KERNEL}, GQA {settings.DEFAULT_GROUP_REDUCE}, beta "
            f"{settings.DEFAULT_BETA:g}, {settings.DEFAULT_SINK_TOKENS} sink tokens "
            f"(streamingllm), adakv floor {settings.DEFAULT_ADAKV_FLOOR:g}")


def average_recalls(items: list[dict[str, dict[int, list[float]]]]) -> dict[str, dict[int, list]]:
    """Element-wise mean over inputs of {method: {budget: per-layer recall}}."""
    out: dict[str, dict[int, list[float]]] = {}
    for method in items[0]:
        out[method] = {}
        for budget in items[0][method]:
            layers = zip(*(item[method][budget] for item in items))
            out[method][budget] = [sum(values) / len(items) for values in layers]
    return out


def slope(values: Sequence[float]) -> float:
    """Least-squares slope over the layer index (negative: falls with depth)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def render(report: dict[str, Any]) -> str:
    stats = report["layer_stats"]
    layers = len(stats["entropy"])
    rows = [{"layer": i, **{k: stats[k][i] for k in stats}} for i in range(layers)]
    lines = [
        "per-layer attention of late prompt queries (mean over heads and inputs):",
        format_table(rows, [("layer", "layer"), ("entropy", "entropy"),
                            ("normalized_entropy", "norm. entropy"), ("top_mass", "top-2% mass"),
                            ("sink_mass", "sink mass")], digits=3),
        f"normalized-entropy slope per layer: {report['entropy_slope_per_layer']:+.4f}",
        "",
        "attention recall of later queries (mean over layers, heads, queries and inputs):",
    ]
    budgets = report["settings"]["budgets"]
    recall_rows = [{"method": m, **{str(b): v[str(b)] for b in budgets}}
                   for m, v in report["recall"].items()]
    lines.append(format_table(recall_rows, [("method", "method")] +
                              [(str(b), str(b)) for b in budgets], digits=4))
    gains = report["pyramid_gain_over_snapkv_pct"]
    if gains:
        lines.append("pyramidkv - snapkv recall (points): " +
                     ", ".join(f"{b}: {g:+.2f}" for b, g in gains.items()))
    return "\n".join(lines)


def write_outputs(report: dict[str, Any], json_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_json(json_path, report)
    stats = report["layer_stats"]
    layers = list(range(len(stats["entropy"])))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(layers, stats["normalized_entropy"], marker="o", label="normalized entropy")
    ax.plot(layers, stats["top_mass"], marker="s", label=f"mass on top {TOP_SHARE:.0%} keys")
    ax.plot(layers, stats["sink_mass"], marker="^", label=f"mass on first {SINK_TOKENS} tokens")
    ax.set_xlabel("layer")
    ax.set_title("attention per layer (late prompt queries)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    budgets = report["settings"]["budgets"]
    ax = axes[1]
    for method, values in report["recall"].items():
        style = "--" if method == "oracle" else "-"
        ax.plot(budgets, [values[str(b)] for b in budgets], style, marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget (tokens / head, window included)")
    ax.set_ylabel("attention recall")
    ax.set_title(f"recall of later queries, prompt {report['settings']['length']} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[2]
    small = str(min(budgets, key=lambda b: abs(b - 128)))
    for method, values in report["recall_per_layer"].items():
        style = "--" if method == "oracle" else "-"
        ax.plot(layers, values[small], style, label=method)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention recall")
    ax.set_title(f"recall per layer at budget {small}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
