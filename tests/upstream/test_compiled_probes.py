"""Compiled probes (``instrument/rewrite.py``) on the REAL vLLM-Ascend GVA recv thread.

The recompiled ``_handle_request`` must be what runs (not a silent fallback), must fall back to the
wrappers with one log line when the source is not the shape it knows, must raise exactly what upstream
raises (type, message, traceback lines), and must record the same ``TaskRecord`` content as the wrapper
path for the same driven workload (times excepted).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.instrument import attach, patches, rewrite, wrappers
from otel_kvtrace.record.model import NO_TIME, NUM_DEPS

from .harness import FakeBackend, Upstream

pytestmark = pytest.mark.upstream

N_LAYERS = 4


def _targets_with(upstream: Upstream, recv_gva: type) -> Any:
    targets = upstream.binding.to_targets()
    old = upstream.binding.classes["recv_gva"]
    targets.recv_thread_classes = tuple(recv_gva if c is old else c for c in targets.recv_thread_classes)
    return targets


def test_the_compiled_path_is_the_one_in_use(upstream: Upstream) -> None:
    targets = upstream.binding.to_targets()
    session = start_tracing(targets, exporter=None, run_id="probes")
    try:
        paths = patches.probe_paths(targets)
        assert paths[upstream.binding.classes["recv_gva"].__qualname__] == "compiled", paths
        assert paths[upstream.binding.classes["recv_gva"].__qualname__ + ".add_request"] == "compiled", paths
        compiled = upstream.binding.classes["recv_gva"].__dict__["_handle_request"]
        # compiled under upstream's future flags: the annotations stay unevaluated strings, as upstream's
        assert compiled.__annotations__ == compiled.__kvtrace_wrapped__.__annotations__
        env = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False)
        env.thread.add_request(upstream.gva_task(0, [upstream.request("r1", 3)]))
        item = env.thread.request_queue.get()
        frames: list[str] = []
        sys.setprofile(lambda frame, event, arg: frames.append(frame.f_code.co_filename) if event == "call" else None)
        try:
            env.thread._handle_request(item)
        finally:
            sys.setprofile(None)
        ours = [f for f in frames if "otel_kvtrace" in f]
        # no wrapper or proxy frame on the recv thread: only the record's hand-off (and the bytes sum)
        assert not any(f.endswith(("wrappers.py", "proxies.py", "attach.py")) for f in ours[:-2]), ours
        assert frames[0] == inspect.getsourcefile(upstream.binding.classes["recv_gva"]), frames[0]
        (rec,) = session.recorder.drain(10)
        assert rec.stages[0::3] and rec.t_backend_return != NO_TIME and rec.nbytes > 0
        # the enqueue too: upstream's add_request recompiled with the record set-up inline, no frame of ours
        cls = upstream.binding.classes["recv_gva"]
        assert rewrite.is_compiled(cls.__dict__["add_request"])
        frames.clear()
        session.recorder.recycle([rec])
        task = upstream.gva_task(1, [upstream.request("r2", 3)])
        sys.setprofile(lambda frame, event, arg: frames.append(frame.f_code.co_filename) if event == "call" else None)
        try:
            env.thread.add_request(task)
        finally:
            sys.setprofile(None)
        assert frames and frames[0] == inspect.getsourcefile(cls), frames
        assert not [f for f in frames if "otel_kvtrace" in f], frames  # the pool had a record: no constructor
        assert env.thread.request_queue.get()._kvtrace.layer_id == 1
    finally:
        session.shutdown()
    assert patches.probe_paths(targets)[upstream.binding.classes["recv_gva"].__qualname__] == "wrappers"
    assert patches.probe_paths(targets)[upstream.binding.classes["recv_gva"].__qualname__ + ".add_request"] == \
        "not installed"
    assert not rewrite.is_compiled(upstream.binding.classes["recv_gva"].__dict__["add_request"])


@pytest.mark.parametrize("path", ["compiled", "wrappers"])
def test_a_raising_enqueue_raises_the_same_with_and_without_tracing(
        upstream: Upstream, monkeypatch: Any, path: str) -> None:
    """Upstream's ``request_queue.put`` raising inside the compiled ``add_request`` (and the wrapper): the same
    exception object reaches the caller, tracing stays on, and nothing of the refused task stays
    (``wrappers.enqueue_undo``): no ``_kvtrace`` on it, no ``step_records`` entry, its record back in the pool,
    and the next task's seq, queue depth and in-flight count as if it never came. (Until review 5 this test
    pinned the refused task taking seq 0 and its record leaking.)"""
    if path == "wrappers":
        monkeypatch.setenv("OTEL_KVTRACE_PROBES", "wrappers")

    class Refusing:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def put(self, item: Any) -> None:
            raise OverflowError("queue refused")

    def enqueue(env: Any, task: Any) -> BaseException:
        env.thread.request_queue = Refusing(env.thread.request_queue)
        with pytest.raises(OverflowError) as info:
            env.thread.add_request(task)
        env.thread.request_queue = env.thread.request_queue.inner
        return info.value

    untraced = enqueue(upstream.gva_thread(N_LAYERS, FakeBackend(), start=False),
                       upstream.gva_task(0, [upstream.request("r1", 3)]))
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="refuse")
    try:
        cls = upstream.binding.classes["recv_gva"]
        assert rewrite.is_compiled(cls.__dict__["add_request"]) is (path == "compiled")
        assert patches.probe_paths(upstream.binding.to_targets())[cls.__qualname__ + ".add_request"] == (
            "compiled" if path == "compiled" else "wrapper: OTEL_KVTRACE_PROBES=wrappers")
        env = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False)
        env.thread.add_request(upstream.gva_task(0, [upstream.request("r0", 3)]))
        env.thread._handle_request(env.thread.request_queue.get())
        (first,) = session.recorder.drain(10)
        assert first.seq == 0
        session.recorder.recycle([first])
        st = env.thread.__dict__[attach.STATE_ATTR]
        st.consumer_tracking = True  # as attach_worker sets it: the forward's consumer wait is tracked
        pool = len(session.recorder._pool)
        refused_task = upstream.gva_task(1, [upstream.request("r1", 3)])
        traced = enqueue(env, refused_task)
        assert (type(traced), str(traced)) == (type(untraced), str(untraced))
        assert traced.__traceback__.tb_next is not None  # raised in put(), through upstream's own line
        if path == "wrappers":  # the generated wrapper's frame shows its line (linecache)
            (frame,) = [f for f in traceback.extract_tb(traced.__traceback__) if f.filename.endswith(":add_request")]
            assert frame.line and "original(self, item)" in frame.line, frame
        assert session.recorder.disabled_reason is None
        assert not hasattr(refused_task, "_kvtrace")
        assert st.worker.step_records == {}
        assert len(session.recorder._pool) == pool  # the record went back
        assert (st.enqueued, st.dequeued, st.completed) == (1, 1, 1)
        env.thread.add_request(upstream.gva_task(2, [upstream.request("r2", 3)]))
        rec = env.thread.request_queue.get()._kvtrace
        assert (rec.layer_id, rec.seq, rec.queue_depth_at_enqueue, rec.inflight_at_enqueue) == (2, 1, 0, 0)
        assert st.worker.step_records == {2: rec}
    finally:
        session.shutdown()


def test_a_raising_send_enqueue_takes_its_record_back(upstream: Upstream) -> None:
    """The send thread's enqueue (the wrapper, ``wrappers.enqueue_undo`` too): upstream's ``put`` raising
    leaves the send FIFO, the counters and the record pool as they were."""
    from .harness import pool_worker

    class Refusing:
        def put(self, item: Any) -> None:
            raise OverflowError("queue refused")

    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="refuse-send")
    try:
        worker = pool_worker(upstream, 2, 0, FakeBackend())
        send = worker.kv_send_thread
        if send is None:
            pytest.skip("no send thread in this layout")
        st = send.__dict__[attach.STATE_ATTR]
        assert st.is_send
        before = (list(st.send_fifo), st.enqueued, len(session.recorder._pool))
        real, send.request_queue = send.request_queue, Refusing()
        try:
            with pytest.raises(OverflowError, match="queue refused"):
                send.add_request([])
        finally:
            send.request_queue = real
        # the record went back (a new one, when the pool was empty)
        assert (list(st.send_fifo), st.enqueued, len(session.recorder._pool)) == (*before[:2], max(before[2], 1))
        assert session.recorder.disabled_reason is None
    finally:
        session.shutdown()


def _modified_add_request(upstream: Upstream, tmp_path: Path, body: str) -> type:
    """A subclass whose ``add_request`` is upstream's with its ``put`` line replaced by ``body`` (``{p}``: the
    task parameter's name), loaded from a file in upstream's module globals."""
    base = upstream.binding.classes["recv_gva"]
    fn = getattr(base.add_request, "__kvtrace_wrapped__", base.add_request)
    source = inspect.getsource(fn)
    param = list(inspect.signature(fn).parameters)[1]
    put = f"        self.request_queue.put({param})\n"
    assert put in source
    path = tmp_path / "modified_add.py"
    path.write_text("class Modified(_Base):\n" + source.replace(put, body.format(p=param)))
    namespace = dict(vars(sys.modules[base.__module__]), _Base=base)
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the test's own edit
    return namespace["Modified"]


def test_probe_paths_say_why_the_enqueue_is_the_wrapper(upstream: Upstream, tmp_path: Path) -> None:
    modified = _modified_add_request(upstream, tmp_path, "        super().add_request({p})\n")
    targets = _targets_with(upstream, modified)
    session = start_tracing(targets, exporter=None, run_id="enqueue-path")
    try:
        path = patches.probe_paths(targets)["Modified.add_request"]
        assert path.startswith("wrapper: line ") and path.endswith("uses 'super'"), path
        assert patches.probe_paths(targets)["Modified"] == "compiled"
    finally:
        session.shutdown()


def test_the_enqueue_undo_uses_the_task_not_the_rebound_parameter(upstream: Upstream, tmp_path: Path) -> None:
    """An upstream ``add_request`` that rebinds its own parameter before ``put`` raises: the compiled
    handler's undo works on the task the prelude saw (captured there), not on what the name holds after
    upstream's body (review 5, finding 12)."""
    modified = _modified_add_request(
        upstream, tmp_path, "        queued, {p} = {p}, None\n        self.request_queue.put(queued)\n")

    class Refusing:
        def put(self, item: Any) -> None:
            raise OverflowError("queue refused")

    session = start_tracing(_targets_with(upstream, modified), exporter=None, run_id="rebind")
    try:
        assert rewrite.is_compiled(modified.__dict__["add_request"])
        thread = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False).thread
        thread.__class__ = modified
        thread.request_queue = Refusing()
        task = upstream.gva_task(0, [upstream.request("r1", 3)])
        with pytest.raises(OverflowError):
            thread.add_request(task)
        assert not hasattr(task, "_kvtrace")
        assert thread.__dict__[attach.STATE_ATTR].enqueued == 0
        assert session.recorder.disabled_reason is None
    finally:
        session.shutdown()


