"""``kvtrace resend DIR``: deliver a delivery spool that a process left on disk.

A ``DeliveringSink`` that could not reach its endpoint before shutdown leaves its batches in
``{OTEL_KVTRACE_SPOOL_DIR}/{run_id}-{pid}/`` and logs this command. It sends every batch oldest first
with the same retry, back-off and splitting as the sink, deleting each batch once the receiver
acknowledged it, so running it again after an interruption sends only what is left. A spool whose
process is still running (it holds the spool's lock) is skipped and counted as left: sending it too
would deliver its batches twice.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

from otel_kvtrace import config
from otel_kvtrace.export.delivery import Sender
from otel_kvtrace.export.spool import Spool, SpoolBusy, is_spool_dir, read_meta


class ResendError(ValueError):
    """The directory is not a spool, or no endpoint is known for it."""


@dataclass(slots=True)
class ResendResult:
    """Tasks per outcome over every spool directory sent."""

    directories: list[Path] = field(default_factory=list)
    delivered: int = 0
    left: int = 0  # still on disk (receiver down until the deadline, or it refused them)
    left_batches: int = 0
    busy: list[str] = field(default_factory=list)  # why each skipped spool was not sent (a live process has it)


def spool_directories(path: Path) -> list[Path]:
    """``path`` itself when it is a spool, else the spools directly under it (a spool root)."""
    if not path.is_dir():
        raise ResendError(f"{path}: not a directory")
    if is_spool_dir(path):
        return [path]
    found = sorted(p for p in path.iterdir() if p.is_dir() and is_spool_dir(p))
    if not found:
        raise ResendError(f"{path}: no delivery spool here (a spool directory holds spool.json)")
    return found


def resend(
    path: str | Path,
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    timeout_s: float | None = None,
    progress: Callable[[Path, int, int], None] | None = None,
) -> ResendResult:
    """Send the spool(s) at ``path`` to ``endpoint`` (default: the one each spool was written for).

    ``timeout_s`` bounds the whole run (None: until everything sendable is delivered). ``progress`` is
    called after each batch with (spool directory, tasks delivered so far, tasks left in it).
    """
    from otel_kvtrace.export.sinks import OtlpGrpcSink, OtlpHttpSink

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    result = ResendResult()
    for directory in spool_directories(Path(path)):
        meta = read_meta(directory)
        url = endpoint or meta.get("endpoint") or config.otlp_endpoint()
        chosen = protocol or meta.get("protocol") or config.otlp_protocol()
        if not url:
            raise ResendError(f"{directory}: no endpoint recorded in spool.json; pass --endpoint")
        if chosen not in config.PROTOCOLS:
            raise ResendError(f"{directory}: protocol {chosen!r} is not one of {', '.join(config.PROTOCOLS)}")
        try:
            spool = Spool(directory, max_bytes=sys.maxsize, lock=True)
        except SpoolBusy as exc:
            waiting = Spool(directory, max_bytes=sys.maxsize)  # read-only look: counts what is left
            result.busy.append(str(exc))
            result.left += waiting.tasks
            result.left_batches += waiting.batches
            continue
        try:
            transport = (OtlpGrpcSink if chosen == config.PROTOCOL_GRPC else OtlpHttpSink)({}, url)
        except RuntimeError as exc:  # an SDK the sinks cannot send through
            spool.close()
            raise ResendError(str(exc)) from exc
        sender = Sender(spool, transport, max_request_bytes=config.env_int(
            config.OTEL_KVTRACE_EXPORT_MAX_REQUEST_BYTES, config.DEFAULT_EXPORT_MAX_REQUEST_BYTES))
        report = (lambda: progress(directory, sender.delivered, spool.tasks)) if progress is not None else None
        try:
            sender.run_until(deadline, report)
        finally:
            transport.shutdown()
            spool.close()
        result.directories.append(directory)
        result.delivered += sender.delivered
        result.left += spool.tasks
        result.left_batches += spool.batches
        spool.remove_if_empty()
    return result


@click.command("resend")
@click.argument("spool", type=click.Path(path_type=Path))
@click.option("--endpoint", help="OTLP endpoint (default: the one in the spool's spool.json, then OTEL_EXPORTER_OTLP_*).")
@click.option("--protocol", type=click.Choice(config.PROTOCOLS), help="grpc or http/protobuf (default: the spool's).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0), default=None,
              help="Give up after this many seconds (default: keep retrying until everything is delivered).")
def resend_command(spool: Path, endpoint: str | None, protocol: str | None, timeout_s: float | None) -> None:
    """Deliver a spool that a traced process left on disk when its OTLP endpoint was unreachable.

    SPOOL is one spool directory (it holds spool.json) or a spool root holding several. Batches are
    sent oldest first, retried with back-off, split when too large, and deleted once acknowledged;
    an interrupted run can simply be repeated. Exit code 1 if anything is left.

    \b
    Example:
      kvtrace resend ./kvtrace-data/spool/myrun-1234
      kvtrace resend ./kvtrace-data/spool --endpoint http://127.0.0.1:4317 --protocol grpc --timeout 60
    """

    def progress(directory: Path, delivered: int, left: int) -> None:
        click.echo(f"{directory}: {delivered} tasks delivered, {left} left", err=True)

    try:
        result = resend(spool, endpoint=endpoint, protocol=protocol, timeout_s=timeout_s, progress=progress)
    except ResendError as exc:
        raise click.BadParameter(str(exc), param_hint="SPOOL") from exc
    for reason in result.busy:
        click.echo(f"skipped {reason}; resend it once that process has exited", err=True)
    click.echo(f"resend: {result.delivered} tasks delivered from {len(result.directories)} spool(s), "
               f"{result.left} left in {result.left_batches} batches", err=True)
    if result.left:
        sys.exit(1)
