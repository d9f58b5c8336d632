"""Prefill/decode hand-off over HTTP (issue 53 item 2): two `vllm serve` processes on one
machine, a prefill and a decode instance, the same KV-cache bytes and engine flags, per side.

    python -m benchmarks.handoff        # 48 prompts of ~1.5k tokens, 32 out, 8 at a time

- **kvcompress**: ``--kv-compression pyramidkv --kv-compression-ratio 0.875`` (8x) on both,
  ``--kv-transfer-config`` naming ``KVCompressConnector`` (a shared folder);
- **vanilla**: vLLM with its prefix cache and its ``ExampleConnector`` (KV saved to and
  loaded from a shared folder), the only vLLM connector that runs on a CPU (NIXL, Mooncake
  and LMCache need a GPU or services this machine lacks): the same transport, files.

Each request goes as vLLM's disaggregated-serving proxies send it (the client does what
``kvcompress.disagg_proxy`` does, to time each half): to the prefill instance with
``max_tokens=1``, then as asked to the decode instance, streamed. Figures per side: the
decode instance's time to first token (from sending it the request: what the hand-off has
to beat), the prefill's time, end-to-end latency, output tok/s; bytes moved per request
(kvcompress: ``kvcompress:handoff_bytes_total`` of the prefill instance; vanilla: what its
connector wrote to the folder) against the prompt's uncompressed K/V (vLLM's blocks, what a
block-moving connector such as NIXL moves). After the run, the first prompts are asked
again, one at a time, of a single instance with the side's flags and no connector:
``same as one instance`` is the share of the pair's answers that are token for token its.
Ratios: kvcompress over vanilla.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from benchmarks.serve import read_metrics, vllm_server

SIDES = ("vanilla", "kvcompress")
COMPRESSION = ("--kv-compression", "pyramidkv", "--kv-compression-ratio", "0.875")
EXPORTED = "kvcompress:handoff_bytes_total"


def transfer_flags(side: str, role: str, folder: Path) -> list[str]:
    if side == "kvcompress":
        config = {"kv_connector": "KVCompressConnector", "kv_role": role,
                  "kv_connector_extra_config": {"path": str(folder)}}
        return [*COMPRESSION, "--kv-transfer-config", json.dumps(config)]
    config = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    return ["--kv-transfer-config", json.dumps(config)]


def make_prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    """Token-id prompts (ids away from special tokens), lengths within 10% of ``tokens``."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(tokens * 9 // 10, tokens))]
            for _ in range(count)]


async def _post(session: Any, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {text[:400]}")
        return json.loads(text)


async def _stream(session: Any, url: str, body: Mapping[str, Any]) -> tuple[float, list[int]]:
    """Seconds to the first token, and the token ids (``return_token_ids``)."""
    started = time.perf_counter()
    first, tokens = None, []
    async with session.post(url, json={**body, "stream": True}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:400]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - started
                tokens += ids
    return (first if first is not None else float("nan")), tokens


def completion(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


async def run_requests(prefill: str, decode: str, model: str, prompts: Sequence[list[int]],
                       max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    async def one(session: Any, prompt: list[int]) -> dict[str, Any]:
        async with limit:
            started = time.perf_counter()
            try:
                await _post(session, f"{prefill}/v1/completions", completion(model, prompt, 1))
                prefilled = time.perf_counter()
                ttft, tokens = await _stream(session, f"{decode}/v1/completions",
                                             completion(model, prompt, max_tokens))
            except (RuntimeError, aiohttp.ClientError, json.JSONDecodeError) as error:
                return {"error": repr(error)[:300]}
            if len(tokens) != max_tokens:
                return {"error": f"{len(tokens)} of {max_tokens} tokens"}
            return {"prefill_s": prefilled - started, "decode_ttft_s": ttft,
                    "e2e_s": time.perf_counter() - started, "tokens": tokens}

    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, prompt) for prompt in prompts)))


async def ask_alone(base: str, model: str, prompts: Sequence[list[int]],
                    max_tokens: int) -> list[list[int]]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        answers = []
        for prompt in prompts:  # one at a time: one instance alone
            reply = await _post(session, f"{base}/v1/completions",
                                completion(model, prompt, max_tokens))
            answers.append(reply["choices"][0]["token_ids"])
        return answers


