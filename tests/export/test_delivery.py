"""Delivery through misbehaving real receivers on loopback: every recorded task is delivered, spooled or
counted as dropped (``recorded == delivered + spooled + dropped``), and once the receiver works again
everything arrives (distinct trace and span ids counted at the receiver)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from export_records import fill_record
from fault_receivers import BlackHole, GrpcReceiver, HttpReceiver
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_kvtrace.export import create_exporter
from otel_kvtrace.export.delivery import DeliveringSink
from otel_kvtrace.export.worker import BackgroundExporter
from otel_kvtrace.record.recorder import Recorder
from tests.polling import wait_until

TASKS = 2400
SPANS_PER_TASK = 12
RESOURCE = {"kvtrace.source": "replica", "kvtrace.run_id": "delivery-test"}


def _run(endpoint: str, protocol: str, *, shutdown_s: float, during: object = None,
         batch_size: int = 256) -> BackgroundExporter:
    """Record TASKS tasks (half, ``during()``, the other half) and shut the exporter down."""
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE, endpoint=endpoint, protocol=protocol)
    exporter.batch_size = batch_size
    exporter.interval_s = 0.05
    for i in range(TASKS):
        rec = recorder.new_record()
        fill_record(rec, seq=i, step=i // 8, layer_id=i % 8, t0=recorder.clock())
        recorder.submit(rec)
        if i == TASKS // 2 and callable(during):
            during(exporter)
    exporter.shutdown(timeout_s=shutdown_s)
    return exporter


def _assert_all_arrived(exporter: BackgroundExporter, acked: object) -> None:
    stats = exporter.stats()
    assert stats.balanced, stats
    assert (stats.recorded, stats.delivered, stats.spooled, stats.dropped, stats.pending) == (TASKS, TASKS, 0, 0, 0)
    assert len(acked.roots) == TASKS  # type: ignore[attr-defined]
    assert len(acked.ids) == TASKS * SPANS_PER_TASK  # type: ignore[attr-defined]


def test_slow_grpc_receiver_gets_everything() -> None:
    receiver = GrpcReceiver(sleep_s=0.15)
    try:
        exporter = _run(receiver.endpoint, "grpc", shutdown_s=30)
    finally:
        receiver.stop()
    _assert_all_arrived(exporter, receiver.acked)


def test_resource_exhausted_with_retry_info_is_retried() -> None:
    receiver = GrpcReceiver(refuse=4, code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_delay_s=0.2)
    try:
        exporter = _run(receiver.endpoint, "grpc", shutdown_s=30)
    finally:
        receiver.stop()
    assert receiver.acked.refused == 4
    assert exporter.sink.stats().retries == 4  # type: ignore[attr-defined]
    _assert_all_arrived(exporter, receiver.acked)


def test_http_503_with_retry_after_is_retried() -> None:
    receiver = HttpReceiver(refuse=3, status=503, retry_after="1")
    started = time.monotonic()
    try:
        exporter = _run(receiver.endpoint, "http/protobuf", shutdown_s=30)
    finally:
        receiver.stop()
    assert receiver.acked.refused == 3
    assert time.monotonic() - started >= 3  # three Retry-After: 1 waits were honoured
    _assert_all_arrived(exporter, receiver.acked)


def test_grpc_receiver_killed_mid_run_and_revived() -> None:
    """Gated on what happened, not on sleeps: killed once the first tasks are acknowledged, revived once
    the sender has failed against the dead port."""
    receiver = GrpcReceiver()
    revive = threading.Thread(target=lambda: (wait_until(lambda: sink.stats().retries >= 1), receiver.start()))
    sink: DeliveringSink

    def kill_and_revive_later(exporter: BackgroundExporter) -> None:
        nonlocal sink
        sink = exporter.sink  # type: ignore[assignment]
        assert wait_until(lambda: len(receiver.acked.roots) >= 64)  # the first batches are delivered
        receiver.stop()  # the rest is recorded and spooled while it is down
        revive.start()

    try:
        exporter = _run(receiver.endpoint, "grpc", shutdown_s=60, during=kill_and_revive_later, batch_size=64)
    finally:
        revive.join(90)
        receiver.stop()
    assert exporter.sink.stats().retries >= 1  # type: ignore[attr-defined]
    _assert_all_arrived(exporter, receiver.acked)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_partial_success_is_counted_as_dropped_not_delivered(protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    """A receiver that answers every request with ``partial_success.rejected_spans = 1``: each such
    request loses one task from ``delivered`` to ``dropped`` (named ``refused``), and one log line says so."""
    receiver = (GrpcReceiver if protocol == "grpc" else HttpReceiver)(reject_one_span=True)
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        try:
            exporter = _run(receiver.endpoint, protocol, shutdown_s=30)
        finally:
            receiver.stop()
    stats, sink_stats = exporter.stats(), exporter.sink.stats()  # type: ignore[attr-defined]
    partials = receiver.acked.partials
    assert partials >= 1 and stats.balanced, stats
    assert (sink_stats.refused, sink_stats.refused_spans) == (partials, partials)
    assert (stats.delivered, stats.dropped, stats.spooled) == (TASKS - partials, partials, 0)
    assert len(receiver.acked.ids) == TASKS * SPANS_PER_TASK - partials
    assert any("rejected 1 spans" in r.getMessage() and "one span dropped" in r.getMessage() for r in caplog.records)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unavailable_closes_the_old_grpc_channel_before_reconnecting() -> None:
    """Every UNAVAILABLE opens a new channel; the old one is closed, not leaked (one per failed attempt)."""
    from otel_kvtrace.export.sinks import RETRY, OtlpGrpcSink

    sink = OtlpGrpcSink({}, f"http://127.0.0.1:{_free_port()}")
    request = ExportTraceServiceRequest()
    old = sink._current()._channel
    assert sink.attempt(request, threading.Event()).outcome == RETRY
    new = sink._current()._channel
    assert new is not old
    with pytest.raises(ValueError, match="closed channel"):
        old.unary_unary("/probe")(b"", timeout=1)
    sink.shutdown()


class _FailsOnce:
    """A real HTTP transport whose first attempt raises (as a bug or an SDK change would)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0
        self.endpoint, self.protocol, self.endpoint_url = inner.endpoint, inner.protocol, inner.endpoint_url

    def attempt(self, request: ExportTraceServiceRequest, abort: threading.Event) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise AttributeError("'OTLPSpanExporter' object has no attribute '_something'")
        return self.inner.attempt(request, abort)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_the_sender_survives_a_step_that_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from otel_kvtrace.export import SpanBuilder
    from otel_kvtrace.export.sinks import OtlpHttpSink
    from otel_kvtrace.record.model import TaskRecord

    receiver = HttpReceiver()
    try:
        sink = DeliveringSink(lambda: _FailsOnce(OtlpHttpSink(RESOURCE, receiver.endpoint)), RESOURCE,
                              spool_root=tmp_path, run_id="survive", max_bytes=2**24, max_request_bytes=2**20)
        builder = SpanBuilder(Recorder().anchor)
        with caplog.at_level(logging.ERROR, logger="otel_kvtrace"):
            for seq in range(3):
                assert sink.export([builder.build_json(fill_record(TaskRecord(), seq=seq, step=seq))], 0)
            assert sink.flush(20), sink.stats()
        sink.shutdown(5)
    finally:
        receiver.stop()
    assert sink.stats().delivered == 3 and len(receiver.acked.roots) == 3
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()][0].count("AttributeError") == 1


