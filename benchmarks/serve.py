"""A `vllm serve` for the HTTP benchmarks (streaming_latency, serve_prefix): start it on a
free local port with its log in a file, wait until it answers, stop it on exit; and read
counters from its Prometheus ``/metrics``.

Only the standard library: the parents' ``--help`` stays fast and needs no vLLM import.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

VLLM = str(Path(sys.executable).with_name("vllm"))
STARTUP_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: str, options: Sequence[str], log_path: Path,
                startup_timeout: float = STARTUP_TIMEOUT) -> Iterator[str]:
    """``vllm serve MODEL --host 127.0.0.1 --port P OPTIONS...``, its output in
    ``log_path``; yields its base URL once its port answers, terminates it on exit."""
    port = free_port()
    command = [VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(port), *options]
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                        timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not start")
            time.sleep(1)
        time.sleep(2)  # the socket opens before the routes are ready on some versions
        yield base
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` (exact sample names, e.g. ``vllm:prompt_tokens_total``) summed over
    its label sets in a Prometheus text exposition; absent names are left out."""
    wanted = set(names)
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in wanted:
            with contextlib.suppress(ValueError):
                sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(3))
    return sums


def read_metrics(base: str, names: Sequence[str]) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        return parse_metrics(response.read().decode(), names)


def metrics_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each counter of ``after`` grew by since ``before`` (a name missing before: 0)."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}