def _modified_class(upstream: Upstream, tmp_path: Path, edit: Any) -> type:
    """A subclass whose ``_handle_request`` is upstream's source with ``edit`` applied, loaded from a file
    (so ``inspect`` can read it back) in upstream's module globals."""
    base = upstream.binding.classes["recv_gva"]
    source = inspect.getsource(base._handle_request)
    edited = edit(source)
    assert edited != source
    path = tmp_path / "modified_recv.py"
    path.write_text("class Modified(_Base):\n" + edited)
    module = sys.modules[base.__module__]
    namespace = dict(vars(module), _Base=base)
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the test's own edit
    return namespace["Modified"]


EDITS = {
    "anchor missing": (lambda s: s.replace("self._stagger_h2d_submit(layer_id)", "pass"), "no stagger"),
    "extra statement": (lambda s: s.replace("        self._stagger_h2d_submit(layer_id)\n",
                                            "        self._stagger_h2d_submit(layer_id)\n"
                                            "        ok = attention_start_gate is None or attention_start_gate.wait(0)\n"),
                        "is not in a statement the probes know"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_source_of_another_shape_falls_back_to_the_wrappers_with_one_log_line(
        upstream: Upstream, tmp_path: Path, caplog: Any, case: str) -> None:
    edit, reason = EDITS[case]
    modified = _modified_class(upstream, tmp_path, edit)
    targets = _targets_with(upstream, modified)
    caplog.set_level(logging.INFO, logger="otel_kvtrace")
    session = start_tracing(targets, exporter=None, run_id="fallback")
    try:
        lines = [r.getMessage() for r in caplog.records if "wrapper path" in r.getMessage()]
        mine = [line for line in lines if "Modified" in line]
        assert len(mine) == 1 and reason in mine[0], lines
        assert patches.probe_paths(targets)["Modified"] == "wrappers"
        thread = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False).thread
        thread.__class__ = modified
        thread.add_request(upstream.gva_task(0, [upstream.request("r1", 3)]))
        thread._handle_request(thread.request_queue.get())
        (rec,) = session.recorder.drain(10)
        assert rec.t_backend_return != NO_TIME  # traced through the wrappers
    finally:
        session.shutdown()


def test_the_unedited_source_from_a_file_compiles(upstream: Upstream, tmp_path: Path) -> None:
    """The positive control of the fallback tests: the same loading, no edit, compiled probes."""
    modified = _modified_class(upstream, tmp_path, lambda s: s + "\n")
    targets = _targets_with(upstream, modified)
    session = start_tracing(targets, exporter=None, run_id="control")
    try:
        assert patches.probe_paths(targets)["Modified"] == "compiled"
    finally:
        session.shutdown()


class _Boom(RuntimeError):
    pass


class _RaisingClient:
    def batch_copy(self, gvas: Any, addrs: Any, sizes: Any, direction: int) -> int:
        raise _Boom(f"copy of {len(gvas)} entries failed")


def _raise_once(upstream: Upstream) -> tuple[BaseException, list[tuple[str, int, str]]]:
    backend = FakeBackend()
    backend.store = _RaisingClient()
    env = upstream.gva_thread(N_LAYERS, backend, start=False)
    env.thread.add_request(upstream.gva_task(1, [upstream.request("r1", 3)]))
    item = env.thread.request_queue.get()
    with pytest.raises(_Boom) as info:
        env.thread._handle_request(item)
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(info.value.__traceback__)][1:]
    return info.value, frames


