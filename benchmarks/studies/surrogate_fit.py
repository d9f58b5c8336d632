"""How well a model's score surrogate predicts the reconstruction pass, per kind of text, and
what its fit costs (issue 52).

    python -m benchmarks.studies.surrogate_fit                   # SmolLM2 and Gemma 3 270M
    python -m benchmarks.studies.surrogate_fit --models .models/SmolLM2-135M-Instruct \\
        --held-out 6

Per model: the teacher (``kvcompress.profile_model.teacher``) over the fitting prompts the
set-up's command uses (``--prompts`` of each kind, its seed) and over ``--held-out`` held-out
prompts of each kind (more than the command's two, for steadier figures; from text the fit
never saw). Two fits on the same prompts: the surrogate the command makes (key, value and
their squares) and the linear map of format 1 (no squares). Reported per kind: rank
correlation with the pass per row, top-quarter overlap per row (what the command's floor
checks) and model-wide top-quarter overlap; and the teacher's and the fit's wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from kvcompress.profile_model.surrogate_fit import (
    PROMPTS_PER_KIND,
    fit_surrogate,
    kind_quality,
    teacher_samples,
)

DEFAULT_MODELS = ".models/SmolLM2-135M-Instruct,.models/gemma-3-270m"
FIGURES = (("rank_correlation", "rank corr."), ("overlap_4x", "top 1/4 overlap"),
           ("model_overlap_4x", "model-wide 1/4"))


def measure(model: str, prompts: int, held_out: int, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    fitting, held = teacher_samples(model, prompts, held_out, seed, "cpu",
                                    log=lambda line: print(line, file=sys.stderr))
    teacher_seconds = time.perf_counter() - started
    started = time.perf_counter()
    surrogate = fit_surrogate(fitting, "study")
    fit_seconds = time.perf_counter() - started
    linear = fit_surrogate(fitting, "study", squares=False)
    return {
        "model": Path(model).name, "fitting_tokens": sum(s.prompt_len for s in fitting),
        "held_out_tokens": sum(s.prompt_len for samples in held.values() for s in samples),
        "teacher_seconds": teacher_seconds, "fit_seconds": fit_seconds,
        "quality": kind_quality(surrogate, held), "linear_quality": kind_quality(linear, held),
    }


def render(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        kinds = [key.rpartition(".")[0] for key in result["quality"]
                 if key.endswith(".rank_correlation")]
        for kind in [*kinds, "all"]:
            prefix = "" if kind == "all" else f"{kind}."
            rows.append({"model": result["model"], "kind": kind, **{
                key: f"{result['quality'][prefix + key]:.3f} "
                     f"({result['linear_quality'][prefix + key]:.3f})" for key, _ in FIGURES}})
    table = format_table(rows, [("model", "model"), ("kind", "held-out kind"), *FIGURES])
    costs = format_table(results, [
        ("model", "model"), ("fitting_tokens", "fitting tokens"),
        ("held_out_tokens", "held-out tokens"), ("teacher_seconds", "teacher s"),
        ("fit_seconds", "fit s")], digits=1)
    return (f"{table}\n\nThe surrogate the command makes (key, value and their squares); in "
            f"brackets the linear map (format 1) fitted on the same prompts.\n\n{costs}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.surrogate_fit",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--prompts", type=int, default=PROMPTS_PER_KIND,
                        help="fitting prompts of each kind (the command's default)")
    parser.add_argument("--held-out", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1, help="the command's surrogate seed")
    parser.add_argument("--output-json", default=str(RESULTS_DIR / "surrogate_fit.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = [measure(model, args.prompts, args.held_out, args.seed)
               for model in args.models.split(",")]
    print(render(results))
    write_json(Path(args.output_json), {
        "benchmark": "surrogate_fit", "command": command_string(),
        "machine": machine_info("cpu"), "settings": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
