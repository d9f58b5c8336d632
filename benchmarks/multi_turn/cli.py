"""Multi-turn conversations: time to first token and reused prompt tokens per turn, vanilla
vLLM with prefix caching vs kvcompress without and with multi-turn reuse (``kv_reuse``).

Each conversation has ``--turns`` turns. A turn adds a user message of about
``--user-tokens`` tokens (filler text, as the quality tasks' haystacks) and the model's answer
(greedy, exactly ``--answer-tokens`` tokens: ``min_tokens`` = ``max_tokens`` masks the stop
tokens, so every configuration does the same work without ``ignore_eos`` writing past an
end-of-turn token). The next turn's prompt is the conversation so far through the model's chat
template, the previous answer as the assistant message, tokenized as vLLM's chat endpoint does
(``add_special_tokens=False``):

    python -m benchmarks.multi_turn                             # defaults, 3 configurations
    python -m benchmarks.multi_turn --conversations 16 --turns 6 --user-tokens 300 \\
        --answer-tokens 64 --configs vanilla,pyramidkv:256+reuse=off,pyramidkv:256+reuse=on
    python -m benchmarks.multi_turn --recall                    # pass key in turn 1, asked last

Configurations: ``vanilla`` (vLLM with its prefix cache on), ``vanilla-noprefix`` (prefix
cache off), and kvcompress as in the other benchmarks (``METHOD:BUDGET``, ``METHOD:r=RATIO``)
with ``+reuse=on`` / ``+reuse=off`` (``kv_reuse``; on when left out). Every configuration runs
in its own worker process with the same engine settings and the same KV-cache bytes; the
engine runs vLLM's default, prefix caching on (kvcompress turns its own reuse off when prefix
caching is off), except ``vanilla-noprefix``, so only ``additional_config`` differs.

Memory-bound by default: the KV cache holds ``--kv-cache-conversations`` (3) conversations at
their longest, uncompressed, while there are many more conversations. ``--arrivals rounds``
(default) submits turn k of every conversation, waits for all of them, then turn k + 1;
``closed`` submits a conversation's next turn as soon as its answer is finished.

Time to first token: measured by the driver (the in-process engine is stepped here), from
just before ``add_request`` to the return of the engine step whose output first holds a token
of the request, on the monotonic clock. That is what vLLM's ``RequestOutput.metrics``
(``RequestStateStats.first_token_latency``, present offline when stats are on, and kept as
``ttft_vllm_s``) measures too, but vLLM takes it on the wall clock, which this VM steps (a
29 s jump inside one round was seen). It includes waiting for memory and for other requests
(in a memory-bound round most of it), so the table also splits it, from the engine core's
monotonic timestamps, into queue (queued -> first scheduled) and prefill (first scheduled ->
first token, which includes every step shared with other requests and any preemption).
Cached tokens: ``RequestOutput.num_cached_tokens`` (vLLM's prefix-cache hit for vanilla, the
adopted tokens of a finished request's compressed cache for kvcompress with reuse), and the
scheduler's prefix-cache queries / hits summed over steps. Context match: the longest common
token prefix of a turn's prompt with the previous turn's prompt + answer tokens, the most any
cache of the previous request can serve (the chat template re-tokenizes the answer text).

``--recall``: turn 1's user message hides a pass key in filler (``quality/tasks.py``), turns
2..N-1 add filler, turn N asks for it (the answer starts "The pass key is", greedy, short):
accuracy with its 95% Wilson interval, and the paired difference to vanilla and to kvcompress
without reuse over the same conversations. The KV cache then holds every conversation, so
reuse is limited by the compressed cache it adopts, not by evictions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.jobs import make_workdir, run_jobs, worker_env, worker_main, write_workload
from benchmarks.multi_turn.configs import DEFAULT_CONFIGS, check_settings, parse_configs
from benchmarks.multi_turn.driver import ARRIVALS
from benchmarks.multi_turn.report import plot, plot_title, render, render_recall
from benchmarks.multi_turn.summary import add_ratios, add_recall, add_tier_figures, config_row
from benchmarks.multi_turn.worker import run_job
from benchmarks.multi_turn.workload import (
    PROMPT_BUILDS,
    PromptBuilder,
    chat_conversations,
    longest_conversation,
    recall_conversations,
)
from benchmarks.report import (
    RESULTS_DIR,
    command_string,
    conclude,
    machine_info,
    save_report,
)
from benchmarks.specs import (
    EngineSettings,
    benchmark_parser,
    default_model_dir,
    default_threads,
    detect_device,
    kv_bytes_per_token,
    parse_kv_options,
    resolve_dtype,
    token_counter,
)

WORKER_MODULE = "benchmarks.multi_turn"  # workers: python -m WORKER_MODULE --worker ...
# --recall: its own defaults (flags given still win)
RECALL_DEFAULTS = {
    "conversations": 20, "turns": 4, "user_tokens": 200, "answer_tokens": 24,
    "output_json": RESULTS_DIR / "multi_turn_recall.json",
}
BLOCK_SLACK = 128  # vLLM's KV block on CPU, in tokens


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(WORKER_MODULE, __doc__)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated: vanilla (prefix caching on), vanilla-noprefix, "
                             "METHOD:BUDGET or METHOD:r=RATIO with +reuse=on|prompts|off and "
                             "+offload=GIB (kvcompress's offload tier, --kv-offloading-size)")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--recall", action="store_true",
                          help="pass-key recall across turns; defaults: " + ", ".join(
                              f"{key}={value}" for key, value in RECALL_DEFAULTS.items()
                              if key != "output_json") + " (flags given still win)")
    workload.add_argument("--conversations", type=int, default=10)
    workload.add_argument("--turns", type=int, default=5)
    workload.add_argument("--user-tokens", type=int, default=200,
                          help="tokens of each turn's user message (about)")
    workload.add_argument("--answer-tokens", type=int, default=48,
                          help="tokens of each answer (exactly, greedy)")
    workload.add_argument("--arrivals", choices=ARRIVALS, default="rounds",
                          help="rounds: turn k of every conversation, then k + 1; closed: a "
                               "conversation's next turn as soon as its answer is done")
    workload.add_argument("--prompt-build", choices=PROMPT_BUILDS, default="template",
                          help="template: each prompt through the chat template (re-tokenizes "
                               "the answers); tokens: previous prompt + answer ids + new text")
    workload.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("engine (identical for every configuration)")
    engine.add_argument("--kv-cache-conversations", type=float, default=None,
                        help="KV cache in conversations at their longest, uncompressed "
                             "(default 3; --recall: every conversation)")
    engine.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache in uncompressed tokens; overrides "
                             "--kv-cache-conversations")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--dtype", default="auto",
                        help="auto = bfloat16, or float32 on CPUs without native bf16")
    engine.add_argument("--compile", action="store_true",
                        help="torch.compile / CUDA graphs (default: enforce_eager)")
    engine.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the in-process engine (default: cores - 1)")
    engine.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra kvcompress setting for compressed runs, e.g. kv_window=16")
    run = parser.add_argument_group("run")
    run.add_argument("--no-warmup", dest="warmup", action="store_false")
    run.add_argument("--job-timeout", type=float, default=1800.0,
                     help="seconds before a configuration is killed")
    run.add_argument("--output-json", type=Path, default=RESULTS_DIR / "multi_turn.json")
    run.add_argument("--plot", type=Path, default=None,
                     help="PNG of TTFT and prefilled tokens per turn (default: next to the "
                          "JSON; needs matplotlib)")
    run.add_argument("--log-file", type=Path, default=None,
                     help="vLLM logs (default: a temporary folder)")
    run.add_argument("--verbose", action="store_true", help="INFO-level vLLM logs in the log")
    run.add_argument("--no-progress", action="store_true")
    return parser


def check_args(args: argparse.Namespace) -> None:
    for name in ("conversations", "turns", "user_tokens", "answer_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.recall and args.turns < 2:
        raise SystemExit("--recall needs --turns >= 2")



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    parser = build_parser()
    if "--recall" in argv:
        parser.set_defaults(**RECALL_DEFAULTS)
    args = parser.parse_args(argv)
    check_args(args)
    started = time.perf_counter()
    try:
        configs = parse_configs(args.configs)
        options = parse_kv_options(args.kv_option)
        check_settings(configs, options)
    except ValueError as error:
        raise SystemExit(f"--configs: {error}") from None

    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    count = token_counter(tokenizer)

    make = recall_conversations if args.recall else chat_conversations
    conversations = make(args.conversations, args.turns, args.user_tokens, args.seed, count)
    builder = PromptBuilder(tokenizer, args.prompt_build)
    longest = max(longest_conversation(builder, c, args.answer_tokens) for c in conversations)
    dtype = resolve_dtype(args.dtype, device)
    per_token = kv_bytes_per_token(model, dtype)
    in_conversations = args.kv_cache_conversations or (
        float(args.conversations) if args.recall else 3.0)
    # vLLM also needs its null block and a whole block for the last partial one (128 tokens
    # each on CPU): a tiny pool of "one conversation" would refuse to start
    kv_tokens = args.kv_cache_tokens or max(int(in_conversations * longest),
                                            longest + 2 * BLOCK_SLACK)
    if kv_tokens < longest:
        raise SystemExit(f"the KV cache ({kv_tokens} tokens) must hold one conversation "
                         f"({longest} tokens)")
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_tokens * per_token, enforce_eager=not args.compile,
        seed=args.seed, compression_options=options,
    )
    threads = (args.threads or default_threads()) if device == "cpu" else None
    workdir = make_workdir("multi-turn")
    workload = {
        "kind": "recall" if args.recall else "chat",
        "conversations": [asdict(c) for c in conversations],
        "turns": args.turns, "user_tokens": args.user_tokens,
        "answer_tokens": args.answer_tokens, "arrivals": args.arrivals,
        "prompt_build": args.prompt_build, "seed": args.seed,
    }
    workload_path = write_workload(workdir, workload)
    log_path = args.log_file or workdir / "vllm.log"
    described = {key: value for key, value in workload.items() if key != "conversations"}
    described.update(num_conversations=len(conversations), longest_conversation_tokens=longest,
                     kv_cache_conversations=kv_tokens / longest)
    header = {
        "benchmark": "multi_turn_recall" if args.recall else "multi_turn",
        "command": command_string([sys.argv[0], *argv]),
        "machine": machine_info(device),
        "settings": {**vars(settings), "kv_cache_capacity_tokens": kv_tokens,
                     "kv_bytes_per_token": per_token, "threads": threads,
                     "enable_prefix_caching": {c.label: c.prefix_caching for c in configs},
                     "warmup": args.warmup},
        "workload": described,
        "ttft_measurement": TTFT_MEASUREMENT,
    }
    print(f"command: {header['command']}")
    print(f"settings: {json.dumps(header['settings'])}")
    print(f"workload: {json.dumps(described)}")
    print(f"configs: {', '.join(c.label for c in configs)}; vLLM logs: {log_path}", flush=True)

    jobs = [{"id": config.label, "config": config.to_json(), "settings": vars(settings),
             "isolate": True, "workload_path": str(workload_path), "warmup": args.warmup}
            for config in configs]
    units = float(len(conversations) * args.turns * args.answer_tokens)
    results = run_jobs(
        WORKER_MODULE, jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: units for job in jobs}, job_timeout=args.job_timeout,
        env=worker_env(args.verbose, False, threads), desc="multi-turn",
        show_progress=not args.no_progress,
    )
    rows = [config_row(config, results[config.label]) for config in configs]
    add_ratios(rows)
    add_tier_figures(rows, per_token)
    if args.recall:
        add_recall(rows, conversations)
    report = save_report(header, rows, started, args.output_json)
    print()
    print(render(rows))
    if args.recall:
        print()
        print(render_recall(rows))
    png = args.plot or args.output_json.with_suffix(".png")
    if plot(rows, png, plot_title(report)):
        print(f"\nplot: {png}")
    return conclude(report, str(args.output_json))


TTFT_MEASUREMENT = (
    "ttft_s: monotonic time from just before add_request to the return of the engine step "
    "whose RequestOutput first holds a token (the in-process engine is stepped by the "
    "benchmark), queueing included; ttft_vllm_s: vLLM's RequestOutput.metrics."
    "first_token_latency, the same interval on the wall clock (which the VM may step); "
    "queue_s = scheduled_ts - queued_ts and prefill_s = first_token_ts - scheduled_ts from the "
    "engine core's monotonic timestamps. Cached tokens: RequestOutput.num_cached_tokens."
)