def test_a_raising_batch_copy_raises_the_same_with_and_without_tracing(upstream: Upstream) -> None:
    plain, plain_frames = _raise_once(upstream)
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="raise")
    try:
        traced, traced_frames = _raise_once(upstream)
        (rec,) = session.recorder.drain(10)
    finally:
        session.shutdown()
    assert type(traced) is type(plain) and str(traced) == str(plain)
    assert traced_frames == plain_frames  # upstream's file and line numbers, no frame of ours
    assert [f[2] for f in traced_frames][:2] == ["_handle_request", "_batch_copy_with_limits"]
    assert rec.error is traced and rec.backend_result == -1 and rec.t_complete != NO_TIME
    assert rec.stages[-3] == 7  # backend_submit, closed by the exception


@pytest.mark.parametrize("probes", ["compiled", "wrappers"])
def test_a_raising_native_gate_rule_turns_tracing_off_not_the_recv_thread(upstream: Upstream, monkeypatch: Any,
                                                                          probes: str) -> None:
    """A gate stamp the recording never writes (two items) makes the gate rule raise inside the native call
    (``_probes.GateAfter`` hands it to the rule's text, whose unpacking raises): the stamp's handler turns
    tracing off with that error, and upstream's ``_handle_request`` completes the load as without tracing."""
    monkeypatch.setenv("OTEL_KVTRACE_PROBES", probes)
    targets = upstream.binding.to_targets()
    session = start_tracing(targets, exporter=None, run_id="gate-raise")
    try:
        assert patches.probe_paths(targets)[upstream.binding.classes["recv_gva"].__qualname__] == probes
        env = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False)
        thread = env.thread
        gate = upstream.gate_class()
        gate.record()
        gate.__dict__[wrappers.GATE_STAMP_ATTR] = (1, 2)
        thread.add_request(upstream.gva_task(1, [upstream.request("r1", 3)], gate=gate))
        thread._handle_request(thread.request_queue.get())
        assert env.load_done[1].is_set()
        reason = session.recorder.disabled_reason
    finally:
        session.shutdown()
    assert reason is not None and "not enough values to unpack" in reason, reason


