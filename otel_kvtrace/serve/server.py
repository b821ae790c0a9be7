"""The OpenAI-compatible HTTP front of ``kvtrace serve-replica`` (aiohttp).

Routes follow vLLM's OpenAI server: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream: true`` answers Server-Sent Events ``data: {chunk}`` ...
``data: [DONE]``; ``stream_options.include_usage`` adds the usage chunk). Prompt tokens are counted as
whitespace-separated words (a list of token ids counts its length); every request generates exactly
``max_tokens`` tokens (as with ``ignore_eos``).

Request ids: ``X-Request-Id`` (or a fresh uuid) gives ``cmpl-{id}`` / ``chatcmpl-{id}`` as the response
``id``; the KV tasks carry ``cmpl-{id}-0`` (completions, prompt index 0) or ``chatcmpl-{id}``. A client
joins its requests to the KV tasks' ``kvtrace.request_ids`` by "equal, or starts with ``{id}-``".

Server-side truth: one JSON line per finished request in ``{data_dir}/requests/requests-{run_id}.jsonl``
with the wall-clock (``time.time_ns``) arrival, first-token and end times, taken right after the chunk
was written to the socket.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from otel_kvtrace.serve.engine import EngineRequest, ReplicaEngine

_DONE = b"data: [DONE]\n\n"


class RequestLog:
    """Appends one JSON line per finished request (the server-side first-token truth)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(orjson.dumps(record) + b"\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def count_prompt_tokens(prompt: Any) -> int:
    """Words of a string prompt, length of a token-id list, sum over a list of prompts."""
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return max(1, sum(count_prompt_tokens(p) for p in prompt))
    raise ValueError("prompt must be a string, a list of strings or a list of token ids")


def build_app(engine: ReplicaEngine, model: str, log: RequestLog | None) -> web.Application:
    """The aiohttp application serving ``engine`` as ``model``."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["engine"], app["model"], app["log"] = engine, model, log
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    return app


async def _health(request: web.Request) -> web.Response:
    engine: ReplicaEngine = request.app["engine"]
    if not engine.alive:
        return web.json_response({"error": engine.stats.error or "engine stopped"}, status=503)
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    model = request.app["model"]
    return web.json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvtrace", "root": model}]})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequestError", "code": status},
                             status=status)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


def _parse_body(body: Any, chat: bool) -> tuple[int, int]:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        prompt_tokens = sum(count_prompt_tokens(str(m.get("content", "")) if isinstance(m, dict) else "")
                            for m in messages)
    else:
        if "prompt" not in body:
            raise ValueError("prompt is required")
        prompt_tokens = count_prompt_tokens(body["prompt"])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    return prompt_tokens, max_tokens


async def _serve(request: web.Request, *, chat: bool) -> web.StreamResponse:
    arrival_ns = time.time_ns()
    engine: ReplicaEngine = request.app["engine"]
    try:
        body = await request.json(loads=orjson.loads)
        prompt_tokens, max_tokens = _parse_body(body, chat)
    except (ValueError, orjson.JSONDecodeError) as exc:
        return _error(400, str(exc))
    if not engine.alive:
        return _error(503, engine.stats.error or "engine stopped")
    base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    resp_id = f"chatcmpl-{base}" if chat else f"cmpl-{base}"
    kv_id = resp_id if chat else f"{resp_id}-0"
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue[int] = asyncio.Queue()
    engine.submit(EngineRequest(kv_id, prompt_tokens, max_tokens,
                                lambda index, _ns: loop.call_soon_threadsafe(tokens.put_nowait, index)))
    stream = bool(body.get("stream"))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
             "total_tokens": prompt_tokens + max_tokens}
    chunk = _Chunk(resp_id, request.app["model"], chat)
    if stream:
        result = await _stream(request, tokens, chunk, max_tokens,
                               usage if (body.get("stream_options") or {}).get("include_usage") else None)
    else:
        result = await _collect(tokens, chunk, max_tokens, usage)
    first_ns, end_ns, generated, response = result
    log: RequestLog | None = request.app["log"]
    if log is not None:
        log.write({"request_id": resp_id, "kv_request_id": kv_id, "arrival_unix_ns": arrival_ns,
                   "first_token_unix_ns": first_ns, "end_unix_ns": end_ns, "prompt_tokens": prompt_tokens,
                   "output_tokens": generated, "stream": stream, "error": generated < max_tokens})
    return response


class _Chunk:
    """Chunks in the shape vLLM's OpenAI server streams (``text_completion`` / ``chat.completion.chunk``)."""

    def __init__(self, resp_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat, self.created = resp_id, model, chat, int(time.time())

    def token(self, index: int, finish: str | None) -> dict[str, Any]:
        text = f" t{index}"
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": usage}


async def _stream(request: web.Request, tokens: asyncio.Queue[int], chunk: _Chunk, max_tokens: int,
                  usage: dict[str, int] | None) -> tuple[int, int, int, web.StreamResponse]:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    first_ns, generated = 0, 0
    while generated < max_tokens:
        index = await tokens.get()
        if index < 0:
            break  # the engine failed: end the stream early (the client sees a short answer)
        if chunk.chat and not generated:
            # vLLM's first chat chunk carries the role and no text, sent with the first engine output
            # (serving_chat.py, chat_completion_stream_generator: first_iteration), i.e. with the first token
            role = chunk.token(0, None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await resp.write(b"data: " + orjson.dumps(role) + b"\n\n")
        generated += 1
        finish = "length" if generated == max_tokens else None
        await resp.write(b"data: " + orjson.dumps(chunk.token(index, finish)) + b"\n\n")
        if not first_ns:
            first_ns = time.time_ns()
    if usage is not None and generated == max_tokens:
        await resp.write(b"data: " + orjson.dumps(chunk.usage(usage)) + b"\n\n")
    if generated == max_tokens:
        await resp.write(_DONE)
    end_ns = time.time_ns()
    await resp.write_eof()
    return first_ns, end_ns, generated, resp


async def _collect(tokens: asyncio.Queue[int], chunk: _Chunk, max_tokens: int,
                   usage: dict[str, int]) -> tuple[int, int, int, web.StreamResponse]:
    first_ns, generated, texts = 0, 0, []
    while generated < max_tokens:
        index = await tokens.get()
        if index < 0:
            return first_ns, time.time_ns(), generated, _error(500, "engine failed")
        first_ns = first_ns or time.time_ns()
        generated += 1
        texts.append(f" t{index}")
    body = chunk.token(0, "length")
    if chunk.chat:
        body["object"] = "chat.completion"
        body["choices"][0] = {"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                              "finish_reason": "length"}
    else:
        body["object"] = "text_completion"
        body["choices"][0]["text"] = "".join(texts)
    body["usage"] = usage
    return first_ns, time.time_ns(), generated, web.json_response(body)
