"""Profile a model once, for the scorings that need no extra pass:

    python -m kvcompress.profile_model [MODEL] [--out PATH] [--if-missing] ...

MODEL is a local folder or a hub id in the local Hugging Face cache (default: the embedded
model). The query profile and the score surrogate go beside a folder, or for a hub id into
the user's kvcompress cache, where the server finds them (``profile_model.store``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress.profile_model import store as model_store
from kvcompress.profile_model.profiles import ProfileError, load_profile
from kvcompress.profile_model.surrogate_fit import (
    HELD_OUT,
    MIN_OVERLAP,
    PROMPTS_PER_KIND,
    SurrogateRefused,
    make_surrogate,
)
from kvcompress.profile_model.surrogates import (
    ScoreSurrogate,
    is_current,
    load_surrogate,
    quality_line,
)
from kvcompress.profile_model.teacher import TeacherUnsupported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.profile_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?",
                        help="a local Hugging Face model folder, or a hub id in the local "
                             "Hugging Face cache (default: the embedded model)")
    parser.add_argument("--out", help="where to write the profile (default: beside a folder, "
                                      "the user's kvcompress cache for a hub id)")
    parser.add_argument("--surrogate-out",
                        help="where to write the score surrogate (default: as --out)")
    parser.add_argument("--documents", type=int, default=6,
                        help="calibration documents (each gives a Q&A and a reconstruction)")
    parser.add_argument("--surrogate-prompts", "--surrogate-documents", type=int,
                        default=PROMPTS_PER_KIND, dest="surrogate_prompts",
                        help="calibration prompts of each kind (synthetic, prose, code, chat) "
                             "the score surrogate is fitted on (0: make no surrogate)")
    parser.add_argument("--held-out", type=int, default=HELD_OUT,
                        help="further prompts of each kind, from text the fit never saw, "
                             "that the surrogate's figures are measured on")
    parser.add_argument("--min-overlap", type=float, default=MIN_OVERLAP,
                        help="refuse a surrogate whose held-out top-quarter overlap is under "
                             "this on any kind (0 to 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--if-missing", action="store_true",
                        help="make only what is missing (or made for another model)")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error("--documents: allowed: an integer >= 1")
    if args.surrogate_prompts < 0 or args.held_out < 0:
        parser.error("--surrogate-prompts / --held-out: allowed: an integer >= 0")
    if not 0 <= args.min_overlap <= 1:
        parser.error("--min-overlap: allowed: a number from 0 to 1")
    if args.model is None:
        from kvcompress.models import embedded_model_dir

        args.model = str(embedded_model_dir())
    folder = model_store.model_folder(args.model)
    if folder is None:
        parser.error(f"MODEL: {args.model} is neither a model folder nor a hub id in the local "
                     "Hugging Face cache (HF_HUB_CACHE); download it first")
    args.model_dir = str(folder)
    out = (Path(args.out) if args.out
           else model_store.default_out("profile", args.model, folder))
    out.parent.mkdir(parents=True, exist_ok=True)
    if not (args.if_missing and _valid(out, args.model_dir, load_profile, "query profile")):
        _make_profile(args, out)
    if args.surrogate_prompts:
        return _make_surrogate(args)
    return 0


def _make_profile(args: argparse.Namespace, out: Path) -> None:
    """The query profile; a model whose layout the profiler cannot read gets none (only
    ``--kv-scoring expected`` needs it), and its surrogate is still made."""
    from kvcompress.profile_model.profile_fit import fit_query_profile

    try:
        profile = fit_query_profile(args.model_dir, args.documents, args.seed, args.device)
    except ProfileError as error:
        print(f"kvcompress: no query profile (--kv-scoring expected): {error}", file=sys.stderr)
        return
    profile.save(out)
    print(f"kvcompress: query profile of {profile.num_layers} layers x "
          f"{profile.num_heads} heads from {profile.num_queries} queries written to {out}")


def _make_surrogate(args: argparse.Namespace) -> int:

    out = (Path(args.surrogate_out) if args.surrogate_out
           else model_store.default_out("surrogate", args.model, Path(args.model_dir)))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.if_missing and _valid(out, args.model_dir, load_surrogate, "score surrogate"):
        return 0
    try:
        surrogate = make_surrogate(args.model_dir, prompts=args.surrogate_prompts,
                                   held_out=args.held_out, seed=args.seed + 1,
                                   device=args.device, min_overlap=args.min_overlap)
    except (SurrogateRefused, TeacherUnsupported) as refusal:
        print(f"kvcompress: no score surrogate written: {refusal}", file=sys.stderr)
        return 1
    surrogate.save(out)
    figures = quality_line(surrogate.quality)
    print(f"kvcompress: score surrogate of {surrogate.num_layers} layers x "
          f"{surrogate.num_kv_heads} KV heads from {surrogate.num_tokens} prompt tokens "
          f"written to {out}" + (f"; held out: {figures}" if figures else ""))
    return 0


def _valid(path: Path, model_dir: str, load, what: str) -> bool:
    """Whether ``path`` holds a valid, current ``what`` of this model (``load`` checks it)."""
    if not path.is_file():
        return False
    try:
        made = load(path, model_dir)
    except ValueError as error:
        print(f"kvcompress: remaking the {what} ({error})")
        return False
    if isinstance(made, ScoreSurrogate) and not is_current(made):
        print(f"kvcompress: remaking the {what} (made by an older kvcompress, without the "
              "squared terms)")
        return False
    print(f"kvcompress: {what} already at {path}")
    return True
