"""In-place proxies for upstream's per-instance collaborators.

Upstream shares its event lists between the worker and both transfer threads by reference and never
replaces them, so replacing an element with a proxy (``lst[i] = Traced...(lst[i])``) reaches every user
at once; a thread already blocked in the original's ``wait`` is still woken because the proxy delegates
to the same object. Producer-side stamps (``set``/``record`` times) are what make a queued task's
readiness known while it still waits behind the head.

Every proxy delegates unknown attributes to the wrapped object and keeps it in ``_inner`` so
``uninstrument`` can put the original back.
"""

from __future__ import annotations

from threading import get_ident
from typing import Any

from numpy import ndarray as _NDARRAY

from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.state import QueueState
from otel_kvtrace.instrument.stream_order import StreamPosition, next_position
from otel_kvtrace.record.model import NO_TIME, Dep, Stage

_FAR_FUTURE = 1 << 62

SAVE_CPU_WAIT = int(Stage.SAVE_CPU_WAIT)
SAVE_NPU_SYNC = int(Stage.SAVE_NPU_SYNC)
META_BUILD = int(Stage.META_BUILD)
SLOT_RELEASE_WAIT = int(Stage.SLOT_RELEASE_WAIT)
BACKEND_SUBMIT = int(Stage.BACKEND_SUBMIT)
CONSUMER_WAIT = int(Stage.CONSUMER_WAIT)
DEP_SAVE_CPU = int(Dep.SAVE_CPU)
DEP_SAVE_NPU = int(Dep.SAVE_NPU)
DEP_SLOT_RELEASE = int(Dep.SLOT_RELEASE)
# TaskRecord.dep_exact / dep_bounds inlined on the recording threads: (has_dep bit, index of lo in deps).
_SAVE_CPU_BIT, _SAVE_CPU_LO = 1 << DEP_SAVE_CPU, 2 * DEP_SAVE_CPU
_SAVE_NPU_BIT, _SAVE_NPU_LO = 1 << DEP_SAVE_NPU, 2 * DEP_SAVE_NPU
_SLOT_RELEASE_BIT, _SLOT_RELEASE_LO = 1 << DEP_SLOT_RELEASE, 2 * DEP_SLOT_RELEASE
SMALL_ARRAY = 256  # sizes arrays up to this length are summed through tolist() (cheaper than .sum())


class _Proxy:
    # _clock and _by_thread are cached here: every attribute hop costs on the recording threads.
    __slots__ = ("_inner", "_rt", "_st", "_clock", "_by_thread")

    def __init__(self, inner: Any, rt: Runtime, st: QueueState) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_rt", rt)
        object.__setattr__(self, "_st", st)
        object.__setattr__(self, "_clock", rt.recorder.clock)
        object.__setattr__(self, "_by_thread", rt.state_by_thread)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"<kvtrace proxy of {self._inner!r}>"


class _EventProxy(_Proxy):
    """A ``threading.Event`` stand-in: ``clear``/``is_set`` are the inner event's own bound methods
    (slots, so calling them runs no Python frame of ours)."""

    __slots__ = ("clear", "is_set")

    def __init__(self, inner: Any, rt: Runtime, st: QueueState) -> None:
        super().__init__(inner, rt, st)
        object.__setattr__(self, "clear", inner.clear)
        object.__setattr__(self, "is_set", inner.is_set)


class TracedSaveEvent(_EventProxy):
    """``layer_save_finished_events[i]``: producer ``set()`` time; the recv thread's save wait."""

    __slots__ = ("set_ns", "_wait")

    def __init__(self, inner: Any, rt: Runtime, st: QueueState) -> None:
        super().__init__(inner, rt, st)
        self.set_ns = NO_TIME
        object.__setattr__(self, "_wait", inner.wait)

    def set(self) -> None:
        inner = self._inner
        if not inner.is_set():
            self.set_ns = self._clock()
        inner.set()

    def wait(self, timeout: float | None = None) -> bool:
        st = self._by_thread.get(get_ident())
        if st is None or st.current is None or st.is_send:
            return self._inner.wait(timeout)
        clock = self._clock
        t0 = clock()
        ok = self._inner.wait(timeout)
        t1 = clock()
        try:
            rec = st.current
            if rec is not None:
                rec.stages.extend((SAVE_CPU_WAIT, t0, t1))
                if ok:
                    set_ns = self.set_ns
                    deps = rec.deps
                    rec.has_dep |= _SAVE_CPU_BIT
                    if set_ns >= 0:
                        deps[_SAVE_CPU_LO] = deps[_SAVE_CPU_LO + 1] = set_ns
                    else:  # set before we were attached: only bounded by our own wait
                        deps[_SAVE_CPU_LO] = rec.t_enqueue
                        deps[_SAVE_CPU_LO + 1] = t1
        except Exception as exc:
            self._rt.fail(exc)
        return ok


