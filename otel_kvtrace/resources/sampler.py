"""Resource series: one record per forward step, sampled on a thread of its own (off the hot path).

The forward thread only stores the step number (``notify_step``: one attribute write). The sampler
thread polls the in-flight counters every ``poll_ms`` (they peak mid-step, when the window of prefetched
loads is queued, and are ~0 at a step boundary) and, when the step number moved, writes one record with
the step's peak of each counter and the host/NPU memory read once. Records go to

- ``{data_dir}/metrics/resources-{run_id}.jsonl`` (one JSON object per record; ``kvtrace report`` and the
  experiment load it into DuckDB table ``resources``), and
- the OTel SDK metrics API (``kvtrace.resource.*`` gauges, plus ``kvtrace.resource.step``, the step of the
  record the other gauges show): a ``MeterProvider`` with a periodic reader
  exporting OTLP (gRPC or HTTP, from ``OTEL_EXPORTER_OTLP_*``) when an endpoint is set, so the Collector
  -> Prometheus -> Grafana path shows them; with no endpoint, OTLP/JSON metric lines under
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

from otel_kvtrace import config
from otel_kvtrace.resources.probe import FIELDS, sample_counters, sample_memory

logger = logging.getLogger("otel_kvtrace")
_PEAK_FIELDS = ("tasks_in_flight", "save_tasks_in_flight", "metadata_in_flight", "metadata_bytes",
                "outstanding_leases", "backend_copies_pending")
METRIC_PREFIX = "kvtrace.resource."


def metric_name(field: str) -> tuple[str, str]:
    """OTel name and unit of a probe field: ``host_rss_bytes`` -> (``kvtrace.resource.host_rss``, ``By``).
    Prometheus (the Collector's exporter adds the unit suffix, drops braces units) shows it as
    ``kvtrace_resource_host_rss_bytes``, i.e. ``kvtrace_resource_{field}`` for every field."""
    if field.endswith("_bytes"):
        return METRIC_PREFIX + field[: -len("_bytes")], "By"
    return METRIC_PREFIX + field, "{item}"


def resources_path(data_dir: str | Path, run_id: str) -> Path:
    return Path(data_dir) / "metrics" / f"resources-{run_id}.jsonl"


class ResourceSampler:
    """Samples ``probe()`` (default: ``sample_counters(worker)``, memory once per record) and exports one record per step."""

    def __init__(self, worker: Any, data_dir: str | Path, run_id: str, *, poll_ms: float = 2.0,
                 attributes: dict[str, Any] | None = None, probe: Callable[[], dict[str, Any]] | None = None,
                 memory: Callable[[], dict[str, Any]] = sample_memory, export_interval_ms: int = 1000) -> None:
        self._probe = probe or (lambda: sample_counters(worker))
        self._memory = memory
        self.path = resources_path(data_dir, run_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")
        self._poll_s = poll_ms / 1000
        self._step = -1
        self._stop = threading.Event()
        self.records = 0
        self.cpu_ns = 0
        self.error: str | None = None
        self._latest: dict[str, Any] = {}
        self._provider = _meter_provider(Path(data_dir), run_id, attributes or {}, export_interval_ms)
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
        self._fh.close()
        self._provider.shutdown()

    # -- sampler thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        seen: int = -1
        peaks: dict[str, int | None] = dict.fromkeys(_PEAK_FIELDS)
        t0 = time.thread_time_ns()
        try:
            while not self._stop.wait(self._poll_s):
                step = self._step  # read before sampling: this sample already belongs to the next step
                sample = self._probe()
                if step != seen:
                    seen = step
                    self._write(step, sample, peaks)
                    peaks = dict.fromkeys(_PEAK_FIELDS)
                for key in _PEAK_FIELDS:
                    value = sample.get(key)
                    if value is not None and (peaks[key] is None or value > peaks[key]):  # type: ignore[operator]
                        peaks[key] = value
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
        self._latest = record
        self._fh.write(orjson.dumps(record) + b"\n")
        self._fh.flush()
        self.records += 1

    def _register_gauges(self) -> None:
        from opentelemetry.metrics import CallbackOptions, Observation

        meter = self._provider.get_meter("otel_kvtrace.resources")

        def gauge(key: str) -> None:
            def callback(_options: CallbackOptions) -> list[Observation]:
                value = self._latest.get(key)
                return [] if value is None else [Observation(value)]

            name, unit = metric_name(key)
            meter.create_observable_gauge(name, [callback], unit=unit,
                                          description=f"per-step peak of {key} (docs/schema.md)")

        for key in ("step", *FIELDS):  # step: lets a reader of the OTLP points count each step once
            gauge(key)


def _meter_provider(data_dir: Path, run_id: str, attributes: dict[str, Any], interval_ms: int) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    endpoint = config.otlp_endpoint()
    if endpoint is None:
        exporter: Any = JsonLinesMetricExporter(data_dir / "metrics" / f"otlp-metrics-{run_id}.jsonl")
    elif config.otlp_protocol() == config.PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # type: ignore[assignment]

        exporter = OTLPMetricExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    from otel_kvtrace.export.worker import build_resource

    resource = Resource.create(build_resource({**attributes, "kvtrace.run_id": run_id}))
    return MeterProvider(resource=resource, metric_readers=[reader])


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
