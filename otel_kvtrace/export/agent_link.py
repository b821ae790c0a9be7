"""The serving process's side of the exporter agent: create the ring, start the agent, stop it.

``AgentExporter`` has the ``BackgroundExporter`` interface (``force_flush``, ``shutdown``,
``update_resource``), so a ``TracingSession`` does not care which one it holds. It starts no thread in
the serving process: after ``start`` the only per-task work there is ``RingWriter.write_task``.
``create_agent_exporter`` falls back to the in-process ``BackgroundExporter`` (one log line) when the
agent cannot start (no ``memfd``, spawn failure, no handshake in time).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from otel_kvtrace import config
from otel_kvtrace.export.worker import ExportStats, _weak_callback, observe_export_stats
from otel_kvtrace.record import ring as R
from otel_kvtrace.record.recorder import Recorder

logger = logging.getLogger("otel_kvtrace")

AGENT_MODULE = "otel_kvtrace.export.agent"
DEFAULT_START_TIMEOUT_S = 20.0
# What the agent needs beyond its sink's delivery deadline: draining the ring, the sender's 1 s join,
# the transport's shutdown. The serving process waits deadline + margin before it kills the agent.
SHUTDOWN_MARGIN_S = 5.0
EXIT_MARGIN_S = 0.2
"""At process exit the agent's sink gets ``OTEL_KVTRACE_EXIT_DRAIN_MS`` minus this, the agent the whole
deadline (at least this much, to spool the ring's tail) before it is killed."""


class AgentUnavailable(RuntimeError):
    """The exporter agent could not be started (the caller falls back to the in-process exporter)."""


class AgentExporter:
    """Owns one ring and the agent process that drains it."""

    def __init__(
        self,
        recorder: Recorder,
        resource: Mapping[str, Any],
        *,
        out_dir: str | os.PathLike[str] | None = None,
        endpoint: str | None = None,
        protocol: str | None = None,
        nslots: int = R.DEFAULT_SLOTS,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        meter_provider: Any = None,
    ) -> None:
        self.recorder = recorder
        self._settings = {
            "resource": dict(resource),
            "out_dir": None if out_dir is None else os.fspath(out_dir),
            "endpoint": endpoint,
            "protocol": protocol,
            "nslots": nslots,
            "anchor": (recorder.anchor.clock_ns, recorder.anchor.epoch_ns),
            "interval_s": config.env_int(config.OTEL_KVTRACE_EXPORT_INTERVAL_MS, config.DEFAULT_EXPORT_INTERVAL_MS)
            / 1000,
            "batch_size": config.env_int(config.OTEL_KVTRACE_EXPORT_BATCH_SIZE, config.DEFAULT_EXPORT_BATCH_SIZE),
            "nice": config.env_int(config.OTEL_KVTRACE_AGENT_NICE, config.DEFAULT_AGENT_NICE, minimum=0),
            "sched": config.agent_sched(),
            "cpus": config.agent_cpus(),
        }
        self.timeout_s = config.env_int(config.OTEL_KVTRACE_EXPORT_TIMEOUT_MS, config.DEFAULT_EXPORT_TIMEOUT_MS) / 1000
        self._settings["shutdown_timeout_s"] = self.timeout_s  # the agent's default sink deadline
        self._proc: subprocess.Popen[bytes] | None = None
        self._shutdown_done = False
        self._killed = False
        self.writer = self._spawn(start_timeout_s, wait=True)
        recorder.attach_ring(self.writer)
        self._final: tuple[int, int] | None = None  # (exported, lost) once shut down and unmapped
        self._final_stats: ExportStats | None = None
        from opentelemetry import metrics

        observe_export_stats((meter_provider or metrics.get_meter_provider()).get_meter("otel_kvtrace"), self.stats,
                             dropped=True)
        atexit.register(self.shutdown_at_exit)
        if hasattr(os, "register_at_fork"):  # weakly: a shut-down exporter (and its ring) can be freed
            os.register_at_fork(after_in_child=_weak_callback(self, "_after_fork_in_child"))

    # ---- lifecycle ------------------------------------------------------------------------------
    def _spawn(self, timeout_s: float, *, wait: bool) -> R.RingWriter:
        if not hasattr(os, "memfd_create"):
            raise AgentUnavailable("os.memfd_create is not available on this platform")
        fd, mem = R.create_memfd(self._settings["nslots"])
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", AGENT_MODULE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(fd,),
                close_fds=True,
                env=_agent_env(),
            )
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(pickle.dumps({**self._settings, "fd": fd, "producer_pid": os.getpid()}))
            proc.stdin.flush()  # stdin stays open: its EOF tells the agent this process is gone
        except Exception as exc:
            mem.close()
            raise AgentUnavailable(f"could not start {AGENT_MODULE}: {exc!r}") from exc
        finally:
            os.close(fd)
        self._proc = proc
        if wait and not _await_ready(proc, timeout_s):
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(1.0)
            mem.close()
            raise AgentUnavailable(f"{AGENT_MODULE} did not report ready within {timeout_s:.0f} s")
        return R.RingWriter(mem)

    def _after_fork_in_child(self) -> None:
        # The parent's ring and agent are not ours: writing there would interleave with the parent's
        # claims. A fresh ring and agent for this process; records wait in the ring until it is up.
        parent = self._proc
        if parent is not None:
            # Our copies of the parent agent's pipes: else it never sees its producer's EOF. Closed through
            # their file objects (flushed after every write), so nothing closes these fd numbers again later,
            # when they may belong to this process's own ring or agent pipes.
            for pipe in (parent.stdin, parent.stdout):
                if pipe is not None:
                    with contextlib.suppress(Exception):
                        pipe.close()
        self._proc = None
        self.recorder.after_fork()
        if self._shutdown_done:
            return
        self._settings["resource"] = {**self._settings["resource"], "process.pid": os.getpid()}
        inherited = self.writer
        try:
            self.writer = self._spawn(0.0, wait=False)
            self.recorder.attach_ring(self.writer)
            inherited.release()  # the parent's ring: unmapped in this process
        except Exception as exc:  # noqa: BLE001
            self.recorder.attach_ring(None)
            logger.warning("otel-kvtrace: exporter agent for forked child %d not started (%s): exporting in-process",
                           os.getpid(), exc)
            self._fallback = _in_process(self.recorder, self._settings)

    def update_resource(self, attributes: Mapping[str, Any]) -> None:
        """Merge ``attributes`` into the resource of everything the agent exports from now on."""
        if self._final is not None:
            return
        for key, value in attributes.items():
            self.writer.resource(str(key), value)

    @property
    def exported_tasks(self) -> int:
        if self._final is not None:
            return self._final[0]
        return int(self.writer.hdr[R.H_EXPORTED])

    @property
    def lost(self) -> int:
        """Tasks shipped to the ring but not exported: the agent's count (sink failures, torn writes),
        or, once the agent is gone, everything it did not export (``submitted = exported + lost``)."""
        if self._final is not None:
            return self._final[1]
        hdr = self.writer.hdr
        lost = int(hdr[R.H_AGENT_LOST])
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            lost = max(lost, self.recorder.submitted - int(hdr[R.H_EXPORTED]))
        return lost

    def stats(self) -> ExportStats:
        """Where every recorded task is (``ExportStats``), from the ring header the agent keeps current:
        dropped = full ring + lost in the agent + dropped by its delivering sink (spool cap)."""
        if self._final_stats is not None:
            return self._final_stats
        fallback = getattr(self, "_fallback", None)  # a forked child whose own agent did not start
        if fallback is not None:
            return fallback.stats()
        hdr = self.writer.hdr
        recorder = self.recorder
        ring_dropped = recorder.dropped
        recorded = recorder.submitted + ring_dropped
        if hdr[R.H_SINK_STATS]:
            delivered, spooled, sink_dropped = (int(hdr[R.H_SINK_DELIVERED]), int(hdr[R.H_SINK_SPOOLED]),
                                                int(hdr[R.H_SINK_DROPPED]))
        else:  # a file sink: exported is written
            delivered, spooled, sink_dropped = self.exported_tasks, 0, 0
        dropped = ring_dropped + self.lost + sink_dropped
        pending = max(0, recorded - delivered - spooled - dropped)
        if self._killed and pending:  # nobody will move them any more
            if hdr[R.H_SINK_STATS]:
                spooled += pending  # a delivering sink spools every batch it accepts before sending it
            else:
                dropped += pending
            pending = 0
        return ExportStats(recorded, delivered, spooled, dropped, pending)

    def force_flush(self, timeout_s: float | None = None, *, poll_s: float = 0.005) -> bool:
        """Wait until the agent has exported everything written so far. True if it did in time.
        ``poll_s``: the sleep between checks; 0 waits on the CPU (a benchmark that must not leave it)."""
        if self._final is not None:  # shut down: everything that could be was exported
            return True
        hdr = self.writer.hdr
        target = hdr[R.H_HEAD]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while hdr[R.H_READ] < target:
            if time.monotonic() > deadline or self._proc is None or self._proc.poll() is not None:
                return False
            if poll_s:
                time.sleep(poll_s)
        return True

    def shutdown_at_exit(self) -> bool:
        """The drain of a dying process: the agent is waited for ``OTEL_KVTRACE_EXIT_DRAIN_MS`` in all
        (``EXIT_MARGIN_S`` of it for the agent's own wrap-up), then killed."""
        deadline_s = config.exit_drain_s()
        return self.shutdown(max(0.0, deadline_s - EXIT_MARGIN_S), wait_s=max(deadline_s, EXIT_MARGIN_S))

    def shutdown(self, timeout_s: float | None = None, *, wait_s: float | None = None) -> bool:
        """Tell the agent to finish (its sink's deadline ``timeout_s``), wait for it to drain and exit
        (``wait_s``, default the deadline plus ``SHUTDOWN_MARGIN_S``). Idempotent; never raises."""
        if self._shutdown_done:
            return True
        self._shutdown_done = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.shutdown_at_exit)
        proc = self._proc
        if proc is None:
            return False
        self.writer.hdr[R.H_DROPPED] = self.recorder.dropped  # final and exact: one thread writes it here
        self.writer.close()
        deadline_s = self.timeout_s if timeout_s is None else timeout_s
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.write(f"shutdown {deadline_s!r}\n".encode())  # the agent's sink deadline
            proc.stdin.flush()
        with contextlib.suppress(Exception):
            proc.stdin.close()
        finished = True
        try:
            proc.wait(deadline_s + SHUTDOWN_MARGIN_S if wait_s is None else wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("otel-kvtrace: exporter agent did not finish in time; stopping it")
            proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(1.0)
            finished = False
            self._killed = True
        finally:
            with contextlib.suppress(Exception):
                assert proc.stdout is not None
                proc.stdout.close()
        hdr = self.writer.hdr
        finished = finished and hdr[R.H_READ] >= hdr[R.H_HEAD] and hdr[R.H_AGENT_LOST] == 0
        self._final = (self.exported_tasks, self.lost)
        self._final_stats = self.stats()
        if self.recorder.ring is self.writer:
            self.recorder.attach_ring(None)  # later records (tracing stopped) stay in the bounded hand-off
        self.writer.release()
        return finished


def _agent_env() -> dict[str, str]:
    """This environment, with the directory this package was imported from first on ``PYTHONPATH``
    (the serving process may have found it through a ``sys.path`` the agent would not inherit)."""
    import otel_kvtrace

    root = os.path.dirname(os.path.dirname(os.path.abspath(otel_kvtrace.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _await_ready(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    got = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            return False
        got += chunk
        if got.startswith(b"kvtrace-agent ready"):
            return True
    return False


def _in_process(recorder: Recorder, settings: Mapping[str, Any], meter_provider: Any = None) -> Any:
    from otel_kvtrace.export.worker import create_exporter

    return create_exporter(recorder, settings["resource"], out_dir=settings["out_dir"],
                           endpoint=settings["endpoint"], protocol=settings["protocol"],
                           meter_provider=meter_provider)


def create_agent_exporter(
    recorder: Recorder,
    resource: Mapping[str, Any],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    meter_provider: Any = None,
) -> Any:
    """An ``AgentExporter``; the in-process ``BackgroundExporter`` (one log line) if the agent cannot start."""
    from otel_kvtrace.export.worker import build_resource

    full = build_resource(resource)
    try:
        return AgentExporter(recorder, full, out_dir=out_dir, endpoint=endpoint, protocol=protocol,
                             meter_provider=meter_provider)
    except AgentUnavailable as exc:
        logger.warning("otel-kvtrace: exporter agent unavailable (%s): exporting in-process", exc)
        return _in_process(recorder, {"resource": full, "out_dir": out_dir, "endpoint": endpoint,
                                      "protocol": protocol}, meter_provider)
