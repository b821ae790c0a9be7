"""Where the recv thread's added CPU goes: per-component ns per task, measured side by side in one run.

Run through ``bench/upstream_overhead.py --breakdown`` (or directly). The REAL vLLM-Ascend recv thread
(0.23.0.post1 sdist, or ``KVTRACE_UPSTREAM_SRC``) is attached by ``start_tracing(exporter="agent")``;
each component is then timed in a loop of ``--loops`` calls on the calling thread (GC off), in
alternating repeats, against its untraced counterpart where it has one:

- primitives: a pass-through wrapper frame, a ``perf_counter_ns`` call, the thread-ident lookup,
  ``stages.extend``, ``dep_exact``/``dep_bounds``;
- each wrapper / proxy on its recording path (the traced call minus the original call, with a task
  current on this thread);
- the ship of one finished task: the NPU resolver, the transfer-task summary, ``RingWriter.write_task``
  (and inside it the ``pack_into`` and the ``crc32`` alone), on a record captured from a real task;
- ``total``: the added CPU per ``_handle_request`` (traced minus untraced, driven synchronously), so
  the parts can be compared with the whole; ``rest`` = total minus the listed parts (the
  ``_handle_request`` wrapper itself, release/submit, pool recycling).

The per-wrapper rows exist on the wrapper path only (``OTEL_KVTRACE_PROBES=wrappers``), which this
breakdown installs for them; the compiled probes (the default, ``instrument/rewrite.py``) have no
interception point to take out: their stamps are statements of ``_handle_request``. Their total is
printed next to the wrappers' (same repeats, alternating), and the ship rows apply to both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from threading import get_ident
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _callgrind  # noqa: E402
from upstream_overhead import _cpu_per_call, _load_harness, _ready_task  # noqa: E402


def _loop_ns(fn: Callable[[], Any], loops: int) -> float:
    """CPU ns per call of ``fn`` (loop overhead included; compare two loops, never one alone)."""
    t0 = time.thread_time_ns()
    for _ in range(loops):
        fn()
    return (time.thread_time_ns() - t0) / loops


def _pair(traced: Callable[[], Any], plain: Callable[[], Any] | None, loops: int) -> float:
    return _loop_ns(traced, loops) - (_loop_ns(plain, loops) if plain is not None else _loop_ns(_nothing, loops))


def _nothing() -> None:
    return None


def _capture_record(session: Any) -> dict[str, Any]:
    """A copy of the next record the recorder ships, taken before anything of the ship touched it (the
    ring's ``write_task`` in this tree, the NPU resolver before it; ``restore`` puts both back)."""
    recorder = session.recorder
    captured: dict[str, Any] = {}
    original = recorder.npu_resolver
    writer = recorder.ring
    write = writer.write_task

    def capture(record: Any) -> None:
        if "rec" not in captured:
            tasks = record.transfer_tasks
            captured["rec"] = dataclasses.replace(
                record, stages=list(record.stages), deps=list(record.deps), npu_marks=list(record.npu_marks),
                holds=[], transfer_tasks=list(tasks) if isinstance(tasks, list) else tasks)

    def resolver(record: Any) -> None:
        capture(record)
        original(record)

    def write_task(record: Any, *args: Any) -> Any:
        capture(record)
        return write(record, *args)

    recorder.npu_resolver = resolver
    writer.write_task = write_task

    def restore() -> None:
        recorder.npu_resolver = original
        del writer.write_task

    captured["restore"] = restore
    return captured


def components(up: Any, h: Any, env: Any, session: Any, loops: int, layers: int, blocks: int) -> dict[str, Callable]:
    """name -> zero-argument callable returning the added ns of one call (one measurement)."""
    from otel_kvtrace.instrument.attach import STATE_ATTR
    from otel_kvtrace.record.model import TaskRecord
    from otel_kvtrace.record.ring import H_HEAD

    thread = env.thread
    st = thread.__dict__[STATE_ATTR]
    rt_state = session.runtime.state_by_thread
    captured = _capture_record(session)
    request = up.request("r-bench", blocks)
    task, layer = _ready_task(up, env, request, 1, layers)
    thread.add_request(task)
    thread._handle_request(thread.request_queue.get())
    env.load_done[layer].clear()
    rec_shipped = captured["rec"]
    captured["restore"]()

    scratch = TaskRecord()
    scratch.t_enqueue = time.perf_counter_ns()
    stages = scratch.stages

    def scaffold(fn: Callable[[], Any], current: Any) -> Callable[[], Any]:
        """``fn`` with ``current`` as the thread's task (``None``: the untraced counterpart), then a clean record."""
        def run() -> Any:
            st.current = current
            try:
                return fn()
            finally:
                st.current = None
                stages.clear()
                scratch.npu_marks.clear()
        return run

    def with_current(fn: Callable[[], Any]) -> Callable[[], Any]:
        return scaffold(fn, scratch)

    def plain_of(fn: Callable[[], Any]) -> Callable[[], Any]:
        return scaffold(fn, None)

    def orig_method(name: str) -> Callable:
        return getattr(type(thread), name).__kvtrace_wrapped__

    # primitives
    def target(self: Any, x: Any) -> Any:
        return x

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return target(self, *args, **kwargs)

    clock = time.perf_counter_ns
    out: dict[str, Callable] = {
        "wrapper frame (*args, **kwargs pass-through)": lambda: _pair(lambda: wrapper(None, 1),
                                                                       lambda: target(None, 1), loops),
        "clock call (perf_counter_ns)": lambda: _pair(clock, None, loops),
        "thread lookup (state_by_thread.get(get_ident()))": lambda: _pair(lambda: rt_state.get(get_ident()), None, loops),
        "stages.extend((s, t0, t1))": lambda: _pair(lambda: (stages.extend((1, 2, 3)), stages.clear()),
                                                     stages.clear, loops),
        "rec.dep_exact / dep_bounds (one call)": lambda: _pair(lambda: scratch.dep_bounds(2, 1, 2), None, loops),
    }
    # wrappers / proxies on their recording path (traced call minus the original)
    save_ev = thread.layer_save_finished_events[0]
    save_ev._inner.set()
    out["TracedSaveEvent.wait (save wait)"] = lambda: _pair(
        with_current(lambda: save_ev.wait(timeout=10)), plain_of(lambda: save_ev._inner.wait(10)), loops)
    gate = up.gate_class()
    gate.record()
    gate_wait = type(gate).wait.__kvtrace_wrapped__
    out["gate wait wrapper (+ _gate_wait_done)"] = lambda: _pair(
        with_current(lambda: gate.wait(timeout=10)), plain_of(lambda: gate_wait(gate, timeout=10)), loops)
    builder = thread.group_builders[0]
    shipped = rec_shipped.transfer_tasks
    shared = (shipped[0] if isinstance(shipped, list) else shipped).shared_block_data
    out["TracedBuilder.build_addrs"] = lambda: _pair(
        with_current(lambda: builder.build_addrs(shared, layer)), plain_of(lambda: builder._inner.build_addrs(shared, layer)),
        loops)
    stagger = orig_method("_stagger_h2d_submit")
    out["_stagger_h2d_submit wrapper"] = lambda: _pair(
        with_current(lambda: thread._stagger_h2d_submit(layer)), plain_of(lambda: stagger(thread, layer)), loops)
    meta = builder._inner.build_addrs(shared, layer)
    copy_args = (meta.gvas_array, meta.addr_array, meta.size_array, 1, thread.max_transfer_blocks,
                 thread.max_transfer_bytes)
    batch_copy = orig_method("_batch_copy_with_limits")
    out["_batch_copy_with_limits wrapper (+ total_bytes)"] = lambda: _pair(
        with_current(lambda: thread._batch_copy_with_limits(*copy_args)),
        plain_of(lambda: batch_copy(thread, *copy_args)), loops)
    load_ev = thread.layer_load_finished_events[layer]
    out["TracedLoadEvent.set (completion)"] = lambda: _pair(
        with_current(lambda: (load_ev.set(), load_ev._inner.clear())),
        plain_of(lambda: (load_ev._inner.set(), load_ev._inner.clear())), loops)

    # the ship of one task, on the captured record, into a private ring nobody drains
    out.update(_ship_components(session.recorder, rec_shipped, loops))
    del H_HEAD
    return out


def _ship_components(recorder: Any, rec: Any, loops: int) -> dict[str, Callable]:
    """The ship rows, for this tree's ring format or the one before it (``--against`` runs both):
    the whole ``Recorder._ship`` of the captured record, ``write_task`` and its parts."""
    import zlib

    from otel_kvtrace.record import ring as R

    _fd, mem = R.create_memfd(64 + 256)
    writer = R.RingWriter(mem)
    marks = list(rec.npu_marks)
    stages = list(rec.stages)
    old_format = hasattr(recorder, "_summaries")  # fabdfbd: resolver + SummaryCache + write_task(summary)
    out: dict[str, Callable] = {}
    ship_recorder = type(recorder)(capacity=16)
    ship_recorder.npu_resolver = recorder.npu_resolver
    ship_recorder.attach_ring(writer)

    def empty() -> None:
        writer.hdr[R.H_READ] = writer._head  # keep the private ring empty

    def restore() -> None:
        rec.npu_marks[:] = marks
        empty()

    def ship() -> None:  # awaiting: the record is not recycled, so it can be shipped again
        restore()
        ship_recorder._ship(True, rec)

    out["ship: Recorder._ship, whole (awaiting form)"] = lambda: _pair(ship, restore, loops)
    if old_format:
        resolver = recorder.npu_resolver
        summarize = recorder._summaries.get
        summary = summarize(rec.transfer_tasks)
        out["  npu resolver (Runtime.resolve)"] = lambda: _pair(lambda: (restore(), resolver(rec)), restore, loops)
        out["  summarize_transfer_tasks (SummaryCache.get)"] = lambda: _pair(lambda: summarize(rec.transfer_tasks),
                                                                             None, loops)
        out["  RingWriter.write_task"] = lambda: _pair(lambda: (restore(), writer.write_task(rec, False, summary)),
                                                       restore, loops)
        writer.write_task(rec, False, summary)
        layout = R._TASK_LAYOUTS.get((len(stages), len(summary.group_ids), len(summary.request_ids)))
    else:
        from otel_kvtrace.instrument.stream_order import tighten_bounds

        out["  npu bounds (tighten_bounds, inside write_task)"] = lambda: _pair(
            lambda: (restore(), tighten_bounds(rec)), restore, loops)
        out["  RingWriter.write_task (bounds, summary index, pack, crc)"] = lambda: _pair(
            lambda: (restore(), writer.write_task(rec, False)), restore, loops)
        writer.write_task(rec, False)
        layout = R.TASK_LAYOUTS[len(stages)]
    body = memoryview(mem)[200:1000]
    size = layout.size if layout is not None else 400
    out["    crc32 of one task body"] = lambda: _pair(lambda: zlib.crc32(body[:size], 7), None, loops)
    if layout is not None:
        values = layout.unpack_from(mem, R.HEADER_BYTES + R.SLOT_HEAD.size)
        out["    struct pack_into of one task"] = lambda: _pair(
            lambda: layout.pack_into(mem, R.HEADER_BYTES + R.SLOT_HEAD.size, *values), None, loops)
    return out


@contextlib.contextmanager
def _without(env: Any, session: Any, point: str) -> Iterator[None]:
    """One interception point (or one ship step) put back to upstream's own / made a no-op for the
    duration: the drop in the recv thread's CPU is that point's cost *in context* (cold caches and
    all), which the isolated loops above cannot show."""
    thread = env.thread
    recorder = session.recorder
    undo: list[Callable[[], None]] = []

    def unproxy(lst: list[Any]) -> None:
        saved = list(lst)
        lst[:] = [getattr(x, "_inner", x) for x in lst]
        undo.append(lambda: lst.__setitem__(slice(None), saved))

    def shadow(name: str) -> None:
        original = getattr(type(thread), name).__kvtrace_wrapped__
        had = thread.__dict__.get(name)
        setattr(thread, name, types.MethodType(original, thread))
        undo.append(lambda: setattr(thread, name, had) if had is not None else thread.__dict__.pop(name, None))

    def set_attr(obj: Any, name: str, value: Any) -> None:
        had = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)
        undo.append(lambda: obj.__dict__.pop(name, None) if had is _MISSING else setattr(obj, name, had))

    if point == "build_addrs proxy":
        saved = thread.group_builders
        thread.group_builders = [b._inner for b in saved]
        undo.append(lambda: setattr(thread, "group_builders", saved))
    elif point == "save event proxy":
        unproxy(thread.layer_save_finished_events)
    elif point == "load event proxy":
        unproxy(thread.layer_load_finished_events)
    elif point == "gate wait wrapper":
        gate_cls = env.gate_class
        wrapped = gate_cls.__dict__["wait"]
        gate_cls.wait = wrapped.__kvtrace_wrapped__
        undo.append(lambda: setattr(gate_cls, "wait", wrapped))
    elif point == "batch_copy wrapper":
        shadow("_batch_copy_with_limits")
    elif point == "stagger wrapper (where wrapped)":
        if "_stagger_h2d_submit" not in thread.__dict__:  # else already upstream's own (a no-op stagger)
            shadow("_stagger_h2d_submit")
    elif point == "ship: whole (write_task a no-op)":
        if hasattr(recorder, "_summaries"):  # fabdfbd: resolver, summary and write are three steps
            set_attr(recorder, "npu_resolver", None)
            fixed = recorder._summaries.get(env.sample_tasks)
            set_attr(recorder, "_summaries", type("Fixed", (), {"get": lambda self, t, k=0: fixed})())
        set_attr(recorder.ring, "write_task", lambda rec, awaiting, summary=None: True)
    elif point == "agent paused (SIGSTOP; ring not drained)":
        import os
        import signal

        from otel_kvtrace.record.ring import H_AGENT_PID

        pid = int(recorder.ring.hdr[H_AGENT_PID])
        os.kill(pid, signal.SIGSTOP)
        undo.append(lambda: os.kill(pid, signal.SIGCONT))
    elif point == "ship: npu bounds (marks dropped before write_task)":
        write = recorder.ring.write_task
        set_attr(recorder.ring, "write_task", lambda rec, awaiting, summary=None: (rec.npu_marks.clear(),
                                                                                     write(rec, awaiting))[1])
    elif point == "ship: write_task":
        set_attr(recorder.ring, "write_task", lambda rec, awaiting, summary=None: True)
    elif point == "ship: summary":
        cache = getattr(recorder, "_summaries", None)  # the same summary every time, computed once here
        if cache is not None:
            fixed = cache.get(env.sample_tasks)
            set_attr(recorder, "_summaries", type("Fixed", (), {"get": lambda self, t, k=0: fixed})())
        else:
            fixed = recorder._summarize(env.sample_tasks)
            set_attr(recorder, "_summarize", lambda tasks: fixed)
    elif point == "ship: npu resolver":
        set_attr(recorder, "npu_resolver", None)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


