"""A real `vllm serve` of the embedded model with --kv-compression, over real HTTP."""

from __future__ import annotations

import re
import subprocess

import openai
import pytest
import requests

from tests.e2e.serving import (
    client,
    free_port,
    kv_usage,
    long_question,
    metric,
    running_server,
    serve_command,
    server_env,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(embedded_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("serve")
    flags = ("--kv-compression", "pyramidkv", "--kv-budget", "64",
             "--enable-prompt-tokens-details")
    with running_server(embedded_model, log_dir, *flags) as (base, log_path):
        yield base, embedded_model, log_path


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


def test_metrics_say_which_scoring_auto_chose(server):
    """The default scoring (auto) resolved at start to the embedded model's surrogate (set-up
    made it), and its held-out figures are there for a dashboard."""
    base, _, _ = server
    text = requests.get(f"{base}/metrics", timeout=10).text
    assert metric(text, "kvcompress:scoring_info", requested="auto", scoring="surrogate") == 1
    assert 0.5 < metric(text, "kvcompress:surrogate_held_out", kind="all",
                        figure="overlap_4x") <= 1


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


def test_next_chat_turn_reports_the_previous_turn_as_cached(server):
    """Multi-turn reuse over HTTP: the second turn adopts the first turn's compressed cache
    (its whole prompt and answer, as far as the chat template re-renders them alike)."""
    base, model, _ = server
    before = requests.get(f"{base}/metrics", timeout=10).text
    messages = [{"role": "user", "content": long_question()}]
    first = client(base).chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the grass? One word."}]
    second = client(base).chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert second.choices[0].message.content.strip()
    text = requests.get(f"{base}/metrics", timeout=10).text

    def grew(name: str) -> float:
        # A fresh server lists a labelled counter's HELP line before its first sample.
        sampled_before = re.search(rf"^{re.escape(name)}\{{", before, re.MULTILINE)
        return metric(text, name) - (metric(before, name) if sampled_before else 0)

    assert grew("vllm:prefix_cache_hits_total") >= cached
    assert grew("kvcompress:adopted_tokens_total") >= cached
    assert metric(text, "kvcompress:pages_cached") > 0
    assert kv_usage(base) == 0.0  # cached pages are evictable, not in use


def test_chats_sent_at_once_share_their_system_prompt(server):
    """Eight chats on one long system prompt sent at once (issue 40): the engine computes the
    shared prefix once for those that wait together (a segment request, not seen by any
    client: every reply is a client's, or a fork of the first chat's pages when it ran
    alone), they report it as cached, and all answer."""
    from concurrent.futures import ThreadPoolExecutor

    base, model, _ = server
    system = long_question(700).rsplit("\n", 1)[0]
    before = requests.get(f"{base}/metrics", timeout=10).text

    def ask(number: int):
        return client(base).chat.completions.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {number}: what color is the "
                                                  "sky? One word."}])

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    assert all(reply.choices[0].message.content.strip() for reply in replies)
    cached = [reply.usage.prompt_tokens_details.cached_tokens or 0 for reply in replies]
    text = requests.get(f"{base}/metrics", timeout=10).text

    def grew(name: str) -> float:
        def value(page: str) -> float:
            try:
                return metric(page, name)
            except AssertionError:  # a counter never incremented has no sample
                return 0.0
        return value(text) - value(before)

    segment_tokens = grew("kvcompress:prefix_segment_tokens_total")
    fork_tokens = grew("kvcompress:prefix_fork_tokens_total")
    # The first chat may be admitted alone: then the others read a fork of its pages; else
    # they read a segment computed once.
    assert segment_tokens + fork_tokens > 500
    assert sum(count >= 500 for count in cached) >= 6, cached


def assert_bad_budget_is_http_400(base: str, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client(base).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"vllm_xargs": {"kv_budget": -3}},
        )
    assert "kv_budget" in str(error.value)


def test_bad_per_request_setting_is_http_400_and_harms_nobody(server):
    base, model, _ = server
    assert_bad_budget_is_http_400(base, model)
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
            assert_bad_budget_is_http_400(base, model)
        reply = client(base).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4)
        assert reply.choices[0].message.content
        assert "ApiServer_1" in log_path.read_text()  # two API-server processes served
