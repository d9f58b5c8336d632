"""Shared context (SCBench-style): several questions about one document, asked as the turns of
one conversation and as independent requests, with the KV cache compressed once.

    python -m benchmarks.shared_context                          # the default grid
    python -m benchmarks.shared_context --methods pyramidkv --ratios 0.75 \\
        --scorings window,reconstruct --reuse on --conversations 10

Each conversation has a document of about ``--doc-tokens`` tokens (filler sentences, as the
quality tasks' haystacks) hiding four facts of different kinds (a five-digit code, a person's
city, another person's job, an object's colour) and a non-retrieval task (name both people
the document mentions). Turn 1 gives the document and asks one fact; turns 2-4 ask the other
facts, turn 5 the task. Every answer starts with a prefix the assistant message is continued
from ("The secret code of the blue safe is"), greedy, at most ``--answer-tokens`` tokens, and
is right when it contains the reference (the task: the share of the two full names).

Modes, one engine per configuration, run one after the other:
- ``chat``: the turns of one conversation, turn k's prompt exactly turn k-1's prompt and
  answer tokens plus the new question (what a chat client's next request holds), submitted
  in rounds (turn k of every conversation, then k + 1). With ``kv_reuse`` on, turn k adopts
  turn k-1's compressed cache: later turns can only find what turn 1's compression kept.
- ``independent``: every question as its own request with the whole document (a document
  with many questions, agents sharing a context), all submitted at once.

Configurations: ``full`` (vanilla vLLM with its prefix cache, the accuracy reference and the
speed baseline) and every method x scoring x ratio x reuse of the grid (``--configs`` adds
more, in the other benchmarks' syntax, e.g. ``pyramidkv:r=0.75+scoring=window+reuse=off``),
same KV-cache bytes. Reported per configuration and turn: accuracy with its 95% Wilson interval
and the paired difference to the full cache over the same conversations; output tokens per
second and mean time to first token of the chat mode as ratios to vanilla's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.documents import FILLERS, Document, Prompts, make_documents, score_answer
from benchmarks.jobs import (
    Reporter,
    make_workdir,
    run_jobs,
    worker_env,
    worker_main,
    write_workload,
)
from benchmarks.report import (
    RESULTS_DIR,
    command_string,
    conclude,
    format_table,
    machine_info,
    save_report,
)
from benchmarks.specs import (
    CompressionSpec,
    EngineSettings,
    add_engine_options,
    add_run_options,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_kv_options,
    parse_names,
    parse_specs,
    resolve_dtype,
    token_counter,
)
from kvcompress.policies import METHODS as POLICY_METHODS
from kvcompress.settings.flags import REUSE_CHOICES, SCORINGS

WORKER_MODULE = "benchmarks.shared_context"
MODES = ("chat", "independent")
BLOCK_SLACK = 128  # vLLM's KV block on CPU, in tokens


# ----------------------------------------------------------------------------- worker side
@dataclass
class Answer:
    document: int
    turn: int  # 1-based question number
    mode: str
    correct: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    text: str


def run_requests(engine: Any, requests: Sequence[tuple[str, list[int]]], params: Any,
                 ) -> tuple[dict[str, Any], dict[str, float]]:
    """Submit all, step to completion; (finished outputs, time to first token) by id."""
    from benchmarks.engine import Wave, run_waves

    run = run_waves(engine, [Wave(requests, params)])
    return run.outputs, run.ttft_s


def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from benchmarks.engine import build_engine, prompt_kept_fraction, shutdown_engine

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    workload = json.loads(Path(job["workload_path"]).read_text())
    documents = [Document.from_json(d) for d in workload["documents"]]
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    prompts = Prompts(tokenizer)
    special = sorted(set(tokenizer.all_special_ids))
    params = SamplingParams(max_tokens=workload["answer_tokens"], temperature=0.0,
                            stop_token_ids=special)
    engine = build_engine(settings, spec)
    answers: list[Answer] = []
    try:
        elapsed = 0.0
        generated = 0
        if "chat" in workload["modes"]:
            histories: dict[int, list[tuple[str, list[int]]]] = {d.index: [] for d in documents}
            previous: dict[int, list[int]] = {}
            started = time.perf_counter()
            for turn in range(len(documents[0].questions)):
                requests = []
                for document in documents:
                    ids = prompts.chat_turn(document, turn, histories[document.index],
                                            previous.get(document.index, []))
                    previous[document.index] = ids
                    requests.append((f"c{document.index}t{turn}", ids))
                done, first = run_requests(engine, requests, params)
                for document in documents:
                    request_id = f"c{document.index}t{turn}"
                    output = done[request_id]
                    completion = output.outputs[0]
                    ids = [t for t in completion.token_ids if t not in special]
                    histories[document.index].append((completion.text, ids))
                    generated += len(completion.token_ids)
                    question = document.questions[turn]
                    answers.append(Answer(document.index, turn + 1, "chat",
                                          score_answer(completion.text, question),
                                          len(output.prompt_token_ids or ()),
                                          output.num_cached_tokens or 0,
                                          len(completion.token_ids), first.get(request_id),
                                          completion.text))
                reporter.progress(len(answers))
            elapsed = time.perf_counter() - started
        if "independent" in workload["modes"]:
            requests = [(f"d{d.index}q{turn}", prompts.independent(d, q))
                        for d in documents for turn, q in enumerate(d.questions)]
            done, first = run_requests(engine, requests, params)
            for document in documents:
                for turn, question in enumerate(document.questions):
                    output = done[f"d{document.index}q{turn}"]
                    completion = output.outputs[0]
                    answers.append(Answer(document.index, turn + 1, "independent",
                                          score_answer(completion.text, question),
                                          len(output.prompt_token_ids or ()),
                                          output.num_cached_tokens or 0,
                                          len(completion.token_ids),
                                          first.get(f"d{document.index}q{turn}"),
                                          completion.text))
            reporter.progress(len(answers))
        # Every compacted prompt of the job (chat turns' new segments, independent prompts).
        kept = None if spec.is_vanilla else prompt_kept_fraction(engine)
    finally:
        shutdown_engine(engine)
    return {"answers": [asdict(a) for a in answers], "chat_elapsed_s": elapsed,
            "chat_output_tokens": generated, "measured_kept_fraction": kept}


# ----------------------------------------------------------------------------- parent side
def grid_specs(methods: Sequence[str], ratios: Sequence[float], scorings: Sequence[str],
               reuse: Sequence[str]) -> list[CompressionSpec]:
    """The full cache, then every method x ratio x scoring x reuse."""
    specs = [CompressionSpec()]
    for method, ratio, scoring, reuse_setting in itertools.product(methods, ratios, scorings,
                                                                    reuse):
        specs.append(CompressionSpec(method, ratio=ratio, options=(
            ("kv_scoring", scoring), ("kv_reuse", reuse_setting))))
    return specs


def summarize(answers: Sequence[Mapping[str, Any]], mode: str,
              turns: int) -> list[dict[str, Any]]:
    """Per turn: accuracy, its Wilson interval and the per-document scores (in order)."""
    from benchmarks.quality.scoring import mean, wilson_interval

    rows = []
    records = [Answer(**answer) for answer in answers]
    for turn in range(1, turns + 1):
        picked = sorted((a for a in records if a.mode == mode and a.turn == turn),
                        key=lambda a: a.document)
        scores = [float(a.correct) for a in picked]
        ttfts = [a.ttft_s for a in picked if a.ttft_s is not None]
        rows.append({"turn": turn, "accuracy": mean(scores),
                     "interval": wilson_interval(scores), "scores": scores,
                     "cached_tokens": mean([float(a.cached_tokens) for a in picked]),
                     "ttft_s": mean(ttfts)})
    return rows


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Paired differences of every configuration's accuracy to the full cache's, per mode
    and turn, and chat-mode speed as ratios to vanilla's."""
    from benchmarks.quality.scoring import paired_difference

    full = next((row for row in rows if row["label"] == "vanilla" and row["ok"]), None)
    for row in rows:
        if not row["ok"] or full is None:
            continue
        for mode in row["turns"]:
            for mine, theirs in zip(row["turns"][mode], full["turns"][mode]):
                mine["vs_full"] = paired_difference(mine["scores"], theirs["scores"])
                mine["of_full"] = (mine["accuracy"] / theirs["accuracy"]
                                   if theirs["accuracy"] else None)
        if full["tok_s"] and row["tok_s"]:
            row["tok_s_ratio"] = row["tok_s"] / full["tok_s"]
        chat, base = row["turns"].get("chat"), full["turns"].get("chat")
        if chat and base:
            mine_ttft = [t["ttft_s"] for t in chat if t["ttft_s"]]
            base_ttft = [t["ttft_s"] for t in base if t["ttft_s"]]
            if mine_ttft and base_ttft:
                row["ttft_ratio"] = (sum(mine_ttft) / len(mine_ttft)) / (
                    sum(base_ttft) / len(base_ttft))


