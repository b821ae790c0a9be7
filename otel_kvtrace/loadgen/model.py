"""Per-request results of a load run and their summary (TTFT, TPOT, ITL, throughput).

Definitions follow ``vllm bench serve`` (``vllm/benchmarks/lib/endpoint_request_func.py`` and
``serve.py`` ``calculate_metrics``): TTFT from sending the request to the first chunk with a choice (on the
chat endpoint that is the role chunk); ITL the gaps between later chunks with a choice; latency ends at the
last chunk; output tokens = ``usage.completion_tokens``; TPOT ``(latency - ttft) / (output_tokens - 1)``;
output throughput = output tokens of successful requests / benchmark duration. Times are wall-clock ``time.time_ns`` so they compare with the server's log.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

RESULT_FORMAT = "kvtrace-load/1"


@dataclass(slots=True)
class RequestResult:
    index: int
    request_id: str = ""
    """The response ``id`` (joins the KV tasks' ``kvtrace.request_ids``: equal or ``{id}-...``)."""
    start_unix_ns: int = 0
    first_token_unix_ns: int = 0
    end_unix_ns: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_ms(self) -> float | None:
        if not self.first_token_unix_ns:
            return None
        return (self.first_token_unix_ns - self.start_unix_ns) / 1e6

    @property
    def latency_ms(self) -> float:
        return (self.end_unix_ns - self.start_unix_ns) / 1e6

    @property
    def tpot_ms(self) -> float | None:
        ttft = self.ttft_ms
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.latency_ms - ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class LoadResult:
    """A run: its profile (what was asked), its requests and its wall-clock duration."""

    profile: dict[str, Any]
    requests: list[RequestResult]
    duration_s: float
    source: str = "kvtrace load"

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.ok]
        out_tokens = sum(r.output_tokens for r in ok)
        dur = self.duration_s if self.duration_s > 0 else float("nan")
        ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
        itl = [x for r in ok for x in r.itl_ms]
        return {
            "completed": len(ok), "failed": len(self.requests) - len(ok), "duration_s": self.duration_s,
            "total_output_tokens": out_tokens, "output_throughput_tok_s": out_tokens / dur,
            "request_throughput_req_s": len(ok) / dur,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
            "errors": first_errors(self.requests),
        }

    def to_json(self) -> dict[str, Any]:
        return {"format": RESULT_FORMAT, "source": self.source, "profile": self.profile,
                "duration_s": self.duration_s, "summary": self.summary(),
                "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LoadResult:
        if doc.get("format") != RESULT_FORMAT:
            raise ValueError(f"not a {RESULT_FORMAT} file (format={doc.get('format')!r})")
        reqs = [RequestResult(**r) for r in doc["requests"]]
        return cls(doc.get("profile", {}), reqs, float(doc["duration_s"]), doc.get("source", "kvtrace load"))


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 and mean (linear interpolation, numpy's default, as vLLM's bench uses)."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "n": 0}
    arr = np.asarray(values, dtype=float)
    p50, p95, p99 = (float(x) for x in np.percentile(arr, [50, 95, 99]))
    return {"p50": p50, "p95": p95, "p99": p99, "mean": float(arr.mean()), "n": int(arr.size)}


def first_errors(requests: list[RequestResult], limit: int = 3) -> list[str]:
    """Distinct error messages, most frequent first."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.error:
            counts[r.error] = counts.get(r.error, 0) + 1
    return [f"{n} x {msg}" for msg, n in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]]
