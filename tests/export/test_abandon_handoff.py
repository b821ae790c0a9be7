"""Shutdown abandoning a worker still busy with a batch, and the worker settling that batch, agree on who
counts it (one lock): never twice, never not at all, ``delivered + spooled + dropped == recorded``. The
worker is held at each side of the hand-off with an Event, so each interleaving runs deterministically."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from export_records import fill_record

from otel_kvtrace.export.worker import THREAD_NAME, BackgroundExporter
from otel_kvtrace.record.recorder import Recorder

TASKS = 40
BATCH = 10
WAIT_S = 10.0


class Gate:
    """Holds the exporter thread once where it is placed, until ``release``."""

    def __init__(self) -> None:
        self.entered, self.released, self.armed = threading.Event(), threading.Event(), True

    def hold(self) -> None:
        if self.armed and threading.current_thread().name == THREAD_NAME:
            self.armed = False
            self.entered.set()
            self.released.wait(WAIT_S)


class GatedRecorder(Recorder):
    """Holds the worker in ``recycle``: after it counted its batch, before its hand-off ends."""

    def __init__(self, gate: Gate | None) -> None:
        super().__init__()
        self.gate = gate

    def recycle(self, records: list) -> None:  # type: ignore[override]
        if self.gate is not None:
            self.gate.hold()
        super().recycle(records)


class GatedSink:
    """A sink (no stats of its own, like the file sink) that accepts every batch, once held inside."""

    def __init__(self, gate: Gate | None) -> None:
        self.gate, self.accepted = gate, 0

    def export(self, span_texts: Sequence[str], dropped: int) -> bool:
        if self.gate is not None:
            self.gate.hold()
        self.accepted += len(span_texts)
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        return None


def _exporter(recorder: Recorder, sink: GatedSink) -> BackgroundExporter:
    for i in range(TASKS):
        rec = recorder.new_record()
        fill_record(rec, seq=i, step=i // 8, layer_id=i % 8, t0=recorder.clock())
        recorder.submit(rec)
    return BackgroundExporter(recorder, sink, interval_s=0.01, batch_size=BATCH)


def test_a_batch_counted_by_the_worker_is_not_counted_again_by_shutdown() -> None:
    gate = Gate()
    recorder = GatedRecorder(gate)
    exporter = _exporter(recorder, GatedSink(None))
    assert gate.entered.wait(WAIT_S)  # the first batch is exported and counted; its hand-off not ended
    exporter.shutdown(0.05)  # abandons the worker: what the recorder holds is dropped, that batch is not
    gate.released.set()
    exporter._thread.join(WAIT_S)
    stats = exporter.stats()
    assert stats.balanced and stats.pending == 0, stats
    assert (stats.recorded, stats.delivered, stats.dropped) == (TASKS, BATCH, TASKS - BATCH)


def test_a_batch_abandoned_in_the_sink_and_then_accepted_counts_as_delivered_once() -> None:
    gate = Gate()
    sink = GatedSink(gate)
    exporter = _exporter(Recorder(), sink)
    assert gate.entered.wait(WAIT_S)  # the worker is inside the sink with its first batch
    exporter.shutdown(0.05)  # abandons it: counted as dropped, with all the recorder holds
    stats = exporter.stats()
    assert stats.balanced and (stats.delivered, stats.dropped) == (0, TASKS), stats
    gate.released.set()  # the sink takes the batch after all: it moves from dropped to delivered
    exporter._thread.join(WAIT_S)
    stats = exporter.stats()
    assert stats.balanced and stats.pending == 0, stats
    assert (stats.recorded, stats.delivered, stats.dropped) == (TASKS, sink.accepted, TASKS - BATCH) == \
        (TASKS, BATCH, TASKS - BATCH)