# ---- same records on both paths -----------------------------------------------------------------------


def _workload(upstream: Upstream, env: Any, gate_before: Any) -> None:
    """Every branch the probes stamp, driven synchronously (deterministic): plain, save wait + gate
    recorded while tracing, gate recorded before tracing, empty task after a save wait, failed copy."""
    thread = env.thread
    r = upstream.request("r1", 3)

    def run(task: Any) -> None:
        thread.add_request(task)
        try:
            thread._handle_request(thread.request_queue.get())
        except RuntimeError:
            assert upstream.is_main  # main raises on a failed copy; 0.23 logs it
        for ev in env.load_done:
            ev.clear()

    run(upstream.gva_task(0, [r]))
    gate = upstream.gate_class()
    gate.record()
    thread.layer_save_finished_events[0].set()
    if upstream.is_main:
        thread.sync_save_events[0].record()
    run(upstream.gva_task(1, [r], wait_for_save_layer=0, gate=gate))
    run(upstream.gva_task(2, [r], gate=gate_before))
    thread.layer_save_finished_events[1].set()
    if upstream.is_main:
        thread.sync_save_events[1].record()
    run(upstream.gva_task(3, [], wait_for_save_layer=1))
    env.backend.results.append(5)
    run(upstream.gva_task(3, [r]))
    slotted = slotted_gate(upstream)  # recorded while tracing, but it cannot carry the stamp or the gate id
    slotted.record()
    run(upstream.gva_task(2, [r], gate=slotted))


