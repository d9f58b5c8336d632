"""Prefill/decode hand-off (``--kv-transfer-config`` naming ``KVCompressConnector``): a
prefill instance compresses each prompt and hands its kept rows and first token to a decode
instance through a folder; the decode instance adopts them and continues. Its answers are
one instance's, token for token (compressed or not); only kept rows move; a failed or
unusable hand-off makes the request prefill itself, and nothing leaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests
from vllm.config import KVTransferConfig

from kvcompress.engine.worker.offload import FAULT_ENV
from tests.e2e.serving import client, free_port, long_question, metric, running_server

from .harness import EngineHarness, greedy, random_prompts
from .test_reuse import ENGINE, assert_pages_back

pytestmark = pytest.mark.slow

SETTINGS = {"kv_compression": "pyramidkv", "kv_compression_ratio": 0.875}  # 8x
LENGTHS = [300, 337, 374, 411, 190]
TOKEN_BYTES = 4 * 2 * 2 * 32 * 4  # tiny_llama: layers x (K, V) x KV heads x head dim x fp32


def run(model: str, prompts: dict, max_tokens: int, folder: str | None = None,
        role: str | None = None, engine_extra: dict | None = None,
        **request_settings) -> tuple[dict, dict, dict]:
    engine = {**ENGINE, **(engine_extra or {})}
    if role is not None:
        engine["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVCompressConnector", kv_role=role,
            kv_connector_extra_config={"path": folder})
    harness = EngineHarness(model, SETTINGS, kv_cache_memory_bytes=64 << 20, **engine)
    try:
        outputs = harness.generate(prompts, greedy(max_tokens, extra_args=request_settings))
        cached = {request_id: harness.cached_tokens.get(request_id, 0) for request_id in prompts}
        assert_pages_back(harness)
        totals = vars(harness.scheduler.reuse.totals)
        reasons = dict(harness.finish_reasons)
    finally:
        harness.shutdown()
    return outputs, cached, {**totals, "reasons": reasons}


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
               if name.endswith(".pt"))


@pytest.mark.parametrize("request_settings", [{}, {"kv_compression": "none"}],
                         ids=["pyramidkv", "none"])
def test_a_decode_instance_answers_as_one_instance_from_the_handed_off_rows(
        tiny_llama, tmp_path, request_settings):
    folder = str(tmp_path)
    prompts = random_prompts(LENGTHS, seed=3)
    single, _, _ = run(tiny_llama, prompts, 16, **request_settings)
    first, _, _ = run(tiny_llama, prompts, 1, folder, "kv_producer", **request_settings)
    moved = folder_bytes(folder)
    decoded, cached, totals = run(tiny_llama, prompts, 16, folder, "kv_consumer",
                                  **request_settings)
    # The prefill instance's token first, then the rest from the adopted rows: one
    # instance's answer, token for token; the whole prompt came from the hand-off.
    assert decoded == single
    assert all(decoded[r][0] == first[r][0] for r in prompts)
    assert cached == {r: len(prompt) for r, prompt in prompts.items()}
    assert totals["handoffs"] == len(prompts) and os.listdir(folder) == []
    # Bytes moved against vLLM's blocks of the same prompts: the kept rows only.
    uncompressed = sum(len(prompt) for prompt in prompts.values()) * TOKEN_BYTES
    if request_settings:
        assert uncompressed <= moved < 1.2 * uncompressed  # whole pages, the last partial
    else:
        assert moved <= uncompressed / 5  # an eighth of each row, in whole 16-token pages


def test_tp2_every_rank_hands_off_its_own_heads(tiny_llama_kv4, tmp_path, monkeypatch):
    """Tensor parallel 2 on both sides: each rank writes and reads its own KV heads' rows;
    a hand-off is taken only when every rank's is there, and the answers are one TP 2
    instance's."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # (one NUMA node here)
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    folder = str(tmp_path)
    prompts = random_prompts(LENGTHS[:3], seed=6)
    single, _, _ = run(tiny_llama_kv4, prompts, 10, engine_extra=tp2)
    run(tiny_llama_kv4, prompts, 1, folder, "kv_producer", engine_extra=tp2)
    assert sorted({name.split(".")[1] for name in os.listdir(folder)}) == ["r0", "r1"]
    decoded, cached, totals = run(tiny_llama_kv4, prompts, 10, folder, "kv_consumer",
                                  engine_extra=tp2)
    assert decoded == single and totals["handoffs"] == len(prompts)
    assert cached == {r: len(prompt) for r, prompt in prompts.items()}
    assert os.listdir(folder) == []


