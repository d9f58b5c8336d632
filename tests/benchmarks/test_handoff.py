"""The hand-off benchmark's parts and the proxy (``kvcompress.disagg_proxy``) against stand-in
instances: the prefill instance gets one token to generate, the decode instance the request
as the client sent it, whose answer comes back unchanged; a prefill error comes back as is."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from benchmarks import handoff
from kvcompress.disagg_proxy import Proxy, prefill_body


def test_prompts_and_flags_per_side(tmp_path):
    prompts = handoff.make_prompts(5, 100, seed=1)
    assert prompts == handoff.make_prompts(5, 100, seed=1)
    assert all(90 <= len(prompt) <= 100 for prompt in prompts)
    ours = handoff.transfer_flags("kvcompress", "kv_consumer", tmp_path)
    config = json.loads(ours[ours.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVCompressConnector" and "--kv-compression" in ours
    theirs = handoff.transfer_flags("vanilla", "kv_producer", tmp_path)
    assert json.loads(theirs[1])["kv_connector"] == "ExampleConnector"
    assert "--kv-compression" not in theirs


def test_token_bytes_and_the_ratios(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576}))
    assert handoff.token_bytes(str(tmp_path), "bfloat16") == 2 * 30 * 3 * 64 * 2
    runs = [{"label": "vanilla", "decode_ttft_mean_s": 0.2, "bytes_per_request": 100.0},
            {"label": "kvcompress", "decode_ttft_mean_s": 0.1, "bytes_per_request": 12.5}]
    for run in runs:
        for key in ("decode_ttft_p50_s", "decode_ttft_p90_s", "prefill_mean_s", "e2e_mean_s",
                    "output_tok_s"):
            run[key] = 1.0
    handoff.add_ratios(runs)
    assert runs[1]["ratios"]["decode_ttft_mean_s"] == 0.5
    assert runs[1]["ratios"]["bytes_per_request"] == 0.125
    assert "kvcompress / vanilla" in handoff.render(runs)


def test_the_prefill_request_asks_for_one_token_and_leaves_the_client_s_alone():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 2, "n": 2}
    prefill = prefill_body(body)
    assert prefill == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False}
    assert body["max_tokens"] == 50 and body["stream"] is True
    chat = prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 1


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_the_proxy_sends_prefill_then_decode_and_streams_the_answer_back():
    seen: dict[str, list] = {"prefill": [], "decode": []}

    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        seen["prefill"].append(body)
        if body.get("bad"):
            return web.json_response({"error": {"message": "kv_budget must be >= 1"}},
                                     status=400)
        return web.json_response({"choices": [{"text": "x"}]})

    async def decode(request: web.Request) -> web.StreamResponse:
        seen["decode"].append(await request.json())
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        for part in ("data: one\n\n", "data: two\n\n", "data: [DONE]\n\n"):
            await response.write(part.encode())
        await response.write_eof()
        return response

    async def scenario() -> tuple[str, int, str]:
        prefill_app, decode_app = web.Application(), web.Application()
        prefill_app.router.add_post("/v1/completions", prefill)
        decode_app.router.add_post("/v1/completions", decode)
        runners = []
        try:
            for app in (prefill_app, decode_app):
                runners.append(await _start(app))
            proxy_runner, base = await _start(Proxy(runners[0][1], runners[1][1]).app())
            runners.append((proxy_runner, base))
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "hello", "max_tokens": 7, "stream": True}
                async with session.post(f"{base}/v1/completions", json=body) as answer:
                    streamed = await answer.text()
                async with session.post(f"{base}/v1/completions",
                                        json={**body, "bad": True}) as refused:
                    return streamed, refused.status, await refused.text()
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    streamed, status, error = asyncio.run(scenario())
    assert streamed == "data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert seen["prefill"][0]["max_tokens"] == 1 and seen["prefill"][0]["stream"] is False
    assert seen["decode"] == [{"prompt": "hello", "max_tokens": 7, "stream": True}]
    assert status == 400 and "kv_budget" in error and len(seen["decode"]) == 1
