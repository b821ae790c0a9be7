"""The load client against a hand-written SSE server on loopback: vLLM-like multi-token chunks with usage,
reasoning text, and a malformed chunk."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import orjson
import pytest
from aiohttp import web

from otel_kvtrace.loadgen import LoadProfile, run_load

STREAMS: dict[str, list[bytes]] = {
    # spec decode / detokenizer batching: 4 tokens in 2 chunks; the usage chunk has the count
    "multi": [b'{"id":"a","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
              b'{"id":"a","choices":[{"index":0,"delta":{"content":"ab cd"}}]}',
              b'{"id":"a","choices":[{"index":0,"delta":{"content":"ef gh"}}]}',
              b'{"id":"a","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}'],
    # reasoning models: no usage, text in reasoning_content
    "reasoning": [b'{"id":"b","choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}'] * 4,
    "bad": [b'[1, 2]'],
}


STATE = web.AppKey("state", dict)


async def _handler(request: web.Request) -> web.StreamResponse:
    if request.method == "GET":
        return web.json_response({"data": [{"id": "m"}]})
    kind = request.app[STATE]["kind"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in STREAMS[kind]:
        await resp.write(b"data: " + chunk + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture()
def sse_server() -> Iterator[web.Application]:
    app = web.Application()
    app[STATE] = {}
    app.router.add_route("*", "/{tail:.*}", _handler)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    app[STATE]["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield app
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _run(app: web.Application, kind: str, n: int = 2):
    app[STATE]["kind"] = kind
    return run_load(LoadProfile(app[STATE]["url"], "/v1/chat/completions", "m", num_requests=n, concurrency=1,
                                prompt_len=3, output_len=4))


def test_usage_completion_tokens_not_chunks_count(sse_server: web.Application) -> None:
    result = _run(sse_server, "multi")
    assert result.summary()["failed"] == 0, result.summary()["errors"]
    r = result.requests[0]
    assert r.output_tokens == 4 and r.prompt_tokens == 3
    assert len(r.itl_ms) == 2  # first choice chunk = the role chunk; gaps between the later choice chunks
    assert r.start_unix_ns <= r.first_token_unix_ns <= r.end_unix_ns


def test_reasoning_content_counts_when_no_usage(sse_server: web.Application) -> None:
    result = _run(sse_server, "reasoning")
    assert result.summary()["failed"] == 0 and result.requests[0].output_tokens == 4


def test_non_object_chunk_fails_that_request_not_the_run(sse_server: web.Application) -> None:
    result = _run(sse_server, "bad", n=3)
    assert result.summary()["failed"] == 3
    assert all("not a JSON object" in r.error for r in result.requests)
