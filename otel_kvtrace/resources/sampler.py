"""Resource series: one record per forward step, sampled on a thread of its own (off the hot path).

The forward thread only stores the step number (``notify_step``: one attribute write; or the sampler
reads ``step_source()``, e.g. the instrumented vLLM-Ascend worker's step counter). The sampler thread polls
the in-flight counters every ``poll_ms`` while steps advance (they peak mid-step, when the window of
prefetched loads is queued, and are ~0 at a step boundary); after ``IDLE_AFTER_S`` without a step and with
nothing in flight it polls every ``IDLE_POLL_MS`` only. When the step number moved it writes one record
with the step's peak of each counter and the host/NPU memory read once; at stop, the last step's record
is written too. Records go to

- ``{data_dir}/metrics/resources-{run_id}.jsonl`` (one JSON object per record; ``kvtrace report`` and the
  experiment load it into DuckDB table ``resources``), and
- the OTel SDK metrics API (``kvtrace.resource.*`` gauges, each the maximum over the records since the
  previous collection, so an export interval longer than a step loses no peak, plus
  ``kvtrace.resource.step``, the latest step of those records, so a reader counts each step once): the
  caller's ``meter_provider`` (the instrumentor's), else a ``MeterProvider`` of its own with a periodic
  reader exporting OTLP to the endpoint and protocol of ``export.resolve_otlp`` (the traces' resolution),
  so the Collector -> Prometheus -> Grafana path and ``kvtrace collect`` show them; with no endpoint,
  OTLP/JSON metric lines under
  ``{data_dir}/metrics/otlp-metrics-{run_id}.jsonl``.

A probe failure stops the sampler (logged once), never the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

from otel_kvtrace.export.sinks import safe_run_id
from otel_kvtrace.resources.probe import FIELDS, WorkerProbe, sample_memory

logger = logging.getLogger("otel_kvtrace")
_PEAK_FIELDS = ("tasks_in_flight", "save_tasks_in_flight", "metadata_in_flight", "metadata_bytes",
                "outstanding_leases", "backend_copies_pending")
METRIC_PREFIX = "kvtrace.resource."
IDLE_AFTER_S = 0.1
IDLE_POLL_MS = 50.0


def metric_name(field: str) -> tuple[str, str]:
    """OTel name and unit of a probe field: ``host_rss_bytes`` -> (``kvtrace.resource.host_rss``, ``By``).
    Prometheus (the Collector's exporter adds the unit suffix, drops braces units) shows it as
    ``kvtrace_resource_host_rss_bytes``, i.e. ``kvtrace_resource_{field}`` for every field."""
    if field.endswith("_bytes"):
        return METRIC_PREFIX + field[: -len("_bytes")], "By"
    return METRIC_PREFIX + field, "{item}"


def resources_path(data_dir: str | Path, run_id: str) -> Path:
    return Path(data_dir) / "metrics" / f"resources-{safe_run_id(run_id)}.jsonl"


class ResourceSampler:
    """Samples ``probe()`` (default: a ``WorkerProbe`` of ``worker``, memory once per record) and exports one
    record per step."""

    def __init__(self, worker: Any, data_dir: str | Path, run_id: str, *, poll_ms: float = 2.0,
                 attributes: dict[str, Any] | None = None, probe: Callable[[], dict[str, Any]] | None = None,
                 memory: Callable[[], dict[str, Any]] = sample_memory, export_interval_ms: int = 1000,
                 step_source: Callable[[], int] | None = None, meter_provider: Any = None,
                 endpoint: str | None = None, protocol: str | None = None) -> None:
        self._probe = probe or WorkerProbe(worker)
        self._memory = memory
        self._step_source = step_source
        self.path = resources_path(data_dir, run_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")  # noqa: SIM115 - lives as long as the sampler
        self._poll_s = poll_ms / 1000
        self._step = -1
        self._stop = threading.Event()
        self.records = 0
        self.polls = 0
        self.cpu_ns = 0
        self.error: str | None = None
        self._latest: dict[str, Any] = {}
        self._since_collect: dict[str, Any] = {}
        self._lock = threading.Lock()  # sampler thread vs the metric reader's callbacks (per record, not per poll)
        self._own_provider = meter_provider is None
        self._provider = meter_provider if meter_provider is not None else _meter_provider(
            Path(data_dir), run_id, attributes or {}, export_interval_ms, endpoint, protocol)
        self._register_gauges()
        self._thread = threading.Thread(target=self._run, name="kvtrace-resources", daemon=True)

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def notify_step(self, step: int) -> None:
        """Called by the forward loop after step ``step``: one attribute write."""
        self._step = step

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._fh.closed:
            self._fh.close()
        if self._own_provider:
            self._provider.shutdown()

    def _current_step(self) -> int:
        return self._step_source() if self._step_source is not None else self._step

    # -- sampler thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        seen = self._current_step() if self._step_source is not None else -1
        peaks: dict[str, int | None] = dict.fromkeys(_PEAK_FIELDS)
        sample: dict[str, Any] = {}
        t0 = time.thread_time_ns()
        last_step_at = time.monotonic()
        wait = self._poll_s
        try:
            while not self._stop.wait(wait):
                step = self._current_step()  # read before sampling: this sample already belongs to the next step
                sample = self._probe()
                self.polls += 1
                now = time.monotonic()
                if step != seen:
                    seen, last_step_at = step, now
                    self._write(step, sample, peaks)
                    peaks = dict.fromkeys(_PEAK_FIELDS)
                _raise_peaks(peaks, sample)
                idle = now - last_step_at > IDLE_AFTER_S and not sample.get("tasks_in_flight") \
                    and not sample.get("save_tasks_in_flight")
                wait = IDLE_POLL_MS / 1000 if idle else self._poll_s
            step = self._current_step()
            if step != seen:  # the last step ended after the previous poll: its record is not lost
                self._write(step, sample, peaks)
        except Exception as exc:  # noqa: BLE001 - instrumentation failures disable the instrumentation
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("otel-kvtrace: resource sampler stopped: %s", self.error)
        finally:
            self.cpu_ns = time.thread_time_ns() - t0  # the sampler's own CPU time (bench/serve_resources.py)

    def _write(self, step: int, sample: dict[str, Any], peaks: dict[str, int | None]) -> None:
        """Peak fields: the step's peak over the polls; memory fields: read now (once per step)."""
        record: dict[str, Any] = {"t_unix_ns": time.time_ns(), "step": step}
        memory = self._memory()
        for key in FIELDS:
            record[key] = peaks[key] if key in peaks else memory.get(key, sample.get(key))
        with self._lock:
            self._latest = record
            for key in FIELDS:
                value, prev = record[key], self._since_collect.get(key)
                if value is not None and (prev is None or value > prev):
                    self._since_collect[key] = value
        self._fh.write(orjson.dumps(record) + b"\n")
        self._fh.flush()
        self.records += 1

    def collect(self, key: str) -> Any:
        """The gauge value of ``key``: the maximum since the previous collection (else the latest record)."""
        with self._lock:
            value = self._since_collect.pop(key, None)
            return value if value is not None else self._latest.get(key)

    def _register_gauges(self) -> None:
        from opentelemetry.metrics import CallbackOptions, Observation

        meter = self._provider.get_meter("otel_kvtrace.resources")

        def gauge(key: str) -> None:
            def callback(_options: CallbackOptions) -> list[Observation]:
                value = self.collect(key)
                return [] if value is None else [Observation(value)]

            name, unit = metric_name(key)
            meter.create_observable_gauge(name, [callback], unit=unit,
                                          description=f"peak of {key} over the steps since the last export "
                                                      "(docs/schema.md)")

        for key in ("step", *FIELDS):  # step: lets a reader of the OTLP points count each step once
            gauge(key)


def _raise_peaks(peaks: dict[str, int | None], sample: dict[str, Any]) -> None:
    for key in _PEAK_FIELDS:
        value = sample.get(key)
        if value is not None and (peaks[key] is None or value > peaks[key]):  # type: ignore[operator]
            peaks[key] = value


def _meter_provider(data_dir: Path, run_id: str, attributes: dict[str, Any], interval_ms: int,
                    endpoint: str | None = None, protocol: str | None = None) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_kvtrace.export.worker import build_resource, resolve_otlp

    target, chosen, explicit = resolve_otlp(endpoint, protocol)
    url = metrics_url(target, chosen) if explicit else None  # from the environment: the SDK's per-signal rules
    if target is None:
        exporter: Any = JsonLinesMetricExporter(data_dir / "metrics" / f"otlp-metrics-{safe_run_id(run_id)}.jsonl")
    elif chosen == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter(endpoint=url)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # type: ignore[assignment]

        exporter = OTLPMetricExporter(endpoint=url)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    resource = Resource.create(build_resource({**attributes, "kvtrace.run_id": run_id}))
    return MeterProvider(resource=resource, metric_readers=[reader])


def metrics_url(endpoint: str | None, protocol: str) -> str | None:
    """The metrics URL next to an explicit traces endpoint (OTLP/HTTP: ``.../v1/traces`` -> ``.../v1/metrics``)."""
    if endpoint is None or protocol == "grpc":
        return endpoint
    base = endpoint.rstrip("/")
    base = base[: -len("/v1/traces")] if base.endswith("/v1/traces") else base
    return base + "/v1/metrics"


class JsonLinesMetricExporter(MetricExporter):
    """OTel SDK metric exporter writing OTLP/JSON ``ExportMetricsServiceRequest`` lines (no endpoint)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab")

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **_: Any) -> MetricExportResult:
        doc = json_format.MessageToDict(encode_metrics(metrics_data))
        self._fh.write(orjson.dumps(doc) + b"\n")
        self._fh.flush()
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **_: Any) -> None:
        if not self._fh.closed:
            self._fh.close()