def test_a_failed_or_unusable_hand_off_makes_the_request_prefill_itself(
        tiny_llama, tmp_path, monkeypatch):
    """Every import fails: the adopters run that step on an empty context, are preempted
    with its output dropped and prefill again; they answer in full, nobody fails, nothing
    leaks. A hand-off made under other settings is not adopted and is removed."""
    folder = str(tmp_path)
    prompts = random_prompts(LENGTHS[:3], seed=4)
    first, _, _ = run(tiny_llama, prompts, 1, folder, "kv_producer")
    monkeypatch.setenv(FAULT_ENV, "import")
    decoded, cached, totals = run(tiny_llama, prompts, 8, folder, "kv_consumer")
    assert set(totals["reasons"].values()) == {"length"}
    assert all(len(decoded[r]) == 8 and decoded[r][0] == first[r][0] for r in prompts)
    assert os.listdir(folder) == []
    monkeypatch.delenv(FAULT_ENV)
    run(tiny_llama, prompts, 1, folder, "kv_producer")
    decoded, cached, totals = run(tiny_llama, prompts, 8, folder, "kv_consumer",
                                  kv_compression="snapkv")
    assert totals["handoffs"] == 0 and set(cached.values()) == {0}
    assert os.listdir(folder) == []


def handoff_engine(model: str, folder: str, role: str, **extra_config) -> EngineHarness:
    transfer = KVTransferConfig(kv_connector="KVCompressConnector", kv_role=role,
                                kv_connector_extra_config={"path": folder, **extra_config})
    return EngineHarness(model, SETTINGS, kv_cache_memory_bytes=64 << 20,
                         kv_transfer_config=transfer, **ENGINE)


def test_a_producer_removes_the_hand_offs_nobody_took(tiny_llama, tmp_path):
    """``timeout_s``: a hand-off no decode instance took in time is removed by the prefill
    instance (the decode request never came), idle or not; newer ones stay."""
    folder = str(tmp_path)
    producer = handoff_engine(tiny_llama, folder, "kv_producer", timeout_s=1.0)
    try:
        old = random_prompts(LENGTHS[:2], seed=7)
        producer.generate(old, greedy(1))
        assert len(os.listdir(folder)) == 2 * len(old)  # rows and description each
        deadline = time.monotonic() + 10  # idle: its sweeper thread removes them
        while os.listdir(folder):
            assert time.monotonic() < deadline, f"left: {os.listdir(folder)}"
            time.sleep(0.1)
        new = {f"n{r}": prompt for r, prompt in random_prompts(LENGTHS[2:4], seed=8).items()}
        producer.generate(new, greedy(1))
        left = {name.split(".")[0] for name in os.listdir(folder)}
        assert len(left) == len(new) and len(os.listdir(folder)) == 2 * len(new)
        assert_pages_back(producer)
    finally:
        producer.shutdown()