def test_a_forked_child_does_not_take_the_parents_lock_or_counts() -> None:
    """The parent's sender lock held at fork time: the child's stats() and flush() must not wait on it,
    and report the child's own (empty) counts, not the parent's."""
    from otel_kvtrace.export import SpanBuilder, create_sink
    from otel_kvtrace.record.model import TaskRecord

    receiver = HttpReceiver()
    try:
        sink = create_sink(RESOURCE, endpoint=receiver.endpoint, protocol="http/protobuf")
        assert isinstance(sink, DeliveringSink)
        assert sink.export([SpanBuilder(Recorder().anchor).build_json(fill_record(TaskRecord(), seq=1, step=1))], 0)
        assert sink.flush(20) and sink.stats().accepted == 1
        with sink.sender.lock:
            pid = os.fork()
            if pid == 0:
                s = sink.stats()
                os._exit(0 if s.accepted == s.delivered == 0 and sink.flush(1) else 1)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child blocked on the parent's sender lock")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert sink.stats().accepted == 1
        sink.shutdown(5)
    finally:
        receiver.stop()


LIVE_WRITER = """
import sys, time
from tests.export.export_records import fill_record
from otel_kvtrace.export import SpanBuilder
from otel_kvtrace.export.delivery import DeliveringSink
from otel_kvtrace.export.sinks import OtlpHttpSink
from otel_kvtrace.record.model import TaskRecord
from otel_kvtrace.record.recorder import Recorder
endpoint, root = sys.argv[1], sys.argv[2]
sink = DeliveringSink(lambda: OtlpHttpSink({}, endpoint), {}, spool_root=root, run_id="live",
                      max_bytes=2**24, max_request_bytes=2**20)
builder = SpanBuilder(Recorder().anchor)
for seq in range(5):
    sink.export([builder.build_json(fill_record(TaskRecord(), seq=seq, step=seq))], 0)
print(sink.spool.directory, flush=True)
time.sleep(600)
"""