_MISSING = object()
ALTERNATIONS = 7  # with / without pairs per point per repeat (the machine is shared: pairs, then medians)
INTERCEPTION = ("build_addrs proxy", "save event proxy", "gate wait wrapper", "stagger wrapper (where wrapped)",
                "batch_copy wrapper", "load event proxy")
SHIP_BEFORE = ("ship: npu resolver", "ship: summary", "ship: write_task")  # fabdfbd: three steps
SHIP_NOW = ("ship: npu bounds (marks dropped before write_task)",)  # inside the one write_task
SHIP_POINTS = ("ship: whole (write_task a no-op)", "agent paused (SIGSTOP; ring not drained)")
"""Measured too, not parts of the total: the whole ship (the three ship rows above together, in this tree one step) and
the agent process's effect on the recv thread's CPU while it drains (its own work runs in its process)."""


def run(loops: int, repeats: int, layers: int, blocks: int, tasks: int
        ) -> tuple[dict[str, list[float]], list[float], dict[str, list[float]]]:
    from otel_kvtrace.api import start_tracing

    import os

    h = _load_harness()
    results: dict[str, list[float]] = {}
    totals: list[float] = []
    compiled_totals = COMPILED_TOTALS
    in_context: dict[str, list[float]] = {}
    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-bd-") as tmp:
        targets = up.binding.to_targets()
        for _ in range(repeats):
            env0 = up.gva_thread(layers, h.FakeBackend(), start=False)
            _cpu_per_call(up, env0, 50, layers, blocks)
            base = _cpu_per_call(up, env0, tasks, layers, blocks)[1]
            session = start_tracing(targets, exporter="agent", out_dir=tmp, run_id="bench-bd")  # compiled
            envc = up.gva_thread(layers, h.FakeBackend(), start=False)
            _cpu_per_call(up, envc, 50, layers, blocks)
            compiled_totals.append(_cpu_per_call(up, envc, tasks, layers, blocks)[1] - base)
            session.shutdown()
            saved = os.environ.get("OTEL_KVTRACE_PROBES")
            os.environ["OTEL_KVTRACE_PROBES"] = "wrappers"
            try:
                session = start_tracing(targets, exporter="agent", out_dir=tmp, run_id="bench-bd")
            finally:  # the user's own setting back, not dropped
                if saved is None:
                    os.environ.pop("OTEL_KVTRACE_PROBES", None)
                else:
                    os.environ["OTEL_KVTRACE_PROBES"] = saved
            env = up.gva_thread(layers, h.FakeBackend(), start=False)
            env.gate_class = up.gate_class
            env.sample_tasks = list(_ready_task(up, env, up.request("r-bench", blocks), 1, layers)[0].transfer_tasks)
            _cpu_per_call(up, env, 50, layers, blocks)
            full = _cpu_per_call(up, env, tasks, layers, blocks)[1]
            totals.append(full - base)
            ship = SHIP_BEFORE if hasattr(session.recorder, "_summaries") else SHIP_NOW
            for point in (*INTERCEPTION, SHIP_POINTS[0], *ship, SHIP_POINTS[1]):  # each against the full set, alternating, the ring drained before each
                for _ in range(ALTERNATIONS):
                    session.flush(30.0)  # a full ring would drop (cheaper) instead of writing
                    full = _cpu_per_call(up, env, tasks // 8, layers, blocks)[1]
                    session.flush(30.0)
                    with _without(env, session, point):
                        _cpu_per_call(up, env, 10, layers, blocks)
                        without = _cpu_per_call(up, env, tasks // 8, layers, blocks)[1]
                    in_context.setdefault(point, []).append(full - without)
            parts = components(up, h, env, session, loops, layers, blocks)
            gc.collect()
            gc.disable()
            try:
                for name, measure in parts.items():
                    results.setdefault(name, []).append(measure())
            finally:
                gc.enable()
            session.shutdown()
    return results, totals, in_context


def report(results: dict[str, list[float]], totals: list[float], per_task: dict[str, int],
           in_context: dict[str, list[float]]) -> None:
    print("\nisolated: recv-thread CPU per call in a tight loop (ns, median over repeats; traced minus original)")
    print(f"{'component':52} {'ns/call':>8} {'calls/task':>10} {'ns/task':>8}")
    listed = 0.0
    for name, values in results.items():
        ns = statistics.median(values)
        n = per_task.get(name, 0)
        if n:
            listed += ns * n
        print(f"{name:52} {ns:8.0f} {n if n else '':>10} {f'{ns * n:.0f}' if n else '':>8}")
    total = statistics.median(totals)
    print(f"{'sum of the per-task rows':52} {'':8} {'':>10} {listed:8.0f}")
    print(f"\nin context: drop in CPU per _handle_request when one point is upstream's own again / one ship")
    print("step a no-op (ns per task, median over with/without pairs)")
    in_sum = 0.0
    for name, values in in_context.items():
        ns = statistics.median(values)
        part_of_ship = name in SHIP_BEFORE or name in SHIP_NOW
        if name in INTERCEPTION or name == SHIP_POINTS[0]:
            in_sum += ns
        quart = statistics.quantiles(values, n=4) if len(values) > 1 else [ns, ns, ns]
        label = f"  {name}" if part_of_ship else name
        print(f"{label:52} {ns:8.0f}   (quartiles {quart[0]:.0f}..{quart[2]:.0f} over {len(values)} pairs)")
    print(f"{'sum: interception points + whole ship':52} {in_sum:8.0f}")
    print(f"{'rest: _handle_request wrapper, release, _ship, reset':52} {total - in_sum:8.0f}")
    print(f"{'total added per _handle_request, wrappers':52} {total:8.0f}")
    if COMPILED_TOTALS:
        print(f"{'same, compiled probes (the default)':52} {statistics.median(COMPILED_TOTALS):8.0f}")
    print("(indented ship rows are parts of the whole ship; 'agent paused' is the agent process's effect on")
    print(" this thread's CPU while it drains, not a part of the total's interception)")


COMPILED_TOTALS: list[float] = []
"""Added CPU per ``_handle_request`` with the compiled probes, per repeat (next to the wrappers' total)."""


# How often each measured component runs per recv task of this bench (one transfer task, gate, save
# wait); primitives are inside the wrappers and not added again.
PER_TASK = {
    "TracedSaveEvent.wait (save wait)": 1,
    "gate wait wrapper (+ _gate_wait_done)": 1,
    "TracedBuilder.build_addrs": 1,
    "_stagger_h2d_submit wrapper": 1,
    "_batch_copy_with_limits wrapper (+ total_bytes)": 1,
    "TracedLoadEvent.set (completion)": 1,
    "ship: Recorder._ship, whole (awaiting form)": 1,
}


def _run_tree(tree: Path, argv: list[str]) -> dict[str, Any]:
    """One repeat of this bench in a fresh process with ``tree``'s ``otel_kvtrace`` first on the path."""
    import json
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import recv_breakdown; recv_breakdown.main({[*argv, '--json']!r})")
    # cwd = the tree: the agent (``python -m``) imports the package from its working directory first
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(against: Path, rounds: int, argv: list[str]) -> None:
    """Both trees alternating (the order swapped every round), one repeat each per round; every row's median
    side by side. (The two task packers of one tree: ``bench/ship_ab.py --packers``.)"""
    this = Path(__file__).resolve().parents[1]
    sides = [("other", against.resolve()), ("this", this)]
    runs: dict[str, list[dict[str, Any]]] = {"other": [], "this": []}
    for i in range(rounds):
        for name, tree in sides if i % 2 == 0 else sides[::-1]:
            runs[name].append(_run_tree(tree, argv))
        print(f"  round {i + 1}/{rounds} done", file=sys.stderr)

    def med(name: str, section: str, row: str) -> str:
        values = [v for r in runs[name] for v in r[section].get(row, [])]
        return f"{statistics.median(values):9.0f}" if values else f"{'-':>9}"

    print(f"{'ns per task (median over rounds x pairs)':56} {'other':>9} {'this':>9}")
    for section, title in (("results", "isolated"), ("in_context", "in context")):
        print(f"-- {title}")
        rows = dict.fromkeys(k for r in runs["other"] + runs["this"] for k in r[section])
        for row in rows:
            print(f"{row:56} {med('other', section, row)} {med('this', section, row)}")
    print(f"{'total added per _handle_request (traced - untraced)':56} {med('other', 'totals', '')} "
          f"{med('this', 'totals', '')}")


def ship_loop(n: int, what: str) -> None:
    """``n`` ships (``what="ship"``) or only their set-up (``"base"``) of one recv task shaped like the
    real ones (export_records' stages and dependencies, one transfer task with shared data, save and gate
    stream marks over a 16-event step log) into a private ring: the body ``--instructions`` counts."""
    import os

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "export"))
    from export_records import FakeLayerTransferTask, FakeShared, fill_record

    from otel_kvtrace.instrument.runtime import Runtime
    from otel_kvtrace.instrument.stream_order import StreamLog, StreamPosition
    from otel_kvtrace.record import ring as R
    from otel_kvtrace.record.model import Dep, TaskRecord
    from otel_kvtrace.record.recorder import Recorder

    gc.disable()
    fd, mem = R.create_memfd(R.DEFAULT_SLOTS)
    os.close(fd)
    writer = R.RingWriter(mem)
    rec = fill_record(TaskRecord(), consumer_wait=False)
    shared = FakeShared(["reqA", "reqB"], list(range(16)), [True, True], [])
    rec.transfer_tasks = FakeLayerTransferTask(group_id=0, layer_idx_in_group=5, shared_block_data=shared)
    log = StreamLog()
    for _ in range(16):
        log.append()
    for q in range(11):
        log.observe(q, 1000 + q)
    marks = [(int(Dep.SAVE_NPU), StreamPosition(log, 9)), (int(Dep.GATE_NPU), StreamPosition(log, 10))]
    recorder = Recorder(capacity=16)
    recorder.npu_resolver = Runtime(recorder=recorder, run_id="ir").resolve
    recorder.attach_ring(writer)

    def restore() -> None:
        rec.npu_marks[:] = marks
        writer.hdr[R.H_READ] = writer._head

    def ship() -> None:
        restore()
        # awaiting form: not recycled, so the same record ships again; through ``submit_first``, the entry
        # the recv thread calls (a partial over ``_ship``, or the native shipper of this tree)
        recorder.submit_first(rec)

    fn = ship if what == "ship" else restore
    for _ in range(50 + n):
        fn()


