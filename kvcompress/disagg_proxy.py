"""The proxy in front of a prefill/decode pair (``engine.handoff``), as vLLM's
disaggregated-serving proxies work: each completion or chat request goes to the prefill
instance with one token to generate (it compresses the prompt and hands its rows and that
token off), then, as the client sent it, to the decode instance, whose answer (streamed or
not) goes back to the client unchanged.

    python -m kvcompress.disagg_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

A prefill error goes back to the client as it came (a 400 names the bad field); a prefill
instance that cannot be reached answers 502. The decode instance does not depend on the
prefill succeeding: without a hand-off it prefills the prompt itself.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import aiohttp
from aiohttp import web

_ROUTES = ("/v1/completions", "/v1/chat/completions")
_PASSED_THROUGH = ("/v1/models", "/health", "/metrics", "/tokenize", "/detokenize")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: one token, not streamed, no logprobs."""
    prefill = copy.deepcopy(body)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    for field in ("stream_options", "logprobs", "top_logprobs", "n", "best_of"):
        prefill.pop(field, None)
    return prefill


class Proxy:
    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float = 3600) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in _ROUTES:
            app.router.add_post(route, self.complete)
        for route in _PASSED_THROUGH:
            app.router.add_route("*", route, self.pass_through)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)

    async def _stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy has not started"
        return self._session

    async def complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            return web.json_response({"error": {"message": f"invalid JSON: {error}",
                                                "type": "BadRequestError"}}, status=400)
        headers = _forwarded_headers(request)
        try:
            async with self.session.post(self.prefill_url + request.path, json=prefill_body(body),
                                         headers=headers) as prefill:
                if prefill.status != 200:
                    return web.Response(status=prefill.status, body=await prefill.read(),
                                        content_type=prefill.content_type)
                await prefill.read()
        except aiohttp.ClientError as error:
            return web.json_response({"error": {"message": f"prefill instance: {error}",
                                                "type": "BadGateway"}}, status=502)
        return await self._relay(request, "POST", self.decode_url + request.path, headers,
                                 json.dumps(body).encode())

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, request.method,
                                 self.decode_url + request.path_qs,
                                 _forwarded_headers(request), await request.read())

    async def _relay(self, request: web.Request, method: str, url: str,
                     headers: dict[str, str], data: bytes) -> web.StreamResponse:
        """The decode instance's answer, streamed to the client as it comes."""
        try:
            async with self.session.request(method, url, data=data, headers=headers) as answer:
                response = web.StreamResponse(status=answer.status)
                response.content_type = answer.content_type
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as error:
            return web.json_response({"error": {"message": f"decode instance: {error}",
                                                "type": "BadGateway"}}, status=502)


def _forwarded_headers(request: web.Request) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    for name in ("Authorization", "X-Request-Id"):
        if name in request.headers:
            headers[name] = request.headers[name]
    return headers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.disagg_proxy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True,
                        help="URL of the prefill instance (kv_role kv_producer)")
    parser.add_argument("--decode", required=True,
                        help="URL of the decode instance (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    web.run_app(Proxy(args.prefill, args.decode).app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
