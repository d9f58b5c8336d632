"""Load and aborts over real HTTP (loopback, bounded in count and time): concurrent streaming
chats with long prompts in a pool tight enough to preempt, a third of the clients hanging up
mid-stream, malformed JSON and bad vllm_xargs mixed in. Afterwards nothing runs, every page is
free, the server is healthy and answers; the page invariants were checked after every engine
step (KVCOMPRESS_CHECK_PAGES=1, inherited by the server: a broken one stops the engine)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.serving import client, kv_usage, long_question, metric, running_server

pytestmark = pytest.mark.slow

CLIENTS = 9
WORKERS = 6  # requests in flight at once
# ~1700 uncompressed tokens of the embedded model in float32 (92M: pages plus the score reserve,
# see kvcompress/engine/scoring_memory.py). The default scoring: no --kv-scoring flag, and the
# embedded model has its surrogate beside it (scripts/setup.sh), so auto resolves to
# the surrogate, the configuration served by default. Half the chats keep their whole
# cache (~700-token prompts, 256 new tokens): two of them fit when admitted but not once they
# have grown, so they preempt each other, while compressed chats (~1000-token prompts, 32 new
# tokens, budget 64) squeeze in beside them. Admitted as vLLM does (no growth reserved), or
# the second would wait instead.
FLAGS = ("--kv-compression", "pyramidkv", "--kv-budget", "64", "--kv-cache-memory-bytes",
         "92M", "--max-model-len", "1500", "--max-num-seqs", "8",
         "--kv-admission-lookahead", "0")
FULL_CACHE_TOKENS, COMPRESSED_TOKENS = 256, 32


def chat_body(model: str, number: int, stream: bool) -> dict:
    full_cache = number % 2 == 1
    # Full-cache chats open with their own words: identical prompts waiting together would
    # share one computed prefix (engine/sched/prefix_segments.py) and fit without preempting.
    content = (f"Chat {number}. {long_question(500)}" if full_cache
               else long_question(600 + 10 * number))
    body = {
        "model": model, "stream": stream, "temperature": 0, "ignore_eos": True,
        "max_tokens": FULL_CACHE_TOKENS if full_cache else COMPRESSED_TOKENS,
        "messages": [{"role": "user", "content": content}],
    }
    if full_cache:
        body["vllm_xargs"] = {"kv_compression": "none"}
    return body


def one_client(base: str, model: str, number: int) -> str:
    url = f"{base}/v1/chat/completions"
    kind = number % 3
    if kind == 0:  # hangs up after a few chunks
        with requests.post(url, json=chat_body(model, number, True), stream=True,
                           timeout=300) as response:
            assert response.status_code == 200
            for count, _ in enumerate(response.iter_lines()):
                if count >= 3:
                    break
        return "disconnected"
    if kind == 1:  # streams to the end
        with requests.post(url, json=chat_body(model, number, True), stream=True,
                           timeout=300) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == b"data: [DONE]" and not any(b'"error"' in line for line in lines)
        return "streamed"
    response = requests.post(url, json=chat_body(model, number, False), timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == chat_body(model, number,
                                                                       False)["max_tokens"]
    return "answered"


def bad_requests(base: str, model: str) -> None:
    url = f"{base}/v1/chat/completions"
    malformed = requests.post(url, data=b'{"model": "m", "messages": [', timeout=30,
                              headers={"Content-Type": "application/json"})
    assert malformed.status_code == 400
    body = {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "vllm_xargs": {"kv_compression": "snapkv", "kv_window": 0}}
    bad = requests.post(url, data=json.dumps(body), timeout=30,
                        headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "kv_window" in bad.text


def test_load_and_abort_soak_leaves_the_server_clean(embedded_model, tmp_path):
    with running_server(embedded_model, tmp_path, *FLAGS) as (base, log_path):
        assert "scoring=surrogate" in log_path.read_text()  # what auto resolved to
        model = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        # First two full-cache chats alone: both fit when admitted (2 x 784 prompt tokens of
        # ~1700), neither once they have grown by 256, so one must be preempted.
        with ThreadPoolExecutor(2) as pair:
            assert list(pair.map(lambda n: one_client(base, model, n), [5, 11])) == [
                "answered", "answered"]
        preempted = requests.get(f"{base}/metrics", timeout=10).text
        assert metric(preempted, "vllm:num_preemptions_total") > 0  # the pool is tight indeed
        with ThreadPoolExecutor(WORKERS) as pool:
            jobs = [pool.submit(one_client, base, model, number) for number in range(CLIENTS)]
            for _ in range(3):
                jobs.append(pool.submit(bad_requests, base, model))
            results = [job.result(timeout=900) for job in jobs]
        assert results.count("disconnected") == CLIENTS // 3

        deadline = time.monotonic() + 60  # aborts reach the engine asynchronously
        while True:
            text = requests.get(f"{base}/metrics", timeout=10).text
            running = metric(text, "vllm:num_requests_running")
            waiting = metric(text, "vllm:num_requests_waiting")
            if (running, waiting, kv_usage(base)) == (0, 0, 0.0):
                break
            assert time.monotonic() < deadline, (running, waiting, kv_usage(base))
            time.sleep(1)
        assert metric(text, "kvcompress:compressed_requests_total") > 0
        assert metric(text, "kvcompress:failed_requests_total") == 0
        assert (metric(text, "kvcompress:pages_free") + metric(text, "kvcompress:pages_cached")
                == metric(text, "kvcompress:pages_total"))
        assert requests.get(f"{base}/health", timeout=10).status_code == 200
        reply = client(base).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4)
        assert reply.choices[0].message.content
        assert "Traceback" not in log_path.read_text()