def ship_instructions(tree: Path, pack: str | None = None) -> float:
    """Instructions per ship of ``ship_loop`` in ``tree`` under callgrind (``bench/_callgrind.py``,
    repeatable on a loaded machine): (ships of 3000 - ships of 1000) minus the same for the set-up alone,
    over 2000. ``pack``: ``OTEL_KVTRACE_RING_PACK`` (None: the environment's)."""
    env = None if pack is None else {"OTEL_KVTRACE_RING_PACK": pack}

    def ir(what: str, n: int) -> int:
        code = (f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import recv_breakdown; recv_breakdown.ship_loop({n}, {what!r})")
        return _callgrind.total(code, tree, env)

    return ((ir("ship", 3000) - ir("ship", 1000)) - (ir("base", 3000) - ir("base", 1000))) / 2000


def packer_in_use(tree: Path, pack: str | None = None) -> str:
    """The task packer a writer of ``tree`` uses (``python`` for a tree older than the native packer)."""
    import os
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(tree)!r}); from otel_kvtrace.record import ring; "
            "print(ring.pack_mode()[0] if hasattr(ring, 'pack_mode') else 'python')")
    env = {**os.environ} if pack is None else {**os.environ, "OTEL_KVTRACE_RING_PACK": pack}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree,
                          env=env).stdout.strip()


