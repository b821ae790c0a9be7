"""Did async scheduling pay off? The outcome a tuning guide judges by, per run.

- step interval: time between consecutive steps' execution starts (device start when known, else the
  launch start) on one lane. When the capture gives batch types (``batch_type``/``batchType`` on the
  schedule span) only Decode -> Decode pairs count: the decode-step latency; otherwise every pair.
- request latency p50/p90/p99, first-token latency p90/p99, throughput (output tokens and requests per
  second over the span of request starts to last request end): from msServiceProfiler's ``request.csv``
  (``execution_time(ms)``, ``first_token_latency(ms)``, ``reply_token_size``) when the input has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

_STEP_SQL = """
WITH s AS (
  SELECT lane, LEAD(coalesce(device_start, launch_start)) OVER w - coalesce(device_start, launch_start) AS dt,
         batch_type, LEAD(batch_type) OVER w AS next_type
  FROM async_steps WHERE run = $run WINDOW w AS (PARTITION BY lane ORDER BY step)
), typed AS (SELECT count(batch_type) > 0 AS known FROM async_steps WHERE run = $run)
SELECT count(dt), quantile_cont(dt, 0.5) / 1e6, quantile_cont(dt, 0.9) / 1e6, quantile_cont(dt, 0.99) / 1e6,
       1e9 / nullif(avg(dt), 0), any_value(known)
FROM s, typed
WHERE dt > 0 AND (NOT known OR (batch_type = 'Decode' AND next_type = 'Decode'))
"""

_REQ_SQL = """
SELECT count(*), quantile_cont(latency_ms, 0.5), quantile_cont(latency_ms, 0.9), quantile_cont(latency_ms, 0.99),
       quantile_cont(ttft_ms, 0.9), quantile_cont(ttft_ms, 0.99),
       (max(start_ns + latency_ms * 1e6) - min(start_ns)) / 1e9, sum(out_tokens)
FROM async_requests WHERE run = $run
"""


@dataclass(slots=True)
class OutcomeMetrics:
    """Outcome numbers of one run (None where the input does not have them)."""

    step_intervals: int = 0
    step_interval_p50_ms: float | None = None
    step_interval_p90_ms: float | None = None
    step_interval_p99_ms: float | None = None
    steps_per_s: float | None = None
    decode_steps_only: bool = False
    """True when the steps' batch types are known and only Decode -> Decode intervals were counted."""
    requests: int = 0
    request_latency_p50_ms: float | None = None
    request_latency_p90_ms: float | None = None
    request_latency_p99_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    requests_per_s: float | None = None
    output_tokens_per_s: float | None = None


def compute_outcome(con: duckdb.DuckDBPyConnection, run: str) -> OutcomeMetrics:
    """Outcome metrics of ``run`` from ``async_steps`` and ``async_requests``."""
    out = OutcomeMetrics()
    (out.step_intervals, out.step_interval_p50_ms, out.step_interval_p90_ms, out.step_interval_p99_ms,
     out.steps_per_s, decode_only) = con.execute(_STEP_SQL, {"run": run}).fetchall()[0]
    out.decode_steps_only = bool(decode_only)
    n, p50, p90, p99, t90, t99, span_s, tokens = con.execute(_REQ_SQL, {"run": run}).fetchall()[0]
    out.requests = n
    out.request_latency_p50_ms, out.request_latency_p90_ms, out.request_latency_p99_ms = p50, p90, p99
    out.ttft_p90_ms, out.ttft_p99_ms = t90, t99
    if n and span_s:
        out.requests_per_s = n / span_s
        out.output_tokens_per_s = float(tokens) / span_s if tokens is not None else None
    return out


def outcome_line(out: OutcomeMetrics) -> str:
    """One terminal line (empty parts left out)."""
    parts = []
    if out.step_interval_p50_ms is not None:
        what = "decode-step latency" if out.decode_steps_only else "step interval"
        parts.append(f"{what} p50 {out.step_interval_p50_ms:.2f} ms, p99 {out.step_interval_p99_ms:.2f} ms")
    if out.requests:
        lat = out.request_latency_p90_ms, out.request_latency_p99_ms
        if lat[0] is not None:
            parts.append(f"{out.requests} requests, latency p90 {lat[0]:.1f} ms, p99 {lat[1]:.1f} ms")
        if out.output_tokens_per_s is not None:
            parts.append(f"{out.output_tokens_per_s:.1f} output tokens/s")
    return "; ".join(parts)