def slotted_gate(upstream: Upstream) -> Any:
    """A gate without ``__dict__`` (``__slots__``) whose ``record``/``wait`` are upstream's gate class's own
    functions as installed (the record wrapper; the wait wrapper on the wrapper path)."""
    gate_cls = upstream.gate_class

    class SlottedGate:
        __slots__ = ("_condition", "_event")

        def __init__(self) -> None:
            gate_cls.__init__(self)

        def record(self, *args: Any, **kwargs: Any) -> Any:
            return gate_cls.record(self, *args, **kwargs)

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            return gate_cls.wait(self, *args, **kwargs)

    gate = SlottedGate()
    assert not hasattr(gate, "__dict__")
    return gate


def _shape(rec: Any) -> dict[str, Any]:
    """A record's content with every time replaced by whether it is set (and deps by exact/bounded)."""
    out = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}
    for name in ("t_enqueue", "t_dequeue", "t_backend_return", "t_complete"):
        out[name] = out[name] != NO_TIME
    out["stages"] = rec.stages[0::3]
    out["deps"] = [(rec.deps[2 * d] != NO_TIME, rec.deps[2 * d] == rec.deps[2 * d + 1]) for d in range(NUM_DEPS)]
    out["error"] = (type(rec.error).__name__, str(rec.error)) if rec.error is not None else None
    out["npu_marks"] = [(dep, type(mark).__name__) for dep, mark in rec.npu_marks]
    out["queue"] = (rec.queue.path, rec.queue.num_layers)
    out["transfer_tasks"] = type(rec.transfer_tasks).__name__
    return out


