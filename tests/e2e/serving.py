"""Starting a real `vllm serve` on loopback for the end-to-end tests, and reading it."""

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


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text,
                             re.MULTILINE):
        if all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"{name} {labels} missing from /metrics"
    return total