def config_row(spec: CompressionSpec, outcome: Any, modes: Sequence[str],
               turns: int) -> dict[str, Any]:
    options = dict(spec.options)
    row: dict[str, Any] = {"label": spec.label, "spec": vars(spec), "ok": outcome.error is None,
                           "method": spec.method, "ratio": spec.ratio,
                           "scoring": options.get("kv_scoring"),
                           "reuse": options.get("kv_reuse"), "seconds": outcome.seconds}
    if outcome.error is not None:
        row["error"] = outcome.error
        return row
    result = outcome.result
    row["turns"] = {mode: summarize(result["answers"], mode, turns) for mode in modes}
    row["tok_s"] = (result["chat_output_tokens"] / result["chat_elapsed_s"]
                    if result["chat_elapsed_s"] else None)
    row["answers"] = result["answers"]
    row["measured_kept_fraction"] = result.get("measured_kept_fraction")
    return row


def later_turns_of_full(row: Mapping[str, Any], mode: str = "chat") -> float | None:
    """Turns 2+: the mean of each turn's accuracy over the full cache's."""
    later = [t for t in row["turns"][mode] if t["turn"] > 1 and t.get("of_full")]
    return (sum(t["of_full"] for t in later) / len(later)) if later else None


def render(rows: Sequence[Mapping[str, Any]], mode: str, turns: int) -> str:
    def cell(turn: Mapping[str, Any]) -> str:
        interval = turn.get("interval") or [0, 0]
        return f"{turn['accuracy']:.2f} [{interval[0]:.2f},{interval[1]:.2f}]"

    table = []
    for row in rows:
        if not row["ok"]:
            continue
        line: dict[str, Any] = {"config": row["label"],
                                "kept": row.get("measured_kept_fraction")}
        for turn in row["turns"][mode]:
            line[f"t{turn['turn']}"] = cell(turn)
        line["later/full"] = later_turns_of_full(row, mode)
        if mode == "chat":
            line["tok/s x"] = row.get("tok_s_ratio")
            line["ttft x"] = row.get("ttft_ratio")
        table.append(line)
    columns = [("config", "config"), ("kept", "kept (measured)")]
    columns += [(f"t{t}", f"turn {t}") for t in range(1, turns + 1)]
    columns.append(("later/full", "turns 2+ / full"))
    if mode == "chat":
        columns += [("tok/s x", "tok/s vs vanilla"), ("ttft x", "TTFT vs vanilla")]
    return format_table(table, columns)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    grid = parser.add_argument_group("configurations (the full cache always runs)")
    grid.add_argument("--methods", default="pyramidkv,snapkv,adakv")
    grid.add_argument("--ratios", default="0.5,0.75,0.875",
                      help="compression ratios (0.5 = 2x, 0.75 = 4x, 0.875 = 8x)")
    grid.add_argument("--scorings", default="window,reconstruct")
    grid.add_argument("--reuse", default="on,off")
    grid.add_argument("--configs", default="",
                      help="more configurations in the benchmarks' syntax "
                           "(pyramidkv:r=0.75+scoring=window)")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--conversations", type=int, default=20)
    workload.add_argument("--doc-tokens", type=int, default=750)
    workload.add_argument("--filler", choices=FILLERS, default="synthetic",
                          help="the documents' text around the facts: generated sentences, "
                               "or natural prose (installed packages' descriptions)")
    workload.add_argument("--answer-tokens", type=int, default=12)
    workload.add_argument("--modes", default="chat,independent")
    workload.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine (identical for every configuration)")
    engine.add_argument("--kv-cache-conversations", type=float, default=None,
                        help="KV cache in conversations at their longest, uncompressed "
                             "(default: every conversation fits)")
    add_engine_options(engine)
    add_run_options(parser, RESULTS_DIR / "shared_context.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: allowed {', '.join(MODES)}")
    try:
        specs = grid_specs(
            parse_names(args.methods, POLICY_METHODS, "methods"),
            [float(r) for r in args.ratios.split(",") if r],
            parse_names(args.scorings, SCORINGS, "scorings"),
            parse_names(args.reuse, REUSE_CHOICES, "reuse settings"))
        specs += [s for s in parse_specs(args.configs) if s.label not in {x.label for x in specs}]
        options = parse_kv_options(args.kv_option)
    except ValueError as error:
        raise SystemExit(f"configurations: {error}") from None

    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    count = token_counter(tokenizer)

    documents = make_documents(args.conversations, args.doc_tokens, args.seed, count,
                               args.filler)
    turns = len(documents[0].questions)
    prompts = Prompts(tokenizer)
    # A conversation at its end: every question and answer after the document.
    longest = max(len(prompts.independent(d, d.questions[0])) for d in documents) + turns * (
        48 + args.answer_tokens)
    dtype = resolve_dtype(args.dtype, device)
    per_token = kv_bytes_per_token(model, dtype)
    in_conversations = args.kv_cache_conversations or float(args.conversations)
    # At least eight conversations' worth: compressed engines give up the score reserve and
    # the reconstruction scratch pages out of the same bytes and must still hold one.
    kv_tokens = max(int(in_conversations * longest), 8 * longest)
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest + BLOCK_SLACK,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_tokens * per_token, seed=args.seed,
        compression_options=options,
        enable_prefix_caching=True)  # what it measures: turns that adopt earlier turns' caches
    threads = (args.threads or default_threads()) if device == "cpu" else None
    workdir = make_workdir("shared-context")
    workload = {"documents": [asdict(d) for d in documents], "modes": modes,
                "answer_tokens": args.answer_tokens}
    workload_path = write_workload(workdir, workload)
    log_path = args.log_file or workdir / "vllm.log"
    header = {
        "benchmark": "shared_context",
        "command": command_string([sys.argv[0], *argv]),
        "machine": machine_info(device),
        "settings": {**vars(settings), "kv_cache_capacity_tokens": kv_tokens,
                     "threads": threads},
        "workload": {"conversations": args.conversations, "doc_tokens": args.doc_tokens,
                     "filler": args.filler,
                     "turns": turns, "kinds": [q.kind for q in documents[0].questions],
                     "modes": modes, "answer_tokens": args.answer_tokens, "seed": args.seed},
    }
    print(f"command: {header['command']}")
    print(f"configs: {', '.join(s.label for s in specs)}; vLLM logs: {log_path}", flush=True)
    jobs = [{"id": spec.label, "spec": vars(spec), "settings": vars(settings), "isolate": True,
             "workload_path": str(workload_path)} for spec in specs]
    units = float(len(documents) * turns * len(modes))
    results = run_jobs(WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
                       units={job["id"]: units for job in jobs}, job_timeout=args.job_timeout,
                       env=worker_env(args.verbose, False, threads), desc="shared-context",
                       show_progress=not args.no_progress)
    rows = [config_row(spec, results[spec.label], modes, turns) for spec in specs]
    add_comparisons(rows)
    report = save_report(header, rows, started, args.output_json)
    for mode in modes:
        print(f"\n{mode}: accuracy per turn [95% Wilson interval]")
        print(render(rows, mode, turns))
    return conclude(report, str(args.output_json))


if __name__ == "__main__":
    sys.exit(main())