def test_a_continued_request_aborted_before_its_first_output_leaves_nothing(
        tiny_llama, tmp_path, monkeypatch):
    """Every import fails, so after the first step the continued requests have no output
    yet (preempted, to prefill again); aborting half of them then ends them cleanly: the
    others answer in full from the producer's token, pages come back, the first-token
    bookkeeping empties, the folder too."""
    folder = str(tmp_path)
    prompts = random_prompts(LENGTHS[:4], seed=9)
    first, _, _ = run(tiny_llama, prompts, 1, folder, "kv_producer")
    monkeypatch.setenv(FAULT_ENV, "import")
    consumer = handoff_engine(tiny_llama, folder, "kv_consumer")
    try:
        for request_id, prompt in prompts.items():
            consumer.add(request_id, prompt, greedy(6))
        consumer.step()
        reuse = consumer.scheduler.reuse
        continuing = {request_id.rsplit("-", 1)[0] for request_id in reuse.continuing}
        assert continuing == set(prompts) and not consumer.outputs
        aborted = sorted(prompts)[::2]
        consumer.abort(aborted)
        consumer.run_until_done()
        for request_id in set(prompts) - set(aborted):
            assert len(consumer.outputs[request_id]) == 6
            assert consumer.outputs[request_id][0] == first[request_id][0]
        assert not reuse.continuing and not reuse.continued
        assert_pages_back(consumer)
        assert os.listdir(folder) == []
    finally:
        consumer.shutdown()


def test_two_vllm_serve_instances_behind_the_proxy_answer_as_one_over_http(
        embedded_model, tmp_path):
    """The recipe of docs/usage.md on one machine: a prefill and a decode `vllm serve` with
    --kv-transfer-config, the proxy in front. Chat answers through the proxy (streamed or
    not) are the decode instance's own answers to the same question asked directly (it then
    prefills it itself); the decode instance adopted every prompt whole."""
    folder = str(tmp_path / "handoff")
    common = ("--kv-compression", "pyramidkv", "--kv-compression-ratio", "0.875",
              "--max-model-len", "1536", "--kv-cache-memory-bytes", "120M",
              "--enable-prompt-tokens-details")

    def transfer(role: str) -> tuple[str, str]:
        return ("--kv-transfer-config", json.dumps({
            "kv_connector": "KVCompressConnector", "kv_role": role,
            "kv_connector_extra_config": {"path": folder}}))

    with running_server(embedded_model, tmp_path, *common, *transfer("kv_producer")) as (
            prefill, _), running_server(embedded_model, tmp_path, *common,
                                        *transfer("kv_consumer")) as (decode, decode_log):
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "kvcompress.disagg_proxy", "--prefill",
                                  prefill, "--decode", decode, "--port", str(port)])
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(base, proxy)
            questions = [f"Note {number}. " + long_question(400) for number in range(3)]
            answers = []
            for number, question in enumerate(questions):
                messages = [{"role": "user", "content": question}]
                if number == 0:  # streamed through the proxy
                    stream = client(base).chat.completions.create(
                        model=embedded_model, messages=messages, max_tokens=12,
                        temperature=0, stream=True)
                    answers.append("".join(chunk.choices[0].delta.content or ""
                                           for chunk in stream if chunk.choices))
                else:
                    reply = client(base).chat.completions.create(
                        model=embedded_model, messages=messages, max_tokens=12, temperature=0)
                    cached = reply.usage.prompt_tokens_details.cached_tokens
                    assert cached == reply.usage.prompt_tokens  # the whole prompt handed off
                    answers.append(reply.choices[0].message.content)
            assert os.listdir(folder) == []
            for question, answer in zip(questions, answers):
                direct = client(decode).chat.completions.create(
                    model=embedded_model, messages=[{"role": "user", "content": question}],
                    max_tokens=12, temperature=0)
                assert direct.usage.prompt_tokens_details.cached_tokens == 0
                assert direct.choices[0].message.content == answer
            bad = requests.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": embedded_model, "messages": [{"role": "user", "content": "Hi"}],
                "vllm_xargs": {"kv_budget": -1}})
            assert bad.status_code == 400 and "kv_budget" in bad.text
            sent = requests.get(f"{prefill}/metrics", timeout=10).text
            taken = requests.get(f"{decode}/metrics", timeout=10).text
            assert metric(taken, "kvcompress:handoff_requests_total") == len(questions)
            exported = metric(sent, "kvcompress:handoff_bytes_total", direction="exported")
            assert exported > 0 and exported == metric(
                taken, "kvcompress:handoff_bytes_total", direction="imported")
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
        assert "prefills itself" not in decode_log.read_text()


def wait_until_ready(base: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the proxy exited"
        try:
            if requests.get(f"{base}/v1/models", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise AssertionError("the proxy did not start")