class DirectWaitSaveEvent(TracedSaveEvent):
    """A save event of a recv thread with compiled probes (``instrument/rewrite.py``): ``wait`` is the
    inner event's own bound method (the probes time it inline); ``set`` still stamps the producer's time.
    Same layout as ``TracedSaveEvent``, so a proxy made by the send thread is switched by ``__class__``."""

    __slots__ = ()
    wait = TracedSaveEvent._wait  # type: ignore[assignment]  # the slot holding inner.wait


class TracedLoadEvent(_EventProxy):
    """``layer_load_finished_events[i]``: completion (recv ``set``) and the forward's consumer wait."""

    __slots__ = ("_layer", "_set")

    def __init__(self, inner: Any, rt: Runtime, st: QueueState, layer: int) -> None:
        super().__init__(inner, rt, st)
        self._layer = layer
        object.__setattr__(self, "_set", inner.set)

    def set(self) -> None:
        st = self._st
        if get_ident() == st.thread_ident:
            rec = st.current
            if rec is not None:
                rec.t_complete = self._clock()
        self._inner.set()

    def wait(self, timeout: float | None = None) -> bool:
        st = self._st
        if get_ident() == st.thread_ident or not st.consumer_tracking:
            return self._inner.wait(timeout)
        clock = self._clock
        t0 = clock()
        ok = self._inner.wait(timeout)
        t1 = clock()
        try:
            rec = st.worker.step_records.get(self._layer)
            if rec is not None and rec.holds:
                rec.stages.extend((CONSUMER_WAIT, t0, t1))
        except Exception as exc:
            self._rt.fail(exc)
        return ok


class DirectSetLoadEvent(TracedLoadEvent):
    """A load event of a recv thread with compiled probes: ``set`` is the inner event's own bound method
    (the probes stamp ``t_complete`` just before it); the forward's consumer wait is still recorded."""

    __slots__ = ()
    set = TracedLoadEvent._set  # type: ignore[assignment]


class TracedNpuEvent(_Proxy):
    """``sync_save_events[i]`` (an NPU event): record (issue) time and synchronize bounds."""

    __slots__ = ("record_ns", "sync_hi", "mark", "position")

    def __init__(self, inner: Any, rt: Runtime, st: QueueState) -> None:
        super().__init__(inner, rt, st)
        self.record_ns = NO_TIME
        self.sync_hi = _FAR_FUTURE
        self.mark = None
        self.position: StreamPosition | None = None

    def record(self, *args: Any, **kwargs: Any) -> Any:
        rt = self._rt
        self.record_ns = rt.recorder.clock()
        self.sync_hi = _FAR_FUTURE
        self.position = next_position(rt)
        result = self._inner.record(*args, **kwargs)
        timing = rt.npu_timing
        if timing is not None:
            try:
                self.mark = timing.mark(*args, **kwargs)
            except Exception as exc:
                rt.fail(exc)
        return result

    def query(self) -> bool:
        done = self._inner.query()
        if done:
            now = self._clock()
            if now < self.sync_hi:
                self.sync_hi = now
            if self.position is not None:
                self.position.log.observe(self.position.position, now)
        return done

    def synchronize(self) -> Any:
        clock = self._clock
        t0 = clock()
        result = self._inner.synchronize()
        t1 = clock()
        if t1 < self.sync_hi:
            self.sync_hi = t1
        position = self.position
        if position is not None:
            log = position.log  # StreamLog.observe, inlined
            p = position.position
            done_by = log.done_by
            if t1 < done_by[p]:
                done_by[p] = t1
            if p > log.observed:
                log.observed = p
        st = self._by_thread.get(get_ident())
        if st is not None:
            try:
                rec = st.current
                if rec is not None:
                    rec.stages.extend((SAVE_NPU_SYNC, t0, t1))
                    if st.is_send:
                        return result
                    deps = rec.deps
                    rec.has_dep |= _SAVE_NPU_BIT
                    deps[_SAVE_NPU_LO] = self.record_ns if self.record_ns >= 0 else rec.t_enqueue
                    deps[_SAVE_NPU_LO + 1] = self.sync_hi
                    if position is not None:
                        rec.npu_marks.append((DEP_SAVE_NPU, position))
                    if self.mark is not None:
                        rec.npu_marks.append((DEP_SAVE_NPU, self.mark))
            except Exception as exc:
                self._rt.fail(exc)
        return result


def _timed_build(name: str) -> Any:
    """A builder method that times ``inner.<name>`` as ``meta_build`` when the recv thread runs a task."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = self._by_thread.get(get_ident())
        if st is None or st.current is None:
            return getattr(self._inner, name)(*args, **kwargs)
        clock = self._clock
        t0 = clock()
        result = getattr(self._inner, name)(*args, **kwargs)
        rec = st.current
        if rec is not None:
            rec.stages.extend((META_BUILD, t0, clock()))
        return result

    method.__name__ = method.__qualname__ = name
    return method


class TracedBuilder(_Proxy):
    """The recv thread's own ``LayerBatchBuilder``: address/metadata build time."""

    __slots__ = ()

    # One frame of ours per call on the recv thread: the timing is in the method itself (made once per
    # method name at class creation), not in a helper it calls.
    build_addrs = _timed_build("build_addrs")
    build = _timed_build("build")


