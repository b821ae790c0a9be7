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
"""

from __future__ import annotations

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
    requests = _requests(path, line, doc)
    result = LoadResult(profile, requests, float(doc["duration"]), source=f"vllm bench serve ({path.name})")
    if not requests:
        result.profile["vllm_summary"] = {k: v for k, v in doc.items() if k.endswith("_ms") or k in (
            "completed", "failed", "total_output_tokens", "output_throughput", "request_throughput")}
    return result


def _requests(path: Path, line: int, doc: dict[str, Any]) -> list[RequestResult]:
    ttfts = doc.get("ttfts")
    if ttfts is None:
        return []  # saved without --save-detailed
    n = len(ttfts)
    cols = {k: doc.get(k) or [None] * n for k in ("input_lens", "output_lens", "itls", "start_times", "errors",
                                                   "latencies")}
    for key, values in cols.items():
        if len(values) != n:
            raise VllmBenchError(f"{path}:{line}: '{key}' has {len(values)} entries, 'ttfts' has {n}")
    out = []
    for i in range(n):
        start_s = cols["start_times"][i] or 0.0
        start = int(start_s * _S_TO_NS)
        ttft = ttfts[i] or 0.0
        itls = [float(x) * 1000 for x in (cols["itls"][i] or [])]
        latency = cols["latencies"][i]
        total_s = float(latency) if latency else ttft + sum(itls) / 1000
        err = cols["errors"][i] or ""
        out.append(RequestResult(
            i, request_id="", start_unix_ns=start, first_token_unix_ns=start + int(ttft * _S_TO_NS) if ttft else 0,
            end_unix_ns=start + int(total_s * _S_TO_NS), prompt_tokens=int(cols["input_lens"][i] or 0),
            output_tokens=int(cols["output_lens"][i] or 0), itl_ms=itls, error=str(err)))
    return out