def instructions(against: Path | None) -> None:
    """Instructions per ship (``ship_instructions``) per tree, each with its default task packer (printed;
    python against native of one tree: ``bench/ship_ab.py --packers --instructions``)."""
    trees = [("this", Path(__file__).resolve().parents[1])]
    if against is not None:
        trees.insert(0, ("other", against.resolve()))
    for name, tree in trees:
        per = ship_instructions(tree)
        print(f"{name:6} {str(tree):32} packer {packer_in_use(tree):6} "
              f"instructions per ship (Recorder.submit_first): {per:8.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", type=int, default=5000, help="calls per measurement (default 5000)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats (default 5)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=2000, help="tasks for the total (default 2000)")
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout (git archive REV | tar -x -C DIR): both trees alternate, one repeat "
                             "per tree per round, --repeats rounds, printed side by side")
    parser.add_argument("--instructions", action="store_true",
                        help="only the ship's instruction count under valgrind's callgrind (with --against: both trees)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.instructions:
        instructions(args.against)
        return
    if args.against is not None:
        if not (args.against / "otel_kvtrace").is_dir():
            parser.error(f"{args.against}: no otel_kvtrace package there")
        compare(args.against, args.repeats, ["--loops", str(args.loops), "--repeats", "1", "--layers",
                                             str(args.layers), "--blocks", str(args.blocks), "--tasks", str(args.tasks)])
        return
    results, totals, in_context = run(args.loops, args.repeats, args.layers, args.blocks, args.tasks)
    if args.json:
        import json

        print(json.dumps({"results": results, "totals": {"": totals}, "in_context": in_context}))
        return
    report(results, totals, PER_TASK, in_context)


if __name__ == "__main__":
    main()
