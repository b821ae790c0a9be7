"""Importer for ``vllm bench serve --save-result`` JSON, so users can keep their usual client.

Schema source: vLLM, ``vllm/benchmarks/serve.py``: ``benchmark()`` builds the result dict (``duration``,
``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``, ``request_throughput``,
``output_throughput``, per request ``input_lens``, ``output_lens``, ``ttfts`` and ``latencies`` in seconds,
``itls`` a list of per-request lists in seconds, ``start_times``, ``errors``, plus
``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``), and ``main`` adds ``date``, ``backend``, ``model_id``,
``num_prompts``, ``request_rate`` (a number or ``"inf"``), ``burstiness``, ``max_concurrency``. Without
``--save-detailed`` the per-request lists are deleted before saving; the import then keeps only the
run-level numbers (``requests`` is empty and ``summary`` carries vLLM's own medians). With
``--append-result`` a file holds one JSON object per line: each becomes one run.

Clock: vLLM's ``start_times`` are ``time.perf_counter()`` readings (``endpoint_request_func.py``:
``output.start_time = st``), not Unix time. ``main`` stamps ``date`` (``%Y%m%d-%H%M%S``, the client's local
time) after the benchmark, so the import anchors the run's first request at ``date - duration`` (1 s
resolution) and says so in ``profile["clock"]``; without a ``date`` the times are relative to the first
request (``clock = "relative"``) and must not be joined with KV traces.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import orjson

from otel_kvtrace.loadgen.model import LoadResult, RequestResult

_S_TO_NS = 1_000_000_000


class VllmBenchError(ValueError):
    """The file is not a ``vllm bench serve`` result; the message names the file and line."""


def read_vllm_bench(path: str | Path) -> list[LoadResult]:
    """Every run in ``path`` (one JSON object, or one per line with ``--append-result``)."""
    p = Path(path)
    text = p.read_bytes()
    docs: list[tuple[int, Any]] = []
    try:
        docs = [(1, orjson.loads(text))]
    except orjson.JSONDecodeError:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    docs.append((n, orjson.loads(line)))
                except orjson.JSONDecodeError as exc:
                    raise VllmBenchError(f"{p}:{n}: not JSON ({exc})") from None
    return [_run(p, n, doc) for n, doc in docs]


def _run(path: Path, line: int, doc: Any) -> LoadResult:
    if not isinstance(doc, dict) or "duration" not in doc or "completed" not in doc:
        raise VllmBenchError(f"{path}:{line}: not a `vllm bench serve --save-result` object "
                             "(needs 'duration' and 'completed')")
    profile = {k: doc.get(k) for k in ("backend", "model_id", "num_prompts", "request_rate", "burstiness",
                                       "max_concurrency", "date", "label")}
    duration = _number(path, line, "duration", doc["duration"])
    anchor_ns = _anchor_ns(doc.get("date"), duration)
    profile["clock"] = "relative" if anchor_ns is None else "date - duration (1 s, client local time)"
    requests = _requests(path, line, doc, anchor_ns or 0)
    result = LoadResult(profile, requests, duration, source=f"vllm bench serve ({path.name})")
    if not requests:
        result.profile["vllm_summary"] = {k: v for k, v in doc.items() if k.endswith("_ms") or k in (
            "completed", "failed", "total_output_tokens", "output_throughput", "request_throughput")}
    return result


def _number(path: Path, line: int, key: str, value: Any, *, optional: bool = False) -> float:
    """``value`` as a finite float, else ``VllmBenchError`` naming the file, line and key."""
    if value is None and optional:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise VllmBenchError(f"{path}:{line}: '{key}' must be a number, got {value!r:.60}")
    return float(value)


def _anchor_ns(date: Any, duration_s: float) -> int | None:
    """Unix ns of the benchmark's start from vLLM's ``date`` stamp (taken after the run), or ``None``."""
    try:
        end = dt.datetime.strptime(str(date), "%Y%m%d-%H%M%S")  # local time, as vLLM's datetime.now()
    except ValueError:
        return None
    return int((end.timestamp() - duration_s) * _S_TO_NS)


def _requests(path: Path, line: int, doc: dict[str, Any], anchor_ns: int) -> list[RequestResult]:
    ttfts = doc.get("ttfts")
    if ttfts is None:
        return []  # saved without --save-detailed
    if not isinstance(ttfts, list):
        raise VllmBenchError(f"{path}:{line}: 'ttfts' must be a list, got {type(ttfts).__name__}")
    n = len(ttfts)
    cols = {k: doc.get(k) or [None] * n for k in ("input_lens", "output_lens", "itls", "start_times", "errors",
                                                   "latencies")}
    for key, values in cols.items():
        if not isinstance(values, list):
            raise VllmBenchError(f"{path}:{line}: '{key}' must be a list, got {type(values).__name__}")
        if len(values) != n:
            raise VllmBenchError(f"{path}:{line}: '{key}' has {len(values)} entries, 'ttfts' has {n}")
    starts = [_number(path, line, f"start_times[{i}]", v, optional=True) for i, v in enumerate(cols["start_times"])]
    first = min((s for s in starts if s), default=0.0)
    return [_request(path, line, i, cols, ttfts[i], anchor_ns + int((starts[i] - first) * _S_TO_NS) if starts[i] else 0)
            for i in range(n)]


def _request(path: Path, line: int, i: int, cols: dict[str, list[Any]], ttft_value: Any, start: int) -> RequestResult:
    ttft = _number(path, line, f"ttfts[{i}]", ttft_value, optional=True)
    raw_itls = cols["itls"][i] or []
    if not isinstance(raw_itls, list):
        raise VllmBenchError(f"{path}:{line}: 'itls[{i}]' must be a list, got {type(raw_itls).__name__}")
    itls = [_number(path, line, f"itls[{i}][{j}]", x) * 1000 for j, x in enumerate(raw_itls)]
    latency = _number(path, line, f"latencies[{i}]", cols["latencies"][i], optional=True)
    total_s = latency if latency else ttft + sum(itls) / 1000
    return RequestResult(
        i, request_id="", start_unix_ns=start, first_token_unix_ns=start + int(ttft * _S_TO_NS) if ttft else 0,
        end_unix_ns=start + int(total_s * _S_TO_NS),
        prompt_tokens=int(_number(path, line, f"input_lens[{i}]", cols["input_lens"][i], optional=True)),
        output_tokens=int(_number(path, line, f"output_lens[{i}]", cols["output_lens"][i], optional=True)),
        itl_ms=itls, error=str(cols["errors"][i] or ""))
