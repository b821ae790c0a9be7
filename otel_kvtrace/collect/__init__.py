"""Embedded OTLP receiver (``kvtrace collect``) for machines without docker.

It accepts OTLP traces and metrics over gRPC (``TraceService/Export``, ``MetricsService/Export``) and HTTP
(``POST /v1/traces``, ``/v1/metrics``; protobuf or JSON) on loopback and writes each request as one OTLP/JSON
line, the layout the Collector's file exporter writes and ``kvtrace report`` reads (metrics under
``metrics/``, read as the resource series).
"""

from otel_kvtrace.collect.bind import HostError
from otel_kvtrace.collect.receiver import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_OUT_DIR,
    OutputDirError,
    PortInUseError,
    Receiver,
    collected_file_name,
)
from otel_kvtrace.collect.run import collect
from otel_kvtrace.collect.stats import ReceiverStats

__all__ = [
    "DEFAULT_GRPC_PORT",
    "DEFAULT_HOST",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_OUT_DIR",
    "HostError",
    "OutputDirError",
    "PortInUseError",
    "Receiver",
    "ReceiverStats",
    "collect",
    "collected_file_name",
]
