"""A real `vllm serve` of the embedded model with --kv-compression, over real HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

pytestmark = pytest.mark.slow

VLLM = str(Path(sys.executable).with_name("vllm"))
STARTUP_TIMEOUT = 420


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(model: str, port: int, *flags: str) -> list[str]:
    return [
        VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
        "--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory-bytes", "512M",
        *flags,
    ]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the real deployment layout
    return env


@contextlib.contextmanager
def running_server(model: str, log_dir: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    """`vllm serve` on a free loopback port until the block ends: (base URL, log path)."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(serve_command(model, port, *flags), stdout=log,
                                   stderr=subprocess.STDOUT, env=server_env())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited early:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/v1/models", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield base, log_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def server(embedded_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("serve")
    flags = ("--kv-compression", "pyramidkv", "--kv-budget", "64")
    with running_server(embedded_model, log_dir, *flags) as (base, log_path):
        yield base, embedded_model, log_path


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def long_question(words: int = 900) -> str:
    filler = " ".join(
        f"The grass is green and the sky is blue, note {i}." for i in range(words // 10)
    )
    return f"{filler}\nQuestion: what color is the sky? Answer in one word."


def kv_usage(base: str) -> float:
    text = requests.get(f"{base}/metrics", timeout=10).text
    match = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, "vllm:kv_cache_usage_perc missing from /metrics"
    return float(match.group(1))


def test_chat_completion_over_http(server):
    base, model, log_path = server
    reply = client(base).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0,
    )
    assert reply.choices[0].message.content.strip()
    assert "kvcompress: KV-cache compression on (method=pyramidkv budget=64" in (
        log_path.read_text()
    )


def usage_while_streaming(base: str, model: str, extra: dict) -> float:
    stream = client(base).chat.completions.create(
        model=model, messages=[{"role": "user", "content": long_question()}],
        max_tokens=48, temperature=0, stream=True,
        extra_body={"ignore_eos": True, **extra},
    )
    peak = 0.0
    for number, _ in enumerate(stream):
        if number in (4, 12, 24):
            peak = max(peak, kv_usage(base))
    return peak


def test_kv_usage_metric_shows_the_saving(server):
    base, model, _ = server
    compressed = usage_while_streaming(base, model, {})
    full = usage_while_streaming(base, model, {"vllm_xargs": {"kv_compression": "none"}})
    assert 0 < compressed < full / 4, (compressed, full)
    assert kv_usage(base) == 0.0  # both finished: every page is free again


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text,
                             re.MULTILINE):
        if all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"{name} {labels} missing from /metrics"
    return total


def test_compression_shows_in_metrics(server):
    base, model, _ = server
    before = requests.get(f"{base}/metrics", timeout=10).text
    client(base).chat.completions.create(
        model=model, messages=[{"role": "user", "content": long_question()}], max_tokens=4,
    )
    text = requests.get(f"{base}/metrics", timeout=10).text
    name = "kvcompress:compressed_requests_total"
    assert metric(text, name) >= 1 + (metric(before, name) if name in before else 0)
    assert metric(text, "kvcompress:evicted_tokens_total", phase="prompt") > 0
    kept = metric(text, "kvcompress:request_kept_fraction_sum")
    count = metric(text, "kvcompress:request_kept_fraction_count")
    assert count >= 1 and 0 < kept / count < 0.5  # budget 64 of ~900-token prompts
    assert metric(text, "kvcompress:compaction_seconds_count") >= 1
    assert metric(text, "kvcompress:scoring_seconds_count") >= 1
    total = metric(text, "kvcompress:pages_total")
    assert total > 0 and 0 < metric(text, "kvcompress:pages_free") <= total
    assert metric(text, "kvcompress:failed_requests_total") == 0


def test_bad_per_request_setting_is_http_400_and_harms_nobody(server):
    base, model, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        client(base).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"vllm_xargs": {"kv_budget": -3}},
        )
    assert "kv_budget" in str(error.value)
    reply = client(base).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        extra_body={"vllm_xargs": {"kv_compression": "snapkv", "kv_budget": 32}},
    )
    assert reply.choices[0].message.content


def test_invalid_flag_stops_the_server_before_the_engine(embedded_model):
    result = subprocess.run(
        serve_command(embedded_model, free_port(), "--kv-compression", "pyramidkv",
                      "--kv-budget", "0"),
        capture_output=True, text=True, timeout=300, env=server_env(),
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "--kv-budget" in output and ">= 1" in output
    assert "Initializing a V1 LLM engine" not in output


def test_per_request_validation_holds_in_every_api_server(embedded_model, tmp_path):
    """With two API-server processes each validates vllm_xargs (each builds its own engine
    config through the hook); a bad setting is a 400 whichever process takes it."""
    flags = ("--kv-compression", "pyramidkv", "--kv-budget", "64", "--api-server-count", "2")
    with running_server(embedded_model, tmp_path, *flags) as (base, log_path):
        model = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        for _ in range(8):  # the two processes share the port: both get some
            with pytest.raises(openai.BadRequestError) as error:
                client(base).chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                    extra_body={"vllm_xargs": {"kv_budget": -3}},
                )
            assert "kv_budget" in str(error.value)
        reply = client(base).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4)
        assert reply.choices[0].message.content
        assert "ApiServer_1" in log_path.read_text()  # two API-server processes served
