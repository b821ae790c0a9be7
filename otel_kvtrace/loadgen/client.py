"""The load generator: streaming requests against an OpenAI-compatible server (vLLM or serve-replica).

Profile: ``num_requests`` with ``prompt_len`` words and ``output_len`` tokens (``ignore_eos``), at most
``concurrency`` in flight, arrivals at ``request_rate`` per second (Poisson; ``inf`` = all at once).
A failed request (refused connection, server gone mid-stream, HTTP error, a malformed chunk, short answer)
is recorded with its error and the run goes on; nothing here raises for a server problem. Output tokens are
the final chunk's ``usage.completion_tokens`` (``stream_options.include_usage``); only a server that sends no
usage falls back to counting the chunks with text (or ``reasoning_content``).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from otel_kvtrace.loadgen.model import LoadResult, RequestResult


@dataclass(slots=True)
class LoadProfile:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    num_requests: int = 32
    concurrency: int = 4
    request_rate: float = math.inf
    prompt_len: int = 512
    output_len: int = 16
    seed: int = 0
    timeout_s: float = 120.0

    def as_dict(self) -> dict[str, object]:
        d = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return d


def run_load(profile: LoadProfile, on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
    """Run the profile to the end; ``on_done`` is called after each request (progress)."""
    return asyncio.run(_run(profile, on_done))


async def _run(p: LoadProfile, on_done: Callable[[RequestResult], None] | None) -> LoadResult:
    rng = random.Random(p.seed)
    results = [RequestResult(i, prompt_tokens=p.prompt_len) for i in range(p.num_requests)]
    sem = asyncio.Semaphore(max(1, p.concurrency))
    timeout = aiohttp.ClientTimeout(total=p.timeout_s)
    connector = aiohttp.TCPConnector(limit=max(1, p.concurrency), force_close=False)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = p.model or await _first_model(session, p.base_url)
        tasks = []
        for r in results:
            tasks.append(asyncio.create_task(_limited(session, sem, p, model, r, on_done)))
            if not math.isinf(p.request_rate) and p.request_rate > 0:
                await asyncio.sleep(rng.expovariate(p.request_rate))
        await asyncio.gather(*tasks)
    return LoadResult(p.as_dict() | {"model": model}, results, time.perf_counter() - t0)


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first served model (as ``vllm bench serve`` does); ``"default"`` when /v1/models fails."""
    try:
        async with session.get(f"{base_url}/v1/models") as resp:
            data = await resp.json(loads=orjson.loads)
            return str(data["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
        return "default"


async def _limited(session: aiohttp.ClientSession, sem: asyncio.Semaphore, p: LoadProfile, model: str,
                   r: RequestResult, on_done: Callable[[RequestResult], None] | None) -> None:
    async with sem:
        try:
            await _one(session, p, model, r)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as exc:
            r.error = _describe(exc)
        if not r.end_unix_ns:
            r.end_unix_ns = time.time_ns()
    if on_done is not None:
        on_done(r)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connection refused ({exc.host}:{exc.port})"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "server disconnected mid-stream"
    if isinstance(exc, aiohttp.ClientOSError):
        return f"connection lost ({exc.strerror or exc})"
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _payload(p: LoadProfile, model: str) -> dict[str, object]:
    prompt = " ".join(["hi"] * max(1, p.prompt_len))
    body: dict[str, object] = {"model": model, "max_tokens": p.output_len, "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}
    if p.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one(session: aiohttp.ClientSession, p: LoadProfile, model: str, r: RequestResult) -> None:
    r.start_unix_ns = time.time_ns()
    last = 0
    chunks = 0
    usage_tokens: int | None = None
    async with session.post(p.base_url + p.endpoint, json=_payload(p, model)) as resp:
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            now = time.time_ns()
            chunk = orjson.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"stream chunk is not a JSON object: {data[:80]!r}")
            last = now  # latency ends at the last chunk, as vllm bench serve
            r.request_id = r.request_id or str(chunk.get("id", ""))
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                r.prompt_tokens = int(usage.get("prompt_tokens") or r.prompt_tokens)
                if usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
            if not _has_choice(chunk):
                continue
            chunks += _has_text(chunk)
            if not r.first_token_unix_ns:
                r.first_token_unix_ns = now
            else:
                r.itl_ms.append((now - prev) / 1e6)
            prev = now
    r.end_unix_ns = last or time.time_ns()
    r.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if not done:
        r.error = "stream ended before [DONE]"
    elif r.output_tokens < p.output_len:
        r.error = f"short answer ({r.output_tokens} of {p.output_len} tokens)"


def _has_choice(chunk: dict[str, object]) -> bool:
    """A chunk with a choice: vLLM's bench takes the first such chunk as the first token (for chat that is
    the role-only chunk) and the gaps between later ones as ITL."""
    choices = chunk.get("choices")
    return isinstance(choices, list) and bool(choices) and isinstance(choices[0], dict)


def _has_text(chunk: dict[str, object]) -> bool:
    """Text, or reasoning text, in the chunk's first choice (the token count when the server sends no usage)."""
    c = chunk["choices"][0]  # type: ignore[index]
    delta = c.get("delta") or {}
    return bool(c.get("text") or delta.get("content") or delta.get("reasoning_content"))