def served(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [result for result in results if "error" not in result]


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def token_bytes(model: str, dtype: str) -> int:
    """Bytes of one token's K and V over every layer (vLLM's blocks, per token)."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    width = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * heads * head_dim * width


def run_side(args: argparse.Namespace, side: str, prompts: list[list[int]],
             workdir: Path) -> dict[str, Any]:
    folder = workdir / f"{side}-store"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--kv-cache-memory-bytes", args.kv_cache_memory_bytes]
    producer = [*common, *transfer_flags(side, "kv_producer", folder)]
    consumer = [*common, *transfer_flags(side, "kv_consumer", folder)]
    with vllm_server(args.model, producer, workdir / f"{side}-prefill.log") as prefill, \
            vllm_server(args.model, consumer, workdir / f"{side}-decode.log") as decode:
        asyncio.run(run_requests(prefill, decode, args.model, make_prompts(2, 64, 99), 2, 2))
        before = read_metrics(prefill, (EXPORTED,))
        written_before = folder_bytes(folder)
        started = time.perf_counter()
        results = asyncio.run(run_requests(prefill, decode, args.model, prompts,
                                           args.output_len, args.concurrency))
        duration = time.perf_counter() - started
        moved = (read_metrics(prefill, (EXPORTED,)).get(EXPORTED, 0) - before.get(EXPORTED, 0)
                 if side == "kvcompress" else folder_bytes(folder) - written_before)
    single = [*common, *(COMPRESSION if side == "kvcompress" else ())]
    with vllm_server(args.model, single, workdir / f"{side}-single.log") as base:
        try:
            alone = asyncio.run(ask_alone(base, args.model, prompts[:args.check_prompts],
                                          args.output_len))
        except RuntimeError:
            alone = []
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    same = [result.get("tokens") == answer for result, answer in zip(results, alone)]
    ok = served(results)
    ttft = [result["decode_ttft_s"] for result in ok]
    errors = sorted({result["error"] for result in results if "error" in result})
    return {
        "label": side, "ok": True,
        "serve_flags": {"prefill": producer, "decode": consumer},
        "requests": len(prompts), "failed": len(results) - len(ok), "errors": errors[:5],
        "concurrency": args.concurrency,
        "prompt_tokens": prompt_tokens, "duration_s": duration,
        "output_tok_s": sum(len(result["tokens"]) for result in ok) / duration,
        "decode_ttft_mean_s": mean(ttft), "decode_ttft_p50_s": percentile(ttft, 0.5),
        "decode_ttft_p90_s": percentile(ttft, 0.9),
        "prefill_mean_s": mean([result["prefill_s"] for result in ok]),
        "e2e_mean_s": mean([result["e2e_s"] for result in ok]),
        "bytes_per_request": moved / len(prompts),
        "bytes_vs_uncompressed": moved / (prompt_tokens * token_bytes(args.model, args.dtype)),
        "same_as_one_instance": sum(same) / len(same) if same else float("nan"),
        "checked": len(same),
    }


def add_ratios(runs: list[dict[str, Any]]) -> None:
    reference = runs[0]
    for run in runs[1:]:
        run["ratios"] = {key: run[key] / reference[key] for key in (
            "decode_ttft_mean_s", "decode_ttft_p50_s", "decode_ttft_p90_s", "prefill_mean_s",
            "e2e_mean_s", "output_tok_s", "bytes_per_request") if reference[key]}


COLUMNS = (("label", "side"), ("concurrency", "at once"), ("failed", "failed"),
           ("decode_ttft_mean_s", "decode TTFT s"),
           ("decode_ttft_p90_s", "p90"), ("prefill_mean_s", "prefill s"),
           ("e2e_mean_s", "e2e s"), ("output_tok_s", "out tok/s"),
           ("bytes_per_request", "bytes/request"), ("bytes_vs_uncompressed", "x uncompressed"),
           ("same_as_one_instance", "same as one instance"))


def render(runs: Sequence[Mapping[str, Any]]) -> str:
    table = format_table(runs, COLUMNS)
    ratios = [f"{run['label']} / {runs[0]['label']}: " + ", ".join(
        f"{key} {value:.2f}x" for key, value in run.get("ratios", {}).items()) for run in runs[1:]]
    return "\n".join([table, "", *ratios])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".models/SmolLM2-135M-Instruct")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="vanilla, kvcompress or both (the first is the ratios' reference)")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--check-prompts", type=int, default=16,
                        help="prompts asked again of one instance (the side's flags)")
    parser.add_argument("--kv-cache-memory-bytes", default="400M")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "handoff.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not sides or any(side not in SIDES for side in sides):
        raise SystemExit(f"--sides: choose from {', '.join(SIDES)}, got {args.sides!r}")
    started = time.perf_counter()
    command, machine = command_string([sys.argv[0], *argv]), machine_info("cpu")
    print(f"command: {command}")
    prompts = make_prompts(args.num_prompts, args.prompt_tokens, args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="handoff-") as temporary:
        workdir = args.keep_logs or Path(temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        for side in sides:
            runs.append(run_side(args, side, prompts, workdir))
            print(render(runs[-1:]), flush=True)
    add_ratios(runs)
    report = {"benchmark": "handoff", "command": command, "machine": machine,
              "settings": dict(vars(args)),  # (write_json writes paths as text)
              "configs": runs, "runtime_s": time.perf_counter() - started}
    write_json(args.json, report)
    print()
    print(render(runs))
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
