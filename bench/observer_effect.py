"""How much tracing slows the forward: the REAL vLLM-Ascend recv thread serving a CPU-bound forward.

The released sdist (or ``KVTRACE_UPSTREAM_SRC``) is imported like the conformance tests do
(``tests/upstream/harness.py``). A forward-like loop runs steps of ``--layers`` layers; per layer it
enqueues the next layer's ``LayerLoadTask`` (prefetch 1, attention gate recorded, source save done),
does ``--work-us`` of pure-Python CPU work (the per-layer Python of a forward), then waits for this
layer's load event, as ``wait_for_layer_load`` does. The real recv thread (same process, same GIL)
serves the tasks. The measured quantity is the forward's step time.

Design (the statistics; what is measured is unchanged):

* **Two recv threads side by side, no switching cost.** ``off`` is a recv thread of upstream's own
  classes, which no session ever patches ("untraced: nothing patched"; checked before every segment:
  no wrapper or compiled probe on those classes, no otel_kvtrace frame on the forward's side of an
  ``off`` step). The traced mode's session instruments *subclasses* of the upstream classes (same
  name, no member of their own), and a second recv thread is built from them. So one session per
  *segment* (starting the exporter agent process costs ~0.2-0.5 s), and inside the segment the
  forward alternates short *blocks* of steps between the two threads, in ABBA order (off on | on off
  | off on ...), which cancels linear drift within each pair of blocks.
* **One paired ratio per pair of adjacent blocks**: (mean traced step time) / (mean off step time) - 1.
  The table shows the median over all pairs of a mode, with a distribution-free 95 % confidence
  interval of the median (order statistics of the binomial(n, 1/2)) and n, the number of pairs.
  A preempted block (the machine is shared) makes one outlier pair, which the median ignores.
  ``segments`` is the range of the per-segment medians: the CI is of the pairs of one run; when the
  machine changes regime between segments (another job starts), the segments disagree by more than
  the CI, and it shows there. Compare runs at the same ``step off ms``: on a 2-core host the step time
  of the same code differs between runs (6.3 vs 8.6 ms at 150 us per layer, both at load < 1), and
  the relative slowdown with it.
* **GC off in timed blocks** (as ``bench/whatif_fidelity.py``): collected and frozen at the start of a
  segment, disabled for its duration, young garbage collected between pairs (untimed). A gen-2
  collection lands in a random block and would be noise of the A/B. The GC pressure tracing adds is
  not hidden: ``gc/step`` is the net number of new GC-tracked objects per step (``gc.get_count()``),
  traced minus off, the quantity that triggers collections.
* **Short blocks**: ``--block-ms`` (default 40 ms, at least 2 steps: 2 steps at 1 ms per layer, ~6 at
  150 us). On a shared 2-core host the step time flips between regimes (~6 ms when the forward and
  the recv thread each get a core, 3-4x that when they share one) that last ~100 ms or more; short
  blocks keep most pairs inside one regime, so the pair's ratio is the tracing cost, not the regime.
* **Export work is charged where it runs.** ``thread``: the in-process exporter's span building holds
  the GIL; its thread is given an export interval of an hour, and after every traced block
  ``session.flush()`` exports the block's records on the forward's thread, its CPU time added to that
  block. ``agent``: the agent is another (``SCHED_IDLE``) process; what it does during a traced block is in
  the block (CPU contention, its only way to touch the forward).
* **The same untimed procedure before every block** (``--settle same``, the default since 2026-12-02,
  helper b1): the forward drains the agent (waits until it has exported everything; nothing to wait for
  after an off block) and then sleeps until ``--gap-ms`` (250 ms, more than the agent's 200 ms poll) has
  passed since the block before ended, whatever the block's kind. So no agent work of a traced block lands
  in an off block, and every block starts after the same idle. Up to then (``--settle drain-off``) only an
  off block that followed a traced one waited for the drain (up to one poll, asleep): on this 2-vCPU VM a
  forward that has slept starts its next blocks with both threads stacked on one core (cheaper: the GIL
  hand-offs stay on one core), so those off blocks, and the ones right after them, ran in another
  placement than the traced blocks and the ratio compared unlike placements (docs/export.md, "The trigger
  of the placement asymmetry"). ``--settle none`` runs every block back to back (serving's continuous
  forward; the agent drains at its poll, during whichever blocks run then); ``sleep-off`` is the trigger
  experiment (the old asymmetry as a plain sleep, no agent).
  What the agent does during a drain is in no block: ``agent cpu/step`` shows all of its CPU.

Modes (each against ``off``, one segment each in rotation; ``--diagnose`` and the diagnostic modes: docs/export.md,
"The two-core excess"): ``agent`` (default export: shared-memory
ring + exporter agent process; the headline), ``disabled`` (reference: installed, compiled probes,
agent running, ``recorder.enabled`` False, as after an internal error), ``thread`` (the in-process
exporter thread), ``wrappers`` (``agent`` with ``OTEL_KVTRACE_PROBES=wrappers``); not by default,
``aa`` (the A/A control: the second thread from the subclasses, no session: any reading but ~0 is a
bias of the design on this machine, e.g. -5..-14 % seen for ``disabled`` at load 4.6-6, never at load < 1),
``agent-pygate`` (``agent`` with the gate's record wrapper as its Python rule: the code before the native
``_probes.GateRecord``), ``floor`` (no session: the raw-stamp design's floor, ``--floor-stamps`` C-tape stamps per recv task and a copy,
one per enqueue and two around the forward's load wait on the forward's own tape, copied once per step;
what that design could reach in situ).
``--compete`` adds a run under one competing CPU-bound process.

Usage::

    .venv/bin/python bench/observer_effect.py                       # 1000 and 150 us per layer, idle
    .venv/bin/python bench/observer_effect.py --compete
    .venv/bin/python bench/observer_effect.py --modes agent --segments 6   # the headline only, tighter

Last line: ``forward_slowdown_pct=<median>``: the agent mode at the smallest ``--work-us``, idle.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import subprocess
import sys
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_overhead import _load_harness, _start  # noqa: E402  (one loader of the upstream harness)

INTERVAL_ENV = "OTEL_KVTRACE_EXPORT_INTERVAL_MS"
MODES = ("agent", "disabled", "thread", "wrappers", "aa", "agent-stop", "agent-nice", "agent-live", "agent-live-nice",
         "aa-burn", "floor", "agent-pygate")
BURN_RECV_US = 15
"""``aa-burn``: the A/A control whose second recv thread burns this much plain CPU per task before upstream's
``_handle_request`` (no tracing): does any added recv CPU change how the threads are placed?"""
DEFAULT_MODES = MODES[:4]
_SESSION_MODE = {"aa": "untraced", "agent": "traced+agent", "disabled": "traced+agent", "thread": "traced+thread",
                 "wrappers": "wrappers+agent", "agent-stop": "traced+agent", "agent-live": "traced+agent",
                 "agent-live-nice": "traced+agent", "agent-nice": "traced+agent", "aa-burn": "untraced",
                 "floor": "untraced", "agent-pygate": "traced+agent"}
FLOOR_STAMPS = 24
"""``floor`` (``--floor-stamps``' default): no session; the second recv thread's class wraps ``_handle_request`` with
this many raw stamps of ``bench/cold_floor.py``'s C tape (half before upstream's call, half after) and one copy of
them (a ring slot's stand-in); the forward has a tape of its own (one per thread, as the design): one stamp in
``add_request``, two around its load wait, one copy per step. What the raw-stamp design of docs/export.md ("The
cold footprint") costs in situ at its floor (no rules, no record, no agent)."""
FLOOR_TAPE_STAMPS = 127
"""What one ``cold_floor`` tape holds between two copies (``(id, clock)`` pairs); a recv task adds its stamps."""
_PY_GATE = ("agent-pygate",)
"""Modes whose session installs the gate's record wrapper as its Python rule (``wrappers.gate_record_rule``,
the code before ``_probes.GateRecord``): the native's gain, side by side with ``agent``."""
_STOPPED = ("agent-stop",)
"""Modes whose agent is SIGSTOPped during each traced block (SIGCONT after it, untimed; it drains in the
flush before the next off block): the serving process's cost with no agent CPU in the block."""
_LIVE = {INTERVAL_ENV: "5"}
_NICE = {"OTEL_KVTRACE_AGENT_SCHED": "normal"}
_MODE_ENV: dict[str, dict[str, str]] = {"agent-nice": _NICE, "agent-live": _LIVE, "agent-live-nice": {**_LIVE, **_NICE}}
"""Settings a mode's session starts with (the agent reads them when it is spawned)."""
_STUBS = os.path.join("instrument", "upstream.py")  # the torch/vllm stand-ins the sources import (not tracing)
_ROLES = ("worker", "recv_gva", "recv_key", "send_gva", "send_key", "gate")


def _burn(us: int) -> None:
    """Pure-Python CPU work for ``us`` microseconds of this thread's CPU time (holds the GIL like a forward)."""
    end = time.thread_time_ns() + us * 1000
    x = 0
    while time.thread_time_ns() < end:
        for i in range(20):
            x += i


def _block(up: Any, env: Any, steps: int, work_us: int) -> list[int]:
    """``steps`` forward steps on ``env``'s recv thread; each one's time in ns."""
    layers = env.num_layers
    request = env.request
    gate_class = env.gate_class
    add = env.thread.add_request
    load_done, save_done = env.load_done, env.save_done
    stamp = getattr(env, "floor_tape", None)  # ``floor``: the forward's tape (its load wait's stamps, a copy per step)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        shared = up.shared_data([request])  # one SharedBlockData per step, on every layer's task, as upstream
        for layer in range(layers + 1):
            if layer < layers:  # enqueue this layer (layer 0) or the next one (prefetch 1)
                gate = gate_class()
                gate.record()
                if layer:
                    save_done[layer - 1].set()
                add(up.gva_task(layer, [request], wait_for_save_layer=layer - 1 if layer else None,
                                gate=gate, shared=shared))
            if layer == 0:
                continue
            _burn(work_us)
            done = load_done[layer - 1]
            if stamp is not None:
                stamp(300)
            if not done.wait(10):
                raise RuntimeError(f"layer {layer - 1} never loaded")
            if stamp is not None:
                stamp(301)
            done.clear()
        if stamp is not None:
            stamp.ship()
        out.append(time.perf_counter_ns() - t0)
        for ev in save_done:
            ev.clear()
    return out


def _floor_class(recv_class: type, tmp: str, stamps: int) -> tuple[type, Any]:
    """``floor``: a subclass of ``recv_class`` whose ``_handle_request`` (``stamps`` stamps and a copy, on the recv
    thread's tape) and ``add_request`` (one stamp, on the forward's tape) are ``cold_floor``'s raw-stamp wrappers
    (the C tape built with ``gcc`` into ``tmp``, once per process), and the forward's tape."""
    import cold_floor

    if "kvtape" not in sys.modules:
        sys.path.insert(0, str(cold_floor.build_tape(Path(tmp))))
    import kvtape  # type: ignore[import-not-found]

    recv_tape, forward_tape = kvtape.Tape(), kvtape.Tape()
    handle, _ = cold_floor.wrappers("tape", stamps, recv_class._handle_request, recv_class.add_request, recv_tape)
    _, add = cold_floor.wrappers("tape", stamps, recv_class._handle_request, recv_class.add_request, forward_tape)
    return type(recv_class.__name__, (recv_class,), {"_handle_request": handle, "add_request": add}), forward_tape


def _traced_copy(up: Any) -> tuple[Any, dict[str, type]]:
    """Targets naming subclasses of the upstream classes (same name, nothing of their own): a session on
    them leaves upstream's own classes, which the ``off`` thread runs, untouched."""
    targets = up.binding.to_targets()
    sub = {role: type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
           for role, cls in up.binding.classes.items() if role in _ROLES and isinstance(cls, type)}

    def swap(cls: Any) -> Any:
        return next((s for s in sub.values() if s.__base__ is cls), cls) if isinstance(cls, type) else cls

    return dataclasses.replace(
        targets, worker_class=swap(targets.worker_class), gate_class=swap(targets.gate_class),
        recv_thread_classes=tuple(swap(c) for c in targets.recv_thread_classes),
        send_thread_classes=tuple(swap(c) for c in targets.send_thread_classes)), sub


def _env(h: Any, up: Any, layers: int, recv: type, gate: type) -> Any:
    saved = up.binding.classes["recv_gva"]
    up.binding.classes["recv_gva"] = recv  # gva_thread builds the class the binding names
    try:
        env = up.gva_thread(layers, h.FakeBackend())
    finally:
        up.binding.classes["recv_gva"] = saved
    env.gate_class = gate
    env.request = up.request("r-fwd", 16)
    return env


def _check_untouched(up: Any, off: Any) -> None:
    """The ``off`` thread runs upstream as it is: no member of ours on its classes, no frame of ours on
    the forward's side of one of its steps (the recv side is covered by the class check)."""
    from otel_kvtrace.instrument import patches, rewrite

    for role in _ROLES:
        cls = up.binding.classes.get(role)
        for name, value in vars(cls).items() if isinstance(cls, type) else ():
            if patches.is_wrapped(value) or rewrite.is_compiled(value):
                raise RuntimeError(f"off mode is not untraced: {cls.__qualname__}.{name} is instrumented")
    frames = [0]

    def profiler(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and "otel_kvtrace" in name and not name.endswith(_STUBS):
            frames[0] += 1

    sys.setprofile(profiler)
    try:
        _block(up, off, 1, 1)
    finally:
        sys.setprofile(None)
    if frames[0]:
        raise RuntimeError(f"off mode is not untraced: {frames[0]} otel_kvtrace frames in one step")


def _proc_cpu_ns(pid: int) -> int:
    """utime + stime of a process (Linux ``/proc``), in ns; 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


_COUNTS = ("cpu_ns", "rq_ns", "slices", "vcs", "ics", "sys_ns", "migrations")
"""Per thread, from ``/proc/<pid>/task/<tid>/``: ``schedstat`` (CPU ns, run-queue wait ns, timeslices),
``status`` (voluntary / involuntary context switches), ``stat`` (system CPU, in clock ticks: only
their sum over many blocks is worth reading) and ``sched`` (``se.nr_migrations``: moves between CPUs)."""
_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _task_counts(task_dir: str) -> list[int]:
    """The ``_COUNTS`` of one thread (zeros when it is gone)."""
    try:
        cpu, rq, slices = (int(v) for v in Path(task_dir, "schedstat").read_text().split()[:3])
        status = Path(task_dir, "status").read_text()
        stime = int(Path(task_dir, "stat").read_text().rsplit(")", 1)[1].split()[12])
        sched = Path(task_dir, "sched").read_text()
        migrations = int(sched.split("se.nr_migrations", 1)[1].split(":", 1)[1].split()[0])
    except (OSError, ValueError, IndexError):
        return [0] * len(_COUNTS)
    switches = {k: int(v) for k, _, v in (line.partition(":") for line in status.splitlines())
                if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
    return [cpu, rq, slices, switches.get("voluntary_ctxt_switches", 0), switches.get("nonvoluntary_ctxt_switches", 0),
            stime * _TICK_NS, migrations]


class _Probe:
    """Snapshots the scheduler counts of the forward, the block's recv thread, the other recv thread, the
    serving process's other threads and the agent process (all its threads), around one block."""

    ROWS = ("forward", "recv", "idle recv", "other", "agent")

    def __init__(self, agent_pid: int) -> None:
        self.forward = threading.get_native_id()
        self.agent_pid = agent_pid

    def snapshot(self, recv_tid: int, idle_tid: int) -> dict[str, list[int]]:
        named = {self.forward: "forward", recv_tid: "recv", idle_tid: "idle recv"}
        out = {row: [0] * len(_COUNTS) for row in self.ROWS}
        for tid in os.listdir("/proc/self/task"):
            row = out[named.get(int(tid), "other")]
            for i, v in enumerate(_task_counts(f"/proc/self/task/{tid}")):
                row[i] += v
        if self.agent_pid:
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{self.agent_pid}/task"):
                    for i, v in enumerate(_task_counts(f"/proc/{self.agent_pid}/task/{tid}")):
                        out["agent"][i] += v
        return out


def _add_delta(into: dict[str, list[int]], before: dict[str, list[int]], after: dict[str, list[int]]) -> None:
    for row, values in after.items():
        acc = into.setdefault(row, [0] * len(_COUNTS))
        for i, v in enumerate(values):
            acc[i] += v - before[row][i]


PINS = ("same", "split")
"""``--pin`` (a diagnostic, not a deployment advice): ``same`` puts the forward and both recv threads on the
first allowed CPU and the agent on the second, so every GIL hand-off stays on one core while the agent
has a core of its own; ``split`` puts the forward on the first CPU and the recv threads on the second, so
every hand-off crosses cores."""


def _pin(pin: str | None, forward: int, recvs: tuple[int, int], agent_pid: int) -> None:
    """Apply ``--pin`` to this segment's threads (``None``: every thread on every allowed CPU)."""
    cpus = sorted(os.sched_getaffinity(0) if pin is None else _ALLOWED)
    first, second = {cpus[0]}, {cpus[1 % len(cpus)]}
    place = {forward: set(cpus), recvs[0]: set(cpus), recvs[1]: set(cpus)}
    if pin == "same":
        place = {forward: first, recvs[0]: first, recvs[1]: first}
    elif pin == "split":
        place = {forward: first, recvs[0]: second, recvs[1]: second}
    for tid, where in place.items():
        os.sched_setaffinity(tid, where)
    if agent_pid:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{agent_pid}/task"):
                os.sched_setaffinity(int(tid), second if pin == "same" else set(cpus))


_ALLOWED = frozenset(os.sched_getaffinity(0))
PINS_HELP = "same: forward and recv threads on one CPU, the agent on another; split: forward and recv on two CPUs"


def _wait_state(pid: int, stopped: bool, timeout_s: float = 1.0) -> None:
    """Until ``pid`` is (not) in the stopped state ``T`` (untimed: SIGSTOP / SIGCONT land asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if (state == "T") == stopped:
            return
        time.sleep(0.0005)
    raise RuntimeError(f"agent {pid} did not {'stop' if stopped else 'continue'} within {timeout_s} s")


SETTLES = ("drain-off", "sleep-off", "same", "none")
"""What the forward does (untimed) right before a block. ``drain-off`` (the procedure up to 2026-12-02): an off
block that follows a traced one waits for the agent to export everything (up to one poll interval, asleep);
no other block waits. ``sleep-off``: the same asymmetry without any agent, a plain ``--gap-ms`` sleep before
an off block that follows a traced one (the trigger experiment, for ``aa``). ``same``: every block, both
kinds, gets the same procedure: the drain, then asleep until ``--gap-ms`` (250 ms) in all, so every block
starts after the same idle of the forward (the post-idle regime: on this VM both threads then start on one
core). ``none``: nothing before any block, the forward runs continuously as in serving (the agent drains at its
poll, during whichever blocks run then: its work of a traced block may land in an off block, which lowers the
ratio by up to its share)."""
GAP_DEFAULT_MS = {"sleep-off": 60.0, "same": 250.0}
"""``same``: more than the agent's poll interval (200 ms), so every drain fits in the gap; ``sleep-off``: about
the mean drain wait of ``drain-off``."""


def gap_s(settle: str, gap_ms: float | None = None) -> float:
    """The forward's untimed idle of ``settle`` in seconds (``--gap-ms``, else the procedure's default)."""
    return (gap_ms if gap_ms is not None else GAP_DEFAULT_MS.get(settle, 0.0)) / 1000


def _settle(settle: str, gap: float, kind: str, prev: str, session: Any, mode: str, charge_flush: bool,
            result: "ModeResult") -> str:
    """Run ``settle``'s untimed procedure (idle ``gap`` s) before a ``kind`` block after a ``prev`` block; the
    label of what was done (for ``--diagnose``'s block classes)."""
    if settle == "drain-off":
        if kind == "off" and prev == "on" and not charge_flush:
            if not session.flush(30.0):  # untimed: no agent work of a traced block in an off block
                raise RuntimeError(f"{mode}: the agent did not export in time")
            return "drain"
        return prev
    if settle == "sleep-off":
        if kind == "off" and prev == "on":
            time.sleep(gap)
            return "sleep"
        return prev
    if settle == "none":
        return prev
    if settle == "same":  # the drain (when there is anything to drain), then asleep until ``gap`` in all
        t0 = time.perf_counter()
        if not charge_flush and not session.flush(30.0):
            raise RuntimeError(f"{mode}: the agent did not export in time")
        left = gap - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        else:
            result.late_drains += 1
        return prev
    raise ValueError(settle)



class _NoSession:
    """``aa``: the second thread untraced too (subclasses no session instruments): the A/A control."""

    recorder = exporter = None

    def flush(self, timeout_s: float = 0.0) -> bool:
        return True

    def shutdown(self) -> Any:
        return type("Stats", (), {"dropped": 0, "disabled_reason": None})()


@dataclasses.dataclass
class ModeResult:
    ratios: list[float] = dataclasses.field(default_factory=list)  # per pair, traced / off - 1
    gc_per_step: list[float] = dataclasses.field(default_factory=list)  # per pair, traced - off
    agent_cpu_ns: int = 0
    steps: int = 0
    segments: list[float] = dataclasses.field(default_factory=list)  # each segment's median ratio
    dropped: int = 0  # records the session dropped (a full ring): its blocks did less work than tracing does
    # ``--diagnose``: per block kind ("on", "off"), per ``_Probe.ROWS`` row, the summed ``_COUNTS`` deltas
    diag: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=lambda: {"on": {}, "off": {}})
    diag_tasks: dict[str, int] = dataclasses.field(default_factory=lambda: {"on": 0, "off": 0})
    diag_wall_ns: dict[str, int] = dataclasses.field(default_factory=lambda: {"on": 0, "off": 0})
    # the same per block *class*: the kind and what the forward did right before it ("off<-drain": an off
    # block after the untimed wait for the agent; "on<-off": a traced block right after an off block, ...)
    diag_class: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    diag_class_tasks: dict[str, int] = dataclasses.field(default_factory=dict)
    diag_class_wall_ns: dict[str, int] = dataclasses.field(default_factory=dict)
    idle_ns: dict[str, int] = dataclasses.field(default_factory=dict)  # per kind: untimed idle of the forward before it
    late_drains: int = 0  # ``same``: drains that took longer than the gap (their block idled longer before it)
    agent_other_blocks: int = 0  # blocks at whose end the agent's main thread was not SCHED_IDLE (escalated, or normal)
    blocks: int = 0


def _segment(h: Any, up: Any, mode: str, off: Any, tmp: str, work_us: int, steps: int, pairs: int,
             result: ModeResult, diagnose: bool = False, pin: str | None = None, settle: str = "same",
             gap: float | None = None, floor_stamps: int = FLOOR_STAMPS) -> None:
    """One session of ``mode``; ``pairs`` pairs of blocks, ABBA, against the ``off`` thread."""
    from otel_kvtrace.record import ring

    gap = gap_s(settle) if gap is None else gap

    targets, sub = _traced_copy(up)
    env = dict(_MODE_ENV.get(mode, {}))
    if mode == "thread":  # its exporter thread never exports on its own: all its work is in the charged flush
        env[INTERVAL_ENV] = "3600000"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from otel_kvtrace.instrument import wrappers

    native_gate = wrappers.NATIVE_GATE_RECORD
    if mode in _PY_GATE:
        wrappers.NATIVE_GATE_RECORD = None  # read when the session wraps the gate class
    try:
        session = _start(targets, _SESSION_MODE[mode], tmp, "oe") or _NoSession()
    finally:
        wrappers.NATIVE_GATE_RECORD = native_gate
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    agent_pid = 0
    try:
        from otel_kvtrace.instrument import patches

        _check_untouched(up, off)
        path = patches.probe_paths(targets)[sub["recv_gva"].__qualname__]
        if path != ("wrappers" if mode in ("wrappers", "aa", "aa-burn", "floor") else "compiled"):
            raise RuntimeError(f"{mode}: the traced recv class runs the {path} path")
        record = vars(sub["gate"]).get("record")
        native_record = native_gate is not None and type(record) is native_gate
        if mode in _PY_GATE and (native_record or not patches.is_wrapped(record)) or \
                mode == "agent" and native_gate is not None and not native_record:
            raise RuntimeError(f"{mode}: the gate's record wrapper is not the one this mode measures")
        if mode == "disabled":
            session.recorder.enabled = False  # the state an internal error leaves: installed, not recording
        recv_class = sub["recv_gva"]
        if mode == "aa-burn":
            def handle(self: Any, data: Any, _base: Any = recv_class._handle_request) -> Any:
                _burn(BURN_RECV_US)
                return _base(self, data)

            recv_class = type(recv_class.__name__, (recv_class,), {"_handle_request": handle})
        tape = None
        if mode == "floor":
            recv_class, tape = _floor_class(recv_class, tmp, floor_stamps)
        traced = _env(h, up, off.num_layers, recv_class, sub["gate"])
        traced.floor_tape = tape
        _block(up, traced, 2, work_us)  # warm-up: attach, pools, the ring's first definitions
        _block(up, off, 1, work_us)
        session.flush(30.0)
        agent = getattr(session.exporter, "writer", None)
        agent_pid = int(agent.hdr[ring.H_AGENT_PID]) if agent is not None else 0
        cpu0 = _proc_cpu_ns(agent_pid) if agent_pid else 0
        charge_flush = mode == "thread"  # in-process export: its CPU is the forward's loss
        stop_agent = mode in _STOPPED and agent_pid
        probe = _Probe(agent_pid) if diagnose else None
        tids = {"on": traced.thread.native_id, "off": off.thread.native_id}
        if pin:
            _pin(pin, threading.get_native_id(), (tids["on"], tids["off"]), agent_pid)
        gc.collect()
        gc.freeze()
        gc.disable()
        prev = "start"
        try:
            for p in range(pairs):
                times, objs = {}, {}
                for kind in (("off", "on") if p % 2 == 0 else ("on", "off")):
                    block_env = traced if kind == "on" else off
                    t_idle = time.perf_counter_ns()
                    pre = _settle(settle, gap, kind, prev, session, mode, charge_flush, result)
                    result.idle_ns[kind] = result.idle_ns.get(kind, 0) + time.perf_counter_ns() - t_idle
                    if kind == "on" and stop_agent:
                        os.kill(agent_pid, signal.SIGSTOP)
                        _wait_state(agent_pid, True)
                    other = "off" if kind == "on" else "on"
                    before = probe.snapshot(tids[kind], tids[other]) if probe else None
                    n0 = gc.get_count()[0]
                    step_ns = _block(up, block_env, steps, work_us)
                    if probe:
                        delta: dict[str, list[int]] = {}
                        _add_delta(delta, before, probe.snapshot(tids[kind], tids[other]))
                        cls = f"{kind}<-{pre}"
                        for into in (result.diag.setdefault(kind, {}), result.diag_class.setdefault(cls, {})):
                            for row, values in delta.items():
                                acc = into.setdefault(row, [0] * len(_COUNTS))
                                for i, v in enumerate(values):
                                    acc[i] += v
                        result.diag_tasks[kind] += steps * off.num_layers
                        result.diag_wall_ns[kind] += sum(step_ns)
                        result.diag_class_tasks[cls] = result.diag_class_tasks.get(cls, 0) + steps * off.num_layers
                        result.diag_class_wall_ns[cls] = result.diag_class_wall_ns.get(cls, 0) + sum(step_ns)
                    result.blocks += 1
                    if agent_pid and hasattr(os, "SCHED_IDLE"):
                        with contextlib.suppress(OSError):
                            result.agent_other_blocks += os.sched_getscheduler(agent_pid) != os.SCHED_IDLE
                    if kind == "on" and stop_agent:
                        os.kill(agent_pid, signal.SIGCONT)
                        _wait_state(agent_pid, False)
                    charged = 0
                    if kind == "on" and charge_flush:  # in-process export on this thread: charged to its block
                        c0 = time.thread_time_ns()
                        if not session.flush(30.0):
                            raise RuntimeError(f"{mode}: flush did not finish")
                        charged = time.thread_time_ns() - c0
                    objs[kind] = gc.get_count()[0] - n0
                    times[kind] = sum(step_ns) + charged
                    prev = kind
                result.ratios.append(times["on"] / times["off"] - 1.0)
                result.gc_per_step.append((objs["on"] - objs["off"]) / steps)
                result.steps += steps
                gc.collect(0)
        finally:
            gc.enable()
            gc.unfreeze()
        result.segments.append(statistics.median(result.ratios[-pairs:]))
        session.flush(30.0)
        if agent_pid:
            result.agent_cpu_ns += _proc_cpu_ns(agent_pid) - cpu0
    finally:
        if mode in _STOPPED and agent_pid:  # never leave it stopped: shutdown waits for its drain
            with contextlib.suppress(OSError):
                os.kill(agent_pid, signal.SIGCONT)
        if pin:
            os.sched_setaffinity(0, _ALLOWED)  # the forward (this thread) runs the next segment's start
        stats = session.shutdown()
    result.dropped += stats.dropped
    if stats.disabled_reason:
        raise RuntimeError(f"tracing disabled itself: {stats.disabled_reason}")


def run(work_us: int, modes: tuple[str, ...], segments: int, pairs: int, layers: int,
        block_ms: float, diagnose: bool = False, pin: str | None = None,
        settle: str = "same", gap: float | None = None,
        floor_stamps: int = FLOOR_STAMPS) -> tuple[float, int, dict[str, ModeResult]]:
    """Off step time (ms, median of warm-up steps), steps per block, and the results of each mode."""
    h = _load_harness()
    results = {m: ModeResult() for m in modes}
    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-oe-") as tmp:
        off = _env(h, up, layers, up.binding.classes["recv_gva"], up.gate_class)
        _block(up, off, 2, work_us)
        step_ns = statistics.median(_block(up, off, 5, work_us))
        steps = max(2, round(block_ms * 1e6 / step_ns))
        for _ in range(segments):
            for mode in modes:
                _segment(h, up, mode, off, tmp, work_us, steps, pairs, results[mode], diagnose, pin, settle, gap,
                         floor_stamps)
    return step_ns / 1e6, steps, results


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Median and a distribution-free confidence interval of the median: the order statistics
    ``x(j)``, ``x(n+1-j)`` (1-based) with the largest ``j`` such that P(j <= Binomial(n, 1/2) <= n-j) >= level
    (the full range when even ``j`` = 1 falls short, n < 6)."""
    xs = sorted(values)
    n = len(xs)
    j, cdf = 1, 1 / 2 ** n  # cdf = P(B <= j-1); [x(j), x(n+1-j)] covers the median with 1 - 2 cdf
    while j + 1 <= (n + 1) // 2:
        nxt = cdf + math.comb(n, j) / 2 ** n
        if 1 - 2 * nxt < level:
            break
        cdf, j = nxt, j + 1
    return statistics.median(xs), xs[j - 1], xs[n - j]


def print_diagnosis(load: str, work: int, results: dict[str, ModeResult]) -> None:
    """``--diagnose``: per mode and block kind, each thread's scheduler counts per task (``_COUNTS``)."""
    print(f"  scheduler counts per task ({load}, {work} us/layer): CPU and run-queue wait in us, timeslices, "
          f"voluntary / involuntary switches; 'recv' is the block's own recv thread")
    print(f"  {'mode':10} {'block':10} {'wall us':>8} {'thread':9} {'cpu us':>7} {'rq us':>7} {'slices':>7} "
          f"{'vol cs':>7} {'invol cs':>8} {'sys us':>7} {'migr':>6}")
    for mode, r in results.items():
        for kind in ("off", "on"):
            tasks = r.diag_tasks[kind]
            if not tasks:
                continue
            for row in _Probe.ROWS:
                _diag_row(mode, kind, r.diag_wall_ns[kind], tasks, row, r.diag[kind].get(row))
    print("  by block class (kind <- what the forward did right before it); forward and block's recv thread only; "
          "idle ms: the forward's untimed wait before a block, mean per block of the kind")
    for mode, r in results.items():
        idle = {k: v / 1e6 for k, v in r.idle_ns.items()}
        print(f"  {mode:10} idle before off {idle.get('off', 0) / max(1, len(r.ratios)):.1f} ms, "
              f"before on {idle.get('on', 0) / max(1, len(r.ratios)):.1f} ms")
        for cls in sorted(r.diag_class):
            for row in ("forward", "recv"):
                _diag_row(mode, cls, r.diag_class_wall_ns[cls], r.diag_class_tasks[cls], row, r.diag_class[cls].get(row))


def _diag_row(mode: str, label: str, wall_ns: int, tasks: int, row: str, counts: list[int] | None) -> None:
    cpu, rq, slices, vcs, ics, sys_ns, migr = counts or [0] * len(_COUNTS)
    print(f"  {mode:10} {label:10} {wall_ns / tasks / 1e3:8.1f} {row:9} {cpu / tasks / 1e3:7.2f} "
          f"{rq / tasks / 1e3:7.2f} {slices / tasks:7.3f} {vcs / tasks:7.3f} {ics / tasks:8.3f} "
          f"{sys_ns / tasks / 1e3:7.2f} {migr / tasks:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-us", type=int, nargs="+", default=[1000, 150], help="per-layer work (default 1000 150)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                        help=f"modes, each against off (default {' '.join(DEFAULT_MODES)}; aa: the A/A control, both "
                             "threads untraced; floor: the raw-stamp design's floor, no session)")
    parser.add_argument("--segments", type=int, default=3, help="sessions per mode, in rotation (default 3)")
    parser.add_argument("--pairs", type=int, default=40, help="pairs of blocks per segment (default 40)")
    parser.add_argument("--block-ms", type=float, default=40.0,
                        help="target length of one block, at least 2 steps (default 40 ms)")
    parser.add_argument("--layers", type=int, default=32, help="layers per step (default 32)")
    parser.add_argument("--floor-stamps", type=int, default=FLOOR_STAMPS,
                        help=f"--modes floor: raw stamps per recv task, 0..{FLOOR_TAPE_STAMPS} (default {FLOOR_STAMPS})")
    parser.add_argument("--compete", action="store_true", help="also run under a competing CPU-bound process")
    parser.add_argument("--diagnose", action="store_true",
                        help="per mode and block kind: each thread's CPU, run-queue wait, timeslices and context "
                             "switches per task (forward, recv threads, the serving process's others, the agent)")
    parser.add_argument("--pin", choices=PINS, help="diagnostic thread placement: " + PINS_HELP)
    parser.add_argument("--settle", choices=SETTLES, default="same",
                        help="what the forward does (untimed) before a block (default same: the same drain-and-sleep "
                             "before every block)")
    parser.add_argument("--gap-ms", type=float, default=None,
                        help="--settle same: the forward's idle before every block, drain included (default 250 ms); "
                             "sleep-off: the sleep (default 60 ms)")
    args = parser.parse_args()
    if args.pin and len(_ALLOWED) < 2:
        parser.error("--pin needs two allowed CPUs")
    if min(args.work_us) < 1 or args.segments < 1 or args.pairs < 2 or args.layers < 2 or args.block_ms <= 0:
        parser.error("--work-us, --segments must be >= 1, --pairs and --layers >= 2, --block-ms > 0")
    if not 0 <= args.floor_stamps <= FLOOR_TAPE_STAMPS:
        parser.error(f"--floor-stamps must be within 0..{FLOOR_TAPE_STAMPS} (what one C tape holds between copies)")
    modes = tuple(dict.fromkeys(args.modes))
    gap = gap_s(args.settle, args.gap_ms)
    loads = ["idle", "compete"] if args.compete else ["idle"]
    headline = None
    late = 0  # ``same``: drains longer than the gap, over every run
    print(f"settle {args.settle} (gap {gap * 1000:.0f} ms); load average {os.getloadavg()[0]:.2f} at start; ratios per pair of adjacent blocks (ABBA), "
          f"median [95% CI of the median] over n pairs", flush=True)
    print(f"{'load':8} {'work/layer':>10} {'step off ms':>11} {'steps/blk':>9} {'mode':9} {'slowdown %':>10} "
          f"{'95% CI':>15} {'n':>4} {'segments':>15} {'gc/step':>8} {'agent cpu/step us':>17}")
    for load in loads:
        hog = None
        if load == "compete":
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for work in args.work_us:
                step_ms, steps, res = run(work, modes, args.segments, args.pairs, args.layers, args.block_ms,
                                          args.diagnose, args.pin, args.settle, gap, args.floor_stamps)
                late += sum(r.late_drains for r in res.values())
                for mode in modes:
                    r = res[mode]
                    med, lo, hi = (100 * v for v in median_ci(r.ratios))
                    agent_cpu = f"{r.agent_cpu_ns / r.steps / 1e3:.0f}" if r.agent_cpu_ns else "-"
                    label = f"floor{args.floor_stamps}" if mode == "floor" else mode  # the stamps are in the output
                    print(f"{load:8} {work:>8}us {step_ms:11.2f} {steps:9d} {label:9} {med:10.2f} "
                          f"{lo:7.2f}..{hi:<6.2f} {len(r.ratios):4d} "
                          f"{100 * min(r.segments):7.2f}..{100 * max(r.segments):<6.2f} "
                          f"{statistics.median(r.gc_per_step):8.1f} "
                          f"{agent_cpu:>17}" + (f"  ({r.dropped} records DROPPED)" if r.dropped else "")
                          + (f"  agent not SCHED_IDLE at the end of {r.agent_other_blocks}/{r.blocks} blocks"
                             if r.agent_other_blocks else ""), flush=True)
                    if load == "idle" and work == min(args.work_us) and mode == "agent":
                        headline = med
                if args.diagnose:
                    print_diagnosis(load, work, res)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    if late:
        print(f"{late} drains took longer than --gap-ms {gap * 1000:.0f}: those blocks idled longer before")
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    if headline is not None:
        print(f"forward_slowdown_pct={headline:.2f}")


if __name__ == "__main__":
    main()
