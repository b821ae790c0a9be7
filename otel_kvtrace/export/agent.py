"""The exporter agent: a separate process that drains one serving process's ring and ships its spans.

Started by ``AgentExporter`` (``export/agent_link.py``) as ``python -m otel_kvtrace.export.agent``, one
per serving process (and per forked child). It reads its settings from stdin, maps the ring from the
file descriptor it inherited, decodes messages (``record/ring.py``) back into ``TaskRecord``s, builds
spans with the one ``SpanBuilder`` and hands batches to the sink ``create_sink`` selects, exactly as
the in-process exporter would. All span building, JSON, protobuf and network I/O happen here.

It notices that its producer died (stdin EOF, or the parent pid changed) and then drains everything
committed in the ring: a SIGKILL or ``os._exit`` of the serving process loses only messages whose write
was cut short (counted in ``H_AGENT_LOST``). Tasks still awaiting their consumer wait are exported with
``kvtrace.consumer_wait_missing``.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import mmap
import os
import pickle
import select
import signal
import sys
import time
from collections import OrderedDict
from typing import Any

from otel_kvtrace.export.spans import SpanBuilder, TransferSummary
from otel_kvtrace.record.model import NUM_DEPS, QueueInfo, ShippedError, Stage, TaskRecord
from otel_kvtrace.record.recorder import ClockAnchor
from otel_kvtrace.record import ring as R

logger = logging.getLogger("otel_kvtrace")

READY = b"kvtrace-agent ready\n"
_CONSUMER_WAIT = int(Stage.CONSUMER_WAIT)
MAX_AWAITING = 65536
MAX_ERRORS = 1024


class Decoder:
    """Turns ring messages into finished ``TaskRecord``s; keeps the side tables (queues, request ids,
    transfer-task summaries)."""

    def __init__(self) -> None:
        self.queues: dict[int, QueueInfo] = {}
        self.req_ids: dict[int, str] = {}
        # Summary index -> what the span builder reads of the task's transfer tasks (shared by the tasks
        # of a step); ``None`` when a request id it names never arrived.
        self.summaries: dict[int, TransferSummary | None] = {R.NO_SUMMARY: TransferSummary([], [], 0)}
        self.errors: dict[tuple[int, int], ShippedError] = {}
        self.awaiting: OrderedDict[tuple[int, int], TaskRecord] = OrderedDict()
        self.resource_updates: dict[str, Any] = {}
        self.closed = False
        self.undecodable = 0  # tasks lost here since the agent last took the count (into its ``lost``)
        self.malformed = 0  # committed slots whose body did not decode (all time; named in the agent's log)
        self.bound_released = 0  # tasks exported without their consumer wait at MAX_AWAITING (all time)
        self.orphan_waits = 0  # consumer waits whose task was not awaiting any more (all time)

    def feed(self, msg: R.Message, out: list[TaskRecord]) -> None:
        """Decode one message; append every record it finishes to ``out``. Never raises: a slot that does
        not decode is counted in ``malformed``, and in ``undecodable`` (lost) when it was or may have been
        a task (a malformed side-table message costs the tasks that name it, counted when they come)."""
        try:
            if not self._feed(msg, out):
                raise ValueError(f"unknown message kind {msg.kind}")
        except Exception:  # noqa: BLE001 - a bad slot must not kill the agent (then the ring overflows)
            self.malformed += 1
            if msg.kind == R.MSG_TASK or msg.kind > R.MSG_SUMMARY:
                self.undecodable += 1
            if self.malformed == 1:
                logger.warning("otel-kvtrace agent: malformed ring slot %d (kind %d, %d bytes) counted as lost",
                               msg.index, msg.kind, len(msg.body), exc_info=True)

    def _feed(self, msg: R.Message, out: list[TaskRecord]) -> bool:
        kind, body = msg.kind, msg.body
        if kind == R.MSG_TASK:
            rec, awaiting = self._task(body)
            if rec is None:
                self.undecodable += 1  # a queue or request id definition it needs is missing: counted as lost
                return True
            if awaiting:
                key = (self._qidx(rec), rec.seq)
                self.awaiting[key] = rec
                if len(self.awaiting) > MAX_AWAITING:  # bounded: export the oldest without its wait, flagged
                    oldest = self.awaiting.popitem(last=False)[1]
                    oldest.consumer_release = R.REASON_AGENT_BOUND
                    out.append(oldest)
                    self.bound_released += 1
                    if self.bound_released == 1:
                        logger.warning("otel-kvtrace agent: %d tasks awaited their consumer wait; the oldest are "
                                       "exported without it (kvtrace.consumer_wait_missing=agent_bound)",
                                       MAX_AWAITING)
            else:
                out.append(rec)
        elif kind == R.MSG_CWAIT:
            qidx, seq, reason, n = R.CWAIT_FIXED.unpack_from(body)
            rec = self.awaiting.pop((qidx, seq), None)
            if rec is None:
                self.orphan_waits += 1  # its task was released without it (agent_bound) or never decoded
            else:
                if n:  # the authoritative consumer wait: drop any partial copy shipped with the task
                    rec.stages[:] = _without_consumer_wait(rec.stages)
                rec.stages.extend(R._INTS[n].unpack_from(body, R.CWAIT_FIXED.size))
                rec.consumer_release = reason
                out.append(rec)
        elif kind == R.MSG_SUMMARY:
            self._summary(body)
        elif kind == R.MSG_QUEUE:
            self._queue(body)
        elif kind == R.MSG_REQ:
            idx, n = R.REQ_FIXED.unpack_from(body)
            self.req_ids[idx] = body[R.REQ_FIXED.size : R.REQ_FIXED.size + n].decode("utf-8", "replace")
            if len(self.req_ids) > 2 * 65536:
                for old in sorted(self.req_ids)[:65536]:
                    del self.req_ids[old]
        elif kind == R.MSG_ERROR:
            qidx, seq, *lens = R.ERROR_FIXED.unpack_from(body)
            texts = _strings(body, R.ERROR_FIXED.size, lens)
            if len(self.errors) >= MAX_ERRORS:
                self.errors.clear()
            self.errors[(qidx, seq)] = ShippedError(*texts)
        elif kind == R.MSG_RESOURCE:
            key, value = marshal.loads(body)
            self.resource_updates[str(key)] = value
        elif kind == R.MSG_CLOSE:
            self.closed = True
        elif kind != R.MSG_VOID:
            return False
        return True

    def release_awaiting(self, reason: int, out: list[TaskRecord]) -> None:
        """Every task still waiting for its consumer wait, flagged with ``reason``."""
        while self.awaiting:
            rec = self.awaiting.popitem(last=False)[1]
            rec.consumer_release = reason
            out.append(rec)

    def _qidx(self, rec: TaskRecord) -> int:
        return rec.queue_index  # type: ignore[attr-defined]

    def _queue(self, body: bytes) -> None:
        idx, pid, dp, pp, tp, pcp, dcp, layers, *lens = R.QUEUE_FIXED.unpack_from(body)
        run_id, path, thread = _strings(body, R.QUEUE_FIXED.size, lens)
        self.queues[idx] = QueueInfo(run_id, path, thread, pid, dp, pp, tp, pcp, dcp, layers)

    def _summary(self, body: bytes) -> None:
        sidx, num_blocks, n_groups, n_reqs, _flags = R.SUMMARY_FIXED.unpack_from(body)
        off = R.SUMMARY_FIXED.size
        groups = list(R._INTS[n_groups].unpack_from(body, off))
        known = self.req_ids
        reqs: list[str] | None = []
        for i in R._U32S[n_reqs].unpack_from(body, off + 8 * n_groups):
            name = known.get(i)
            if name is None:  # its definition never arrived: not exported under a made-up name
                reqs = None
                break
            reqs.append(name)
        summaries = self.summaries
        if len(summaries) > 2 * R.SUMMARY_GENERATION:  # bounded: the writer re-defines what it still uses
            for old in list(summaries)[1 : R.SUMMARY_GENERATION + 1]:
                del summaries[old]
        summaries[sidx] = None if reqs is None else TransferSummary(groups, reqs, num_blocks)

    def _task(self, body: bytes) -> tuple[TaskRecord | None, bool]:
        v = R.TASK_FIXED.unpack_from(body)  # struct.error on a short body
        if len(body) != R.TASK_LAYOUTS[v[-1]].size:  # n_stage_ints says how long the body is
            raise ValueError(f"task body of {len(body)} bytes for {v[-1]} stage ints")
        (qidx, kind, final, outcome, flags, seq, step, layer, src, gate, qdepth, inflight, t_enq, t_deq,
         t_ret, t_done, nbytes, bres, has_dep) = v[:19]
        deps = list(v[19 : 19 + 2 * NUM_DEPS])
        sidx, n_st = v[19 + 2 * NUM_DEPS :]
        queue = self.queues.get(qidx)
        summary = self.summaries.get(sidx)
        if queue is None or summary is None:  # a definition it needs was lost (ring overflow): cannot be named
            return None, False
        stages = list(R._INTS[n_st].unpack_from(body, R.TASK_STAGES_AT))
        rec = _QueuedRecord(
            queue=queue, kind=kind, seq=seq, step=step, layer_id=layer, final_layer=bool(final),
            wait_for_save_layer=src if flags & R.F_SRC else None, gate_id=gate if flags & R.F_GATE else None,
            queue_depth_at_enqueue=qdepth, inflight_at_enqueue=inflight, t_enqueue=t_enq, t_dequeue=t_deq,
            t_backend_return=t_ret, t_complete=t_done, stages=stages, deps=deps, has_dep=has_dep,
            outcome=outcome, nbytes=nbytes, backend_result=bres, transfer_tasks=summary,
        )
        rec.queue_index = qidx
        rec.error = self.errors.pop((qidx, seq), None)
        return rec, bool(flags & R.F_AWAITING)


class _QueuedRecord(TaskRecord):
    """A decoded record that remembers its ring queue index (to match its consumer wait)."""

    __slots__ = ("queue_index",)


def _without_consumer_wait(stages: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(stages) - 2, 3):
        if stages[i] != _CONSUMER_WAIT:
            out += stages[i : i + 3]
    return out


def _strings(body: bytes, off: int, lens: list[int]) -> list[str]:
    out = []
    for n in lens:
        out.append(body[off : off + n].decode("utf-8", "replace"))
        off += n
    return out


class Priority:
    """Where and how the agent runs (``OTEL_KVTRACE_AGENT_SCHED``, ``_NICE``, ``_CPUS``).

    ``SCHED_IDLE`` keeps the agent off the CPUs the serving threads want (a woken serving thread preempts
    it at once and the kernel counts its CPU as idle when it places a woken thread). An idle-policy agent
    on a saturated host would get almost no CPU and let the ring overflow, so while the backlog is more
    than ``ESCALATE`` of the ring it runs ``SCHED_OTHER`` at its nice level, back to idle at ``RELAX``."""

    ESCALATE = 0.5
    RELAX = 0.125

    def __init__(self, sched: str, nice: int, cpus: list[int] | None) -> None:
        self.want_idle = sched == "idle" and hasattr(os, "SCHED_IDLE")
        self.nice = nice
        self.cpus = cpus
        self.idle = False  # the policy in force
        self.escalations = 0

    def apply(self) -> None:
        """Once, before any other thread of the agent starts (threads inherit policy, nice and affinity)."""
        with contextlib.suppress(OSError):
            os.nice(self.nice)
        if self.cpus and hasattr(os, "sched_setaffinity"):
            allowed = set(self.cpus) & os.sched_getaffinity(0)
            if allowed:
                os.sched_setaffinity(0, allowed)
            else:
                logger.warning("otel-kvtrace agent: none of the CPUs %s is allowed; running on %s", self.cpus,
                               sorted(os.sched_getaffinity(0)))
        if self.want_idle:
            self._set(True)

    def update(self, backlog: int, nslots: int) -> None:
        """After each drain cycle: leave or resume the idle policy by how full the ring is."""
        if not self.want_idle:
            return
        if self.idle and backlog > self.ESCALATE * nslots:
            self.escalations += 1
            self._set(False)
        elif not self.idle and backlog <= self.RELAX * nslots:
            self._set(True)

    def _set(self, idle: bool) -> None:
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        try:
            for tid in os.listdir("/proc/self/task"):  # every thread: the sink's sender too
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError as exc:  # e.g. leaving SCHED_IDLE for a nice level below RLIMIT_NICE, unprivileged
            logger.warning("otel-kvtrace agent: cannot switch to %s (%s); staying as it is",
                           "SCHED_IDLE" if idle else "SCHED_OTHER", exc)
            self.want_idle = False  # one warning: no more switches either way
            return
        self.idle = idle


class Agent:
    """The drain loop: ring -> records -> spans -> sink, until the producer closes or dies."""

    def __init__(self, reader: R.RingReader, sink: Any, builder: SpanBuilder, producer_pid: int,
                 interval_s: float, batch_size: int, priority: Priority | None = None) -> None:
        self.priority = priority
        self.reader = reader
        self.sink = sink
        self.builder = builder
        self.producer_pid = producer_pid
        self.interval_s = interval_s
        self.batch_size = batch_size
        self.decoder = Decoder()
        self.lost = 0
        self.shutdown_timeout_s: float | None = None  # the sink's deadline, sent by a producer shutting down
        self.shutdown_at: float | None = None

    def run(self, control: Any) -> None:
        producer_gone = False
        while not self.decoder.closed and not producer_gone:
            ready, _, _ = select.select([control], [], [], self.interval_s)
            if ready:
                data = os.read(control.fileno(), 4096)
                if not data:
                    producer_gone = True  # stdin EOF: the producer closed its end or died
                self._control(data)
            if os.getppid() != self.producer_pid:
                producer_gone = True
            self._reprioritize()
            while self._cycle(self.reader.poll(self.batch_size)):
                pass
            self._reprioritize()
        # Final drain: everything committed, then what a dead producer claimed but never finished.
        while self._cycle(self.reader.poll(self.batch_size)):
            pass
        if not self.decoder.closed:
            msgs, torn = self.reader.skip_to_head()
            self.lost += torn
            self._cycle(msgs)
        out: list[TaskRecord] = []
        self.decoder.release_awaiting(R.REASON_SHUTDOWN if self.decoder.closed else R.REASON_PRODUCER_DIED, out)
        self._export(out)
        self.reader.consumed()
        self.reader.hdr[R.H_AGENT_LOST] = self.lost
        if self.lost:
            logger.warning("otel-kvtrace agent: %d task records lost (serving process died mid-write, sink failed, "
                           "or a definition they name was lost); %d malformed ring slots", self.lost,
                           self.decoder.malformed)
        if self.decoder.bound_released or self.decoder.orphan_waits:
            logger.warning("otel-kvtrace agent: %d tasks exported without their consumer wait at the awaiting bound "
                           "(agent_bound); %d consumer waits came after their task had gone",
                           self.decoder.bound_released, self.decoder.orphan_waits)

    def _reprioritize(self) -> None:
        if self.priority is not None:
            hdr = self.reader.hdr
            self.priority.update(int(hdr[R.H_HEAD]) - int(hdr[R.H_READ]), self.reader.nslots)

    def _control(self, data: bytes) -> None:
        """``shutdown <seconds>``: the deadline the producer gives the sink (it waits that plus a margin)."""
        for line in data.splitlines():
            if line.startswith(b"shutdown "):
                with contextlib.suppress(ValueError):
                    self.shutdown_timeout_s = max(0.0, float(line.split()[1]))
                    self.shutdown_at = time.monotonic()

    def sink_deadline(self, default_s: float | None) -> float | None:
        """What is left of the producer's deadline for the sink's final delivery."""
        if self.shutdown_timeout_s is None or self.shutdown_at is None:
            return default_s
        return max(0.0, self.shutdown_timeout_s - (time.monotonic() - self.shutdown_at))

    def _cycle(self, msgs: list[R.Message]) -> bool:
        if not msgs:
            return False
        out: list[TaskRecord] = []
        decoder = self.decoder
        for msg in msgs:
            if msg.kind == R.MSG_RESOURCE and out:  # attributes apply to what comes after them
                self._export(out)
                out = []
            decoder.feed(msg, out)
            if decoder.resource_updates:
                update = getattr(self.sink, "update_resource", None)
                if update is not None:
                    update(dict(decoder.resource_updates))
                decoder.resource_updates.clear()
        self._export(out)
        if decoder.undecodable:
            self.lost += decoder.undecodable
            decoder.undecodable = 0
            self.reader.hdr[R.H_AGENT_LOST] = self.lost
        self.reader.consumed()
        return True

    def _export(self, records: list[TaskRecord]) -> None:
        if not records:
            return
        texts = [self.builder.build_json(rec) for rec in records]
        hdr = self.reader.hdr
        ok = False
        try:
            ok = bool(self.sink.export(texts, hdr[R.H_DROPPED] + self.lost))
        except Exception as exc:  # noqa: BLE001 - a sink error loses this batch only (counted)
            logger.debug("otel-kvtrace agent: export failed: %r", exc)
        if ok:
            hdr[R.H_EXPORTED] += len(records)
        else:
            self.lost += len(records)
            hdr[R.H_AGENT_LOST] = self.lost
        self.publish_sink_stats()

    def publish_sink_stats(self) -> None:
        """The delivering sink's counts into the ring header, for the serving process's ``stats()``."""
        stats = getattr(self.sink, "stats", None)
        if stats is None:
            return
        try:
            s = stats()
        except Exception as exc:  # noqa: BLE001 - counts are best effort; the export itself went on
            logger.debug("otel-kvtrace agent: sink stats failed: %r", exc)
            return
        hdr = self.reader.hdr
        hdr[R.H_SINK_DELIVERED], hdr[R.H_SINK_SPOOLED], hdr[R.H_SINK_DROPPED] = s.delivered, s.spooled, s.dropped
        hdr[R.H_SINK_STATS] = 1


def main() -> int:
    """Entry point: settings (a pickled dict) on stdin, then stdin stays open as the liveness pipe."""
    from otel_kvtrace.export.sinks import JsonLinesFileSink
    from otel_kvtrace.export.worker import create_sink

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # A stop signal for the serving process is often sent to its whole process group (Ctrl-C in a
    # terminal, `kill -- -PGID`, container runtimes): the agent must outlive it to drain the ring. It ends
    # on its producer's EOF or death instead (``Agent.run``).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    try:
        if sys.stdin.isatty():
            raise ValueError("stdin is a terminal")
        settings = pickle.load(stdin)  # from AgentExporter, our own parent: trusted
        fd = int(settings["fd"])
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"otel_kvtrace.export.agent is started by start_tracing, not by hand ({exc!r})\n")
        return 2
    # Background work: the serving process's threads come first. Before the sink starts its threads.
    priority = Priority(settings.get("sched", "normal"), int(settings.get("nice", 0)), settings.get("cpus"))
    priority.apply()
    mem = mmap.mmap(fd, R.ring_bytes(settings["nslots"]))
    os.close(fd)
    reader = R.RingReader(mem)
    reader.hdr[R.H_AGENT_PID] = os.getpid()
    resource = settings["resource"]
    sink = create_sink(resource, out_dir=settings["out_dir"], endpoint=settings["endpoint"],
                       protocol=settings["protocol"])
    if isinstance(sink, JsonLinesFileSink):
        sink.name_pid = settings["producer_pid"]  # the file is the serving process's, not ours
    anchor = ClockAnchor(*settings["anchor"])
    agent = Agent(reader, sink, SpanBuilder(anchor), settings["producer_pid"], settings["interval_s"],
                  settings["batch_size"], priority)
    out = sys.stdout.buffer
    with contextlib.suppress(OSError):  # a producer that already died cannot read it: drain anyway
        out.write(READY)
        out.flush()
    try:
        agent.run(stdin)
    finally:
        with contextlib.suppress(Exception):
            sink.shutdown(agent.sink_deadline(settings.get("shutdown_timeout_s")))
        agent.publish_sink_stats()  # after the final delivery attempt: what is delivered, what stays spooled
    with contextlib.suppress(Exception):
        out.write(f"exported={reader.hdr[R.H_EXPORTED]} lost={agent.lost}\n".encode())
        out.flush()
    with contextlib.suppress(OSError):  # the producer may be gone: no broken-pipe noise at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