def _inline_rules(monkeypatch: Any) -> None:
    """What a process without the ``_probes`` extension runs: the enqueue's record take, the gate rule and the save
    wait's after-stamp as their rules' text."""
    monkeypatch.setattr(wrappers, "NATIVE_TAKE", None)
    monkeypatch.setattr(wrappers, "NATIVE_GATE", None)
    monkeypatch.setattr(rewrite, "_GATE_AFTER", rewrite._GATE_AFTER_INLINE)
    monkeypatch.setattr(rewrite, "NATIVE_SAVE", None)
    monkeypatch.setattr(rewrite, "_SAVE_AFTER", rewrite._SAVE_AFTER_INLINE)
    for capture, suffix in ((False, ""), (True, "_CAPTURE")):
        prelude, on_raise = rewrite._enqueue_templates(capture, False)
        monkeypatch.setattr(rewrite, "_ENQUEUE_PRELUDE" + suffix, prelude)
        monkeypatch.setattr(rewrite, "_ENQUEUE_RAISE" + suffix, on_raise)


def _records(upstream: Upstream, monkeypatch: Any, probes: str, native: bool | None = None
             ) -> tuple[list[dict[str, Any]], str]:
    """``native``: the natives in use (default: where the extension is built), else the rules' text."""
    if native is None:
        native = wrappers.NATIVE_TAKE is not None
    monkeypatch.setenv("OTEL_KVTRACE_PROBES", probes)
    if not native:
        _inline_rules(monkeypatch)
    gate_before = upstream.gate_class()
    gate_before.record()
    targets = upstream.binding.to_targets()
    session = start_tracing(targets, exporter=None, run_id="same")
    try:
        session.recorder.npu_resolver = None  # keep the marks as recorded
        env = upstream.gva_thread(N_LAYERS, FakeBackend(), start=False)
        _workload(upstream, env, gate_before)
        records = session.recorder.drain(100)
        path = patches.probe_paths(targets)[upstream.binding.classes["recv_gva"].__qualname__]
        enqueue = patches.probe_paths(targets)[upstream.binding.classes["recv_gva"].__qualname__ + ".add_request"]
        code = upstream.binding.classes["recv_gva"].__dict__["add_request"].__code__
        assert ((rewrite.PREFIX if probes == "compiled" else "") + "seen" in code.co_varnames) is (not native)
        if probes == "compiled":  # the gate rule: its text inlined, or the one native call
            handle = upstream.binding.classes["recv_gva"].__dict__["_handle_request"].__code__
            assert (rewrite.PREFIX + "gstamp" in handle.co_varnames) is (not native)
            assert (rewrite.PREFIX + "gate_after" in handle.co_freevars) is native
            assert (rewrite.PREFIX + "set_ns" in handle.co_varnames) is (not native)
            assert (rewrite.PREFIX + "save_after" in handle.co_freevars) is native
        assert enqueue == ("compiled" if probes == "compiled" else "wrapper: OTEL_KVTRACE_PROBES=wrappers"), enqueue
        assert session.recorder.disabled_reason is None  # the slotted gate did not turn tracing off
    finally:
        session.shutdown()
    return [_shape(r) for r in records], path


def test_the_compiled_path_records_what_the_wrapper_path_records(upstream: Upstream, monkeypatch: Any) -> None:
    wrapped, wrapped_path = _records(upstream, monkeypatch, "wrappers")
    compiled, compiled_path = _records(upstream, monkeypatch, "compiled")
    assert (wrapped_path, compiled_path) == ("wrappers", "compiled")
    assert len(compiled) == len(wrapped) == 6
    for i, (c, w) in enumerate(zip(compiled, wrapped, strict=True)):
        diff = {k: (c[k], w[k]) for k in c if c[k] != w[k]}
        assert not diff, f"task {i}: compiled vs wrappers differ in {diff}"
    # the workload reached every branch: save dep, gate deps, an empty task, a failed copy
    assert compiled[1]["has_dep"] and compiled[2]["has_dep"]
    assert [c["outcome"] for c in compiled][3:5] != [0, 0]
    # a gate recorded while tracing carries its record time (exact) and an id; the slotted one degrades to
    # what a gate recorded before tracing gets: gate deps bounded by the task's own wait, no id, no marks
    gate_record, gate_npu = 2, 3
    assert compiled[1]["deps"][gate_record] == (True, True) and compiled[1]["gate_id"] is not None
    assert compiled[5]["deps"][gate_record] == compiled[2]["deps"][gate_record] == (True, False)
    assert compiled[5]["deps"][gate_npu] == (True, False) and compiled[5]["stages"] == compiled[2]["stages"]
    assert compiled[5]["gate_id"] is None and compiled[5]["npu_marks"] == [] and compiled[5]["outcome"] == 0