def test_resend_leaves_the_spool_of_a_running_process_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live process's spool (its endpoint down) is not sent by `kvtrace resend` (that would deliver its
    batches twice once the process reaches its endpoint); after the process is killed, it is."""
    from otel_kvtrace.export.resend import resend

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    hole = BlackHole()
    writer = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, hole.endpoint, str(tmp_path)],
                              cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"})
    receiver = HttpReceiver()
    try:
        spool_dir = Path(writer.stdout.readline().strip())  # type: ignore[union-attr]
        assert spool_dir.is_dir()
        busy = resend(spool_dir, endpoint=receiver.endpoint, timeout_s=10)
        assert busy.delivered == 0 and busy.left == 5 and len(receiver.acked.roots) == 0
        assert busy.busy and f"pid {writer.pid}" in busy.busy[0]
        writer.kill()
        writer.wait(10)
        done = resend(spool_dir, endpoint=receiver.endpoint, timeout_s=30)
        assert (done.delivered, done.left, done.busy) == (5, 0, [])
        assert len(receiver.acked.roots) == 5
    finally:
        writer.kill()
        writer.wait(10)
        receiver.stop()
        hole.stop()


def test_http_delivery_needs_the_sdk_client_it_sends_through() -> None:
    """The floor in pyproject.toml is the first exporter release with ``_client._submit`` (1.45.0); an
    exporter without it is refused with that version named, never silently retried forever."""
    import tomllib

    from otel_kvtrace.export import sinks

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    requirement = next(r for r in project["dependencies"] if r.startswith("opentelemetry-exporter-otlp>="))
    assert requirement.split(">=")[1].strip() + ".0" == sinks.MIN_HTTP_EXPORTER

    class OldShape(sinks.OtlpHttpSink):
        def _make_sdk_exporter(self) -> Any:
            exporter = super()._make_sdk_exporter()
            exporter._client = object()  # what a 1.30-1.44 exporter looks like: no single-attempt client
            return exporter

    with pytest.raises(RuntimeError, match=r"opentelemetry-exporter-otlp-proto-http>=1\.45\.0"):
        OldShape({}, "http://127.0.0.1:1")


def test_request_above_the_receiver_limit_is_split() -> None:
    receiver = GrpcReceiver(max_receive_bytes=256 * 1024)  # a 256-task batch is ~1 MB
    try:
        exporter = _run(receiver.endpoint, "grpc", shutdown_s=30)
    finally:
        receiver.stop()
    assert exporter.sink.stats().splits >= 2  # type: ignore[attr-defined]
    _assert_all_arrived(exporter, receiver.acked)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_black_hole_keeps_everything_on_disk_then_resend_delivers(
    protocol: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """An endpoint that accepts TCP and never answers: nothing is lost, the shutdown log names the resend
    command, and that command (a real `kvtrace` process) delivers all of it to a working receiver."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    hole = BlackHole()
    with caplog.at_level(logging.INFO, logger="otel_kvtrace"):
        try:
            exporter = _run(hole.endpoint, protocol, shutdown_s=2)
        finally:
            hole.stop()
    stats = exporter.stats()
    assert stats.balanced, stats
    assert (stats.recorded, stats.delivered, stats.spooled, stats.dropped) == (TASKS, 0, TASKS, 0)
    summary = [r.getMessage() for r in caplog.records if "export summary" in r.getMessage()]
    assert summary == [f"otel-kvtrace: export summary: recorded={TASKS} delivered=0 spooled={TASKS} dropped=0 "
                       "pending=0 (balanced)"]
    command = next(m.group(1) for r in caplog.records if (m := re.search(r"Resend with: (.*)$", r.getMessage())))
    spool_dir = Path(command.split()[2])
    assert spool_dir == exporter.sink.spool.directory  # type: ignore[attr-defined]
    assert f"--endpoint {hole.endpoint}" in command

    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        args = command.split()[1:3] + ["--endpoint", receiver.endpoint, "--timeout", "60"]
        done = subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", *args],
                              capture_output=True, text=True, timeout=120)
    finally:
        receiver.stop()
    assert done.returncode == 0, done.stderr
    assert f"resend: {TASKS} tasks delivered from 1 spool(s), 0 left" in done.stderr
    assert len(receiver.acked.roots) == TASKS
    assert len(receiver.acked.ids) == TASKS * SPANS_PER_TASK
    assert not spool_dir.exists()  # delivered batches are deleted; an empty spool is removed