class TracedKeyStore(_Proxy):
    """A key-path thread's ``m_store``: ``get`` (recv) / ``put`` (send) is the synchronous backend submit."""

    __slots__ = ()

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._submit(self._inner.get, args, kwargs)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        return self._submit(self._inner.put, args, kwargs)

    def _submit(self, call: Any, args: tuple, kwargs: dict) -> Any:
        st = self._st
        if get_ident() != st.thread_ident:
            return call(*args, **kwargs)
        clock = self._clock
        t0 = clock()
        rec = st.current
        if rec is not None:
            # Key path: keys and addresses are built inline before the get; that span is meta_build.
            built_from = rec.stages[-1] if rec.stages else rec.t_dequeue
            if built_from >= 0 and not st.is_send and META_BUILD not in rec.stages[0::3]:
                rec.stages.extend((META_BUILD, built_from, t0))
        try:
            result = call(*args, **kwargs)
        except BaseException:
            if rec is not None:
                rec.stages.extend((BACKEND_SUBMIT, t0, clock()))
                rec.backend_result = -1
            raise
        t1 = clock()
        if rec is not None:
            rec.stages.extend((BACKEND_SUBMIT, t0, t1))
            rec.t_backend_return = t1  # completion starts only after a normal return
            if type(result) is int:  # a result code (upstream logs and ignores it on the key path)
                rec.backend_result = result
            sizes = args[2] if len(args) > 2 else kwargs.get("sizes")
            if sizes is not None:
                rec.nbytes += total_bytes(sizes)
        return result


def total_bytes_rule(sizes: Any) -> int:
    """Bytes in a size array or list (numpy ``.sum()``; flat or one level nested lists for the key path).
    The reference; :data:`total_bytes` is this rule, or the native one for 1-D integer arrays (same value)."""
    try:
        if type(sizes) is _NDARRAY:  # the GVA path's case first: one type check instead of three lookups
            if sizes.ndim == 1 and len(sizes) <= SMALL_ARRAY:
                return int(sum(sizes.tolist()))
            return int(sizes.sum())
        if hasattr(sizes, "sum"):
            if hasattr(sizes, "tolist") and getattr(sizes, "ndim", 0) == 1 and len(sizes) <= SMALL_ARRAY:
                return int(sum(sizes.tolist()))
            return int(sizes.sum())
        try:
            return int(sum(sizes))
        except TypeError:
            return int(sum(sum(inner) for inner in sizes))
    except Exception:
        return 0


def _native_total_bytes() -> Any:
    """``_probes.total_bytes`` (the exact int64 sum of a 1-D integer ndarray, else :func:`total_bytes_rule`),
    or the rule itself when the optional extension is not built."""
    try:
        from otel_kvtrace.instrument import _probes  # type: ignore[attr-defined]
    except ImportError:
        return total_bytes_rule
    _probes.set_fallback(total_bytes_rule, _NDARRAY)
    return _probes.total_bytes


total_bytes = _native_total_bytes()
"""Bytes of a copy's size argument: the one home of the rule (``total_bytes_rule``), native when built."""


def traced_slot_waiter(waiter: Any, rt: Runtime, st: QueueState) -> Any:
    """Wrap ``external_slot_release_waiter(layer)``: the wait, and the release time (bounded)."""
    clock = rt.recorder.clock
    release_time = getattr(waiter, "kvtrace_release_time", None)

    def external_slot_release_waiter(layer_id: int, *args: Any, **kwargs: Any) -> Any:
        if get_ident() != st.thread_ident:
            return waiter(layer_id, *args, **kwargs)
        t0 = clock()
        try:
            return waiter(layer_id, *args, **kwargs)
        finally:
            t1 = clock()
            rec = st.current
            if rec is not None:
                try:
                    rec.stages.extend((SLOT_RELEASE_WAIT, t0, t1))
                    exact = release_time(layer_id) if release_time is not None else None
                    deps = rec.deps
                    rec.has_dep |= _SLOT_RELEASE_BIT
                    if exact is not None and exact >= 0:
                        deps[_SLOT_RELEASE_LO] = deps[_SLOT_RELEASE_LO + 1] = exact
                    else:
                        deps[_SLOT_RELEASE_LO] = rec.t_enqueue
                        deps[_SLOT_RELEASE_LO + 1] = t1
                except Exception as exc:
                    rt.fail(exc)

    external_slot_release_waiter.__kvtrace_wrapped__ = waiter  # type: ignore[attr-defined]
    if release_time is not None:  # still readable without blocking: tracing must not change the schedule
        external_slot_release_waiter.kvtrace_release_time = release_time  # type: ignore[attr-defined]
    return external_slot_release_waiter