@pytest.mark.parametrize("probes", ["compiled", "wrappers"])
def test_the_native_record_take_records_what_its_rule_records(upstream: Upstream, monkeypatch: Any,
                                                               probes: str) -> None:
    """The enqueue with the native record take (``_probes.Take``, the default when built) and the gate stamps
    with the native gate rule (``_probes.GateAfter``) and save after-stamp (``_probes.SaveAfter``), and all with
    their rule's text inlined (a process without the extension) give the same records on the same workload, on
    both paths; the inlined text passes the proof too (the compiled path stays compiled)."""
    if wrappers.NATIVE_TAKE is None or wrappers.NATIVE_GATE is None or rewrite.NATIVE_SAVE is None:
        pytest.skip("the optional _probes extension is not built (tests/instrument/test_enqueue_take.py says why)")
    native, _ = _records(upstream, monkeypatch, probes)
    with monkeypatch.context() as m:
        inline, _ = _records(upstream, m, probes, native=False)
    assert len(native) == len(inline) == 6
    for i, (a, b) in enumerate(zip(native, inline, strict=True)):
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not diff, f"task {i}: native vs inline take differ in {diff}"
    assert native[1]["gate_id"] is not None and native[1]["transfer_tasks"] != "NoneType"


def test_the_proof_rejects_a_rewrite_that_changes_an_upstream_statement(upstream: Upstream, monkeypatch: Any) -> None:
    """A stamp that alters one of upstream's own statements (here: the copy's direction 1 -> 0) is caught by
    the strip-and-compare proof, never compiled."""
    import ast

    from otel_kvtrace.instrument import rewrite

    original_stamp = rewrite._Rewriter.stamp

    def tampering(self: Any, s: ast.stmt) -> Any:
        value = getattr(s, "value", None)
        if isinstance(value, ast.Call) and getattr(value.func, "attr", "") == "_batch_copy_with_limits":
            value.args[3] = ast.Constant(0)
        return original_stamp(self, s)

    fn = upstream.binding.classes["recv_gva"]._handle_request
    rewrite.rewrite_tree(fn)  # as it is: proved
    monkeypatch.setattr(rewrite._Rewriter, "stamp", tampering)
    with pytest.raises(rewrite.NotRewritable, match="proof failed"):
        rewrite.rewrite_tree(fn)


def test_a_template_replaced_at_run_time_is_compiled_not_served_from_the_cache(upstream: Upstream,
                                                                               monkeypatch: Any) -> None:
    """The compile cache is keyed on the templates' texts: a template replaced without touching the native flags
    (here the build stamp emptied, as ``bench/recording_instructions.py --ablate`` does) is compiled anew and
    proved; a cache keyed on the flags served the previous text's code."""
    from otel_kvtrace.instrument import rewrite

    def handle_code(factory: Any) -> Any:
        outer = next(c for c in factory.co_consts if getattr(c, "co_name", "") == rewrite.PREFIX + "factory")
        return next(c for c in outer.co_consts if getattr(c, "co_name", "") == "_handle_request")

    fn = upstream.binding.classes["recv_gva"]._handle_request
    names = tuple(rewrite._closure(fn, None))
    first = rewrite._factory_code(fn, names)
    assert rewrite._factory_code(fn, names) is first  # the same texts: the cached code
    monkeypatch.setattr(rewrite, "_BUILD_AFTER", "pass")
    emptied = rewrite._factory_code(fn, names)
    assert emptied is not first and handle_code(emptied).co_code != handle_code(first).co_code
    monkeypatch.undo()
    assert rewrite._factory_code(fn, names) is first  # the original texts again: their cached code