def test_full_spool_drops_oldest_and_counts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_KVTRACE_SPOOL_MAX_MB", "1")  # ~200 tasks of ~5 KB
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    hole = BlackHole()
    try:
        exporter = _run(hole.endpoint, "http/protobuf", shutdown_s=1, batch_size=16)
    finally:
        hole.stop()
    stats = exporter.stats()
    assert stats.balanced, stats
    assert stats.recorded == TASKS and stats.delivered == 0
    assert stats.dropped > 0 and stats.spooled > 0
    sink = exporter.sink
    assert isinstance(sink, DeliveringSink)
    files = sorted(p.name for p in sink.spool.directory.glob("*.jsonl"))
    assert sum(int(name.split("-t")[1].split(".")[0]) for name in files) == stats.spooled
    # oldest first: what is left is the newest batches, contiguous, plus the batches the sender held
    # (never evicted under it) when the cap was hit: batch 0, and the next one if its attempt on batch 0
    # timed out and it claimed that one while the exit drain was still spooling
    seqs = [int(name.split("-")[0]) for name in files]
    newest = seqs[-1] + 1 - len([s for s in seqs if s > 1])
    held = [s for s in seqs if s < newest]
    assert seqs[0] == 0 and held in ([0], [0, 1]), seqs
    assert seqs[len(held):] == list(range(newest, sink.spool._next_seq)), seqs  # the newest, contiguous
    assert stats.spooled * 5_000 < 1.5 * 2**20


def test_a_forked_child_delivers_through_its_own_spool() -> None:
    """After fork the child builds its own spool (its pid in the name) and sender; the parent's is untouched."""
    import os

    from otel_kvtrace.export import SpanBuilder, create_sink
    from otel_kvtrace.record.model import TaskRecord

    receiver = HttpReceiver()
    try:
        sink = create_sink(RESOURCE, endpoint=receiver.endpoint, protocol="http/protobuf")
        assert isinstance(sink, DeliveringSink)
        parent_dir = sink.spool.directory
        text = SpanBuilder(Recorder().anchor).build_json(fill_record(TaskRecord(), seq=7, step=1))
        pid = os.fork()
        if pid == 0:  # child: report through the exit code only
            ok = sink.export([text], 0)
            sink.shutdown(10)
            s = sink.stats()
            os._exit(0 if ok and s.delivered == 1 and sink.spool.directory != parent_dir
                     and not sink.spool.directory.exists() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert len(receiver.acked.roots) == 1
        assert sink.spool.directory == parent_dir and parent_dir.is_dir() and sink.stats().accepted == 0
        sink.shutdown(1)
    finally:
        receiver.stop()


def test_a_spool_left_by_an_earlier_process_is_kept_apart(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Same run id and pid (a restarted container): the old spool is not adopted into the new counts."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    hole = BlackHole()
    try:
        first = _run(hole.endpoint, "http/protobuf", shutdown_s=1.5)
        old_dir = first.sink.spool.directory  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
            second = _run(hole.endpoint, "http/protobuf", shutdown_s=1.5)
    finally:
        hole.stop()
    new_dir = second.sink.spool.directory  # type: ignore[attr-defined]
    assert new_dir == old_dir.with_name(old_dir.name + ".1")
    old = first.stats()
    assert old.balanced and old.spooled > 0, old
    assert sum(int(p.name.split("-t")[1].split(".")[0]) for p in old_dir.glob("*.jsonl")) == old.spooled
    stats = second.stats()
    assert stats.balanced and stats.recorded == TASKS and stats.delivered == 0, stats
    assert any(f"kvtrace resend {old_dir}" in r.getMessage() for r in caplog.records)
