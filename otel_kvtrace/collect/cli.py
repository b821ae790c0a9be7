"""``kvtrace collect``: a thin click shell over ``otel_kvtrace.collect.collect``."""

from __future__ import annotations

from pathlib import Path

import click

from otel_kvtrace.collect.bind import HostError
from otel_kvtrace.collect.receiver import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_QUEUE_BYTES,
    DEFAULT_OUT_DIR,
    OutputDirError,
    PortInUseError,
)
from otel_kvtrace.collect.run import collect


@click.command("collect")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_OUT_DIR,
    show_default=True,
    help="Directory for the OTLP/JSON lines file (collected-{pid}.jsonl); `kvtrace report` reads it.",
)
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=DEFAULT_GRPC_PORT, show_default=True,
              help="OTLP/gRPC port (0 = any free port).")
@click.option("--http-port", type=click.IntRange(0, 65535), default=DEFAULT_HTTP_PORT, show_default=True,
              help="OTLP/HTTP port, paths /v1/traces and /v1/metrics (0 = any free port).")
@click.option("--no-grpc", is_flag=True, help="Do not listen for gRPC.")
@click.option("--no-http", is_flag=True, help="Do not listen for HTTP.")
@click.option("--host", default=DEFAULT_HOST, show_default=True,
              help="Address to bind. Loopback only unless --allow-remote is given too.")
@click.option("--allow-remote", is_flag=True,
              help="Allow a --host that is not loopback (e.g. 0.0.0.0): the receiver has no authentication.")
@click.option("--max-queue-mb", type=click.IntRange(1), default=DEFAULT_MAX_QUEUE_BYTES // 2**20, show_default=True,
              help="Request MiB that may wait for the file writer; beyond it senders are told to retry.")
@click.option("--status-interval", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Seconds between count lines on stderr (0 = only at exit).")
def collect_command(
    out: Path,
    grpc_port: int,
    http_port: int,
    no_grpc: bool,
    no_http: bool,
    host: str,
    allow_remote: bool,
    max_queue_mb: int,
    status_interval: float,
) -> None:
    """Receive OTLP traces (and resource metrics) from kvtrace-instrumented workers for `kvtrace report`.

    An OpenTelemetry Collector for one machine without docker: OTLP over gRPC and HTTP (protobuf or
    JSON) on loopback, one OTLP/JSON line per request, the same layout as the Collector's file
    exporter; metrics (the kvtrace.resource.* series) go to OUT/metrics/, shown by `kvtrace report OUT`. Several worker processes can export at once. Stop with Ctrl-C or SIGTERM: everything
    received is written before it exits, then it prints the counts.

    \b
    Example:
      kvtrace collect --out ./kvtrace-data/traces &
      OTEL_KVTRACE_ENABLED=1 OTEL_EXPORTER_OTLP_PROTOCOL=grpc \\
        OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 vllm serve ...
      kill %1 && kvtrace report ./kvtrace-data/traces
    """
    if no_grpc and no_http:
        raise click.UsageError("--no-grpc and --no-http together leave nothing to listen on")
    try:
        collect(
            out=out,
            grpc_port=None if no_grpc else grpc_port,
            http_port=None if no_http else http_port,
            host=host,
            allow_remote=allow_remote,
            max_queue_bytes=max_queue_mb * 2**20,
            status_interval=status_interval,
        )
    except PortInUseError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from exc
    except HostError as exc:
        raise click.BadParameter(str(exc), param_hint="--host") from exc
    except OutputDirError as exc:
        raise click.BadParameter(str(exc), param_hint="--out") from exc
