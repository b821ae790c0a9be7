"""Class-level wrappers: one factory per patch point, ``make(original, rt) -> replacement``.

Every wrapper calls the original exactly once, with the same arguments, and lets its result and its
exception through unchanged; our own bookkeeping runs in ``try/except`` blocks that turn a bug in the
instrumentation into ``rt.fail`` (tracing off) rather than an error in the host thread. That keeps
exception, ``task_done()``, shutdown and ``_fatal_error`` semantics identical with and without tracing.
"""

from __future__ import annotations

import functools
import linecache
from collections.abc import Callable
from threading import get_ident
from typing import Any

from otel_kvtrace.instrument import attach
from otel_kvtrace.instrument.attach import GATE_ID_ATTR, STATE_ATTR, WORKER_ATTR
from otel_kvtrace.instrument.proxies import total_bytes
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.state import QueueState, WorkerState
from otel_kvtrace.instrument.stream_order import FAR_FUTURE, MAX_EVENTS_PER_LOG, StreamLog, StreamPosition
from otel_kvtrace.record.ring import REASON_STEP_BOUNDARY, REASON_WAITED
from otel_kvtrace.record.model import NO_TIME, BackendResultError, Dep, Outcome, Stage, TaskKind, TaskRecord

GATE_COND_WAIT = int(Stage.GATE_COND_WAIT)
GATE_NPU_SYNC = int(Stage.GATE_NPU_SYNC)
H2D_STAGGER = int(Stage.H2D_STAGGER)
BACKEND_SUBMIT = int(Stage.BACKEND_SUBMIT)
DEP_GATE_RECORD = int(Dep.GATE_RECORD)
DEP_GATE_NPU = int(Dep.GATE_NPU)
_ERROR = int(Outcome.ERROR)
_EMPTY = int(Outcome.EMPTY)
_SEND = int(TaskKind.SEND)
_HOLD_RECV = 0
_HOLD_CONSUMER = 1


def _mark(wrapper: Callable, original: Callable) -> Callable:
    functools.update_wrapper(wrapper, original)
    wrapper.__kvtrace_wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def indent_rule(text: str, spaces: int) -> str:
    """A rule's text (:func:`enqueue_rule`, :func:`gate_rule`, ...) indented to sit in a block ``spaces`` deep."""
    return "".join(" " * spaces + line if line.strip() else line for line in text.strip("\n").splitlines(True))


_GENERATED: dict[tuple[str, bool], Any] = {}


def generated(name: str, variant: bool = False) -> Callable:
    """The factory ``make`` of a wrapper generated from a rule's text (``_<NAME>_SOURCE``; a dict of texts by
    ``variant``, e.g. the enqueue's with the native record take), compiled once under the file name
    ``wrappers.py:<name>``, whose text is registered in ``linecache`` so tracebacks, pdb and ``inspect`` show
    the generated lines."""
    source = globals()[f"_{name.upper()}_SOURCE"]
    if isinstance(source, dict):  # one file name for every variant: a process installs one of them
        source = source[variant]
    return compile_generated(name, variant, source, __file__)


def compile_generated(name: str, variant: bool, source: str, home: str) -> Callable:
    """The ``make`` defined by ``source`` (a rule's generated text), compiled once per (name, variant) under the
    file name ``<home>:<name>`` and registered in ``linecache``: :func:`generated`'s texts, and the rules
    kept in other modules (``rewrite.save_after_rule``)."""
    filename = f"{home}:{name}"
    # at every install (a linecache.clearcache() drops it); mtime None: checkcache keeps it
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    make = _GENERATED.get((name, variant))
    if make is None:
        ns: dict[str, Any] = {}
        exec(compile(source, filename, "exec"), ns)  # noqa: S102 - our own rule's text
        make = _GENERATED[(name, variant)] = ns["make"]
    return make


def release_recv(rt: Runtime, rec: Any) -> None:
    """The recv (or send) thread is done with a record; the last of the two holders hands it on.

    ``holds`` is ``[_HOLD_RECV]`` or ``[_HOLD_RECV, _HOLD_CONSUMER]``; ``list.pop`` is atomic under the
    GIL, so exactly one of two racing holders pops ``_HOLD_RECV`` (the last one), whatever the order.
    While the consumer still holds the record, the task is shipped *before* this thread drops its hold:
    the forward, once last, only adds its consumer wait, and never recycles a record still being written.
    """
    holds = rec.holds
    recorder = rt.recorder
    if len(holds) < 2:  # the consumer is done (or never held it): this thread is the last holder
        if holds and holds.pop() == _HOLD_RECV:
            recorder.submit(rec)
        return
    recorder.submit_first(rec)  # the forward's consumer wait follows (or its absence, with a reason)
    try:
        last = holds.pop() == _HOLD_RECV
    except IndexError:
        return
    if last:  # the forward released it while the task was being shipped
        recorder.submit_consumer(rec, REASON_WAITED)


def release(rt: Runtime, rec: Any, reason: int = REASON_WAITED) -> None:
    """The forward side drops its hold (after its consumer wait, or for ``reason`` without one)."""
    try:
        last = rec.holds.pop() == _HOLD_RECV
    except IndexError:
        return
    if last:
        rt.recorder.submit_consumer(rec, reason)


# ---- recv / send thread ---------------------------------------------------------------------------


def _record_head(p: str) -> str:
    """The part of :func:`enqueue_rule` both task kinds share: a pooled record, queue identity and counters."""
    return f"""
try:
    {p}rec = {p}pool.pop()
except {p}IndexError:
    {p}rec = {p}new_record()
{p}worker = {p}st.worker
{p}rec.queue = {p}st.info
{p}rec.seq = {p}enqueued = {p}st.enqueued
{p}rec.queue_depth_at_enqueue = {p}enqueued - {p}st.dequeued
{p}rec.inflight_at_enqueue = {p}enqueued - {p}st.completed
"""


def take_rule(p: str, layer: str, save_layer: str, tasks: str, gate: str) -> str:
    """THE record take of a recv enqueue (part of :func:`enqueue_rule`): a pooled record filled from our queue
    and worker state and the task's layer id, save layer, attention gate and transfer-task list (the
    expressions ``layer``, ``save_layer``, ``gate``, ``tasks``), and the gate-id rule. Only our own objects
    are written, and our own ``_kvtrace_gate_id`` attribute of the gate. ``_probes.Take`` (``NATIVE_TAKE``)
    is this rule in C, statement by statement, with no bytecode per field; without the extension the rule's
    text is inlined instead (``tests/instrument/test_enqueue_take.py`` holds the two equal)."""
    return _record_head(p) + f"""
if not {p}worker.driven:  # no start_load_kv: a repeated layer starts a new step
    {p}seen = {p}worker.seen_layers
    if {layer} in {p}seen:
        {p}worker.step += 1
        {p}seen.clear()
    {p}seen.add({layer})
{p}rec.layer_id = {layer}
{p}rec.final_layer = {layer} == {p}st.final_layer_id
{p}rec.wait_for_save_layer = {save_layer}
{p}gate = {gate}
if {p}gate is not None:
    try:
        {p}gid = {p}gate.__dict__.get({GATE_ID_ATTR!r})
    except {p}AttributeError:  # a gate without __dict__ (slots) cannot keep its id: none recorded
        pass
    else:
        if {p}gid is None:  # the one home of the gate-id rule: the forward layer that created the gate
            {p}gid = {p}worker.forward_layer
            if {p}gid < 0:
                {p}gid = {p}st.gates_seen
            {p}st.gates_seen += 1
            {p}setattr({p}gate, {GATE_ID_ATTR!r}, {p}gid)
        {p}rec.gate_id = {p}gid
{p}tasks = {tasks}
if {p}tasks:  # upstream clears the list after the task: keep its elements (one task as is)
    {p}rec.transfer_tasks = {p}tasks[0] if {p}len({p}tasks) == 1 else {p}list({p}tasks)
{p}rec.step = {p}worker.step
{p}rec.holds.append({_HOLD_RECV})
"""


def native_probe(name: str) -> Any:
    """``_probes.<name>`` (``Take``: :func:`take_rule` in C, ``GateAfter``: :func:`gate_rule`, ``SaveAfter``:
    ``rewrite.save_rule``), or None when the optional extension is not built."""
    try:
        from otel_kvtrace.instrument import _probes  # type: ignore[attr-defined]
    except ImportError:
        return None
    return getattr(_probes, name, None)


NATIVE_TAKE: Any = native_probe("Take")
"""The native record take of the enqueue (``None``: :func:`take_rule` is inlined). Read when the enqueue's text
is generated (:func:`enqueue_rule`: the compiled templates at ``rewrite``'s import, the wrapper's at install)
and when its closure is made (:func:`make_take`); a test that sets it to None swaps the templates too."""


def make_take(recorder: Any) -> Any:
    """The ``take`` of one recorder's enqueues: ``NATIVE_TAKE`` over its pool, or None without the extension."""
    if NATIVE_TAKE is None:
        return None
    return NATIVE_TAKE(recorder._pool, TaskRecord, TaskRecord, QueueState, WorkerState, GATE_ID_ATTR)


def enqueue_rule(p: str, self_name: str, item_name: str, native: bool | None = None) -> str:
    """THE record set-up of one enqueue (``Recorder.new_record`` and the gate-id rule inlined), as
    statements over names prefixed ``p`` (``st``, ``rec``, and the closure's ``recorder``, ``clock``,
    ``pool``, ``rt``, ``queue_state``, ``take``, builtins), the queue ``self_name`` and the task ``item_name``;
    ``st`` is left None when the task is not traced. :func:`wrap_add_request` (``p=""``) and the compiled
    ``add_request`` (``rewrite.compile_add_request``, ``p="__kvtrace_"``) are both generated from it: one
    definition. The forward thread pays for every line of it. A recv task's record comes from
    :func:`take_rule`: one call of the native take (``native``; default: ``NATIVE_TAKE`` is built), else that
    rule's text inline."""
    s, item = self_name, item_name
    if native is None:
        native = NATIVE_TAKE is not None
    if native:
        take = (f"{p}rec = {p}take({p}st, {p}layer_id, {item}.wait_for_save_layer, {item}.transfer_tasks, "
                f"{item}.attention_start_gate)\n")
    else:
        take = take_rule(p, f"{p}layer_id", f"{item}.wait_for_save_layer", f"{item}.transfer_tasks",
                         f"{item}.attention_start_gate")
    return f"""
{p}st = {s}.__dict__.get({STATE_ATTR!r}) or {p}queue_state({s}, {p}rt)
if {p}st.is_send:
{indent_rule(_record_head(p), 4)}
    {p}rec.kind = {_SEND}
    {p}rec.layer_id = {p}worker.forward_layer
    {p}rec.transfer_tasks = {p}list({item}) if {item} else None  # the sender clears the worker's list
    {p}rec.step = {p}worker.step
    {p}rec.holds.append({_HOLD_RECV})
    {p}st.send_fifo.append(({p}id({item}), {p}rec))
else:
    {p}layer_id = {item}.layer_id
{indent_rule(take, 4)}
    try:
        {item}._kvtrace = {p}rec
    except {p}AttributeError:  # a slotted task type cannot carry its record: not traced
        {p}recorder.recycle([{p}rec])
        {p}st = None
    else:
        if {p}st.consumer_tracking:
            {p}rec.holds.append({_HOLD_CONSUMER})
            {p}st.worker.step_records[{p}layer_id] = {p}rec
if {p}st is not None:
    {p}st.enqueued = {p}rec.seq + 1
    {p}rec.t_enqueue = {p}clock()
"""


def enqueue_undo(p: str, item_name: str) -> str:
    """THE undo of :func:`enqueue_rule` when upstream's enqueue raised (its ``put`` refused the task), over
    the same names: the task was never queued, so nothing of it may stay. The record is taken back only if
    no dequeue took it first (``deque.pop`` / ``dict.pop`` are atomic: exactly one side gets it): then the
    send FIFO entry, the consumer's ``step_records`` entry and the task's ``_kvtrace`` attribute are removed,
    ``st.enqueued`` rolled back (the next task's seq, queue depth and in-flight count are as if the refused
    one never came) and the record recycled. Not undone: the step / seen-layer inference of a worker without
    ``start_load_kv`` and a gate id handed out (both keep their meaning). Both paths are generated from it."""
    return f"""
if {p}st is not None:
    {p}mine = False
    if {p}st.is_send:
        try:
            {p}last = {p}st.send_fifo.pop()
        except {p}IndexError:  # the sender took it: it was queued after all
            {p}last = None
        if {p}last is not None:
            if {p}last[1] is {p}rec:
                {p}mine = True
            else:
                {p}st.send_fifo.append({p}last)
    else:
        try:
            {p}mine = {item_name}.__dict__.pop({"_kvtrace"!r}, None) is {p}rec
        except {p}AttributeError:
            {p}mine = False
        if {p}mine and {p}st.worker.step_records.get({p}layer_id) is {p}rec:
            {p}st.worker.step_records.pop({p}layer_id)
    if {p}mine:
        {p}st.enqueued -= 1
        {p}recorder.recycle([{p}rec])
"""


def _add_request_source(native: bool) -> str:
    return f"""
def make(original, rt, recorder, clock, pool, new_record, queue_state, take):
    def add_request(self, item, *args, **kwargs):
        st = None
        if item is not None and recorder.enabled:
            try:
{indent_rule(enqueue_rule("", "self", "item", native), 16)}
            except Exception as exc:
                rt.fail(exc)
                st = None
        try:
            if args or kwargs:
                return original(self, item, *args, **kwargs)
            return original(self, item)  # the upstream call: no ``*``/``**`` re-packing (half this frame's cost)
        except BaseException:
            try:
{indent_rule(enqueue_undo("", "item"), 16)}
            except Exception as exc:
                rt.fail(exc)
            raise
    return add_request
"""


_ADD_REQUEST_SOURCE = {native: _add_request_source(native) for native in (False, True)}
"""The enqueue wrapper's text, with the record take inlined (False) or native (True): see :func:`enqueue_rule`."""


def wrap_add_request(original: Callable, rt: Runtime) -> Callable:
    """The enqueue wrapper (:func:`enqueue_rule`), for a class whose ``add_request`` is not compiled."""
    recorder = rt.recorder
    take = make_take(recorder)
    add_request = generated("add_request", take is not None)(original, rt, recorder, recorder.clock, recorder._pool,
                                                             TaskRecord, attach.queue_state, take)
    return _mark(add_request, original)


def wrap_handle_request(original: Callable, rt: Runtime) -> Callable:
    recorder = rt.recorder
    clock = recorder.clock

    def _handle_request(self: Any, item: Any, *args: Any, **kwargs: Any) -> Any:
        if not recorder.enabled or item is None:
            return original(self, item, *args, **kwargs) if args or kwargs else original(self, item)
        t_dequeue = clock()
        rec = None
        st = None
        try:
            st = self.__dict__.get(STATE_ATTR) or attach.queue_state(self, rt)
            if st.thread_ident != get_ident():
                attach.bind_thread(st, rt)
            if st.is_send:  # plain lists: matched by FIFO position, checked by identity
                fifo = st.send_fifo
                rec = fifo.popleft()[1] if fifo and fifo[0][0] == id(item) else None
            else:
                try:
                    rec = item.__dict__.pop("_kvtrace", None)
                except AttributeError:  # no __dict__
                    rec = None
            if rec is not None and rec.queue is not st.info and getattr(rec.queue, "run_id", None) != st.info.run_id:
                rec = None  # enqueued under an earlier tracing session
            if rec is None:  # enqueued before tracing started, or put() on request_queue directly
                st.untraced += 1
            else:
                rec.t_dequeue = t_dequeue
                st.dequeued += 1
                st.current = rec
        except Exception as exc:
            rt.fail(exc)
            rec = None
        try:
            result = original(self, item, *args, **kwargs) if args or kwargs else original(self, item)
        except BaseException as exc:
            if rec is not None:
                try:
                    rec.outcome = _ERROR
                    rec.error = exc
                    if rec.t_complete == NO_TIME:
                        rec.t_complete = clock()
                except Exception as inner:
                    rt.fail(inner)
            raise
        finally:
            if rec is not None and st is not None:
                try:
                    st.current = None
                    st.completed += 1
                    if rec.outcome != _ERROR:
                        if rec.t_backend_return == NO_TIME:
                            rec.outcome = _EMPTY
                        elif rec.backend_result:  # failed copy that did not raise (0.23)
                            rec.outcome = _ERROR
                            rec.error = BackendResultError(rec.backend_result)
                    if rec.t_complete == NO_TIME:  # the load event was not set through its proxy
                        rec.t_complete = clock()
                    holds = rec.holds
                    if len(holds) < 2:  # release_recv's common case, inlined: no consumer hold left
                        if holds and holds.pop() == _HOLD_RECV:
                            recorder.submit(rec)
                    else:
                        release_recv(rt, rec)
                except Exception as exc:
                    rt.fail(exc)
        return result

    return _mark(_handle_request, original)


def _stage_wrapper(stage: int, rt: Runtime, original: Callable, name: str) -> Callable:
    clock = rt.recorder.clock
    state_by_thread = rt.state_by_thread

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = state_by_thread.get(get_ident())
        if st is None or st.current is None:
            return original(self, *args, **kwargs)
        t0 = clock()
        try:
            return original(self, *args, **kwargs)
        finally:
            rec = st.current
            if rec is not None:
                rec.stages.extend((stage, t0, clock()))

    wrapper.__name__ = name
    return _mark(wrapper, original)


def wrap_stagger(original: Callable, rt: Runtime) -> Callable:
    # Recorded on every call, also when h2d_stagger_us == 0 makes it a no-op (a zero-length span that
    # shows the stagger point was passed); the virtual replica does the same.
    return _stage_wrapper(H2D_STAGGER, rt, original, "_stagger_h2d_submit")


def wrap_batch_copy(original: Callable, rt: Runtime) -> Callable:
    clock = rt.recorder.clock
    state_by_thread = rt.state_by_thread

    def _batch_copy_with_limits(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = state_by_thread.get(get_ident())
        rec = st.current if st is not None else None
        if rec is None:
            return original(self, *args, **kwargs)
        t0 = clock()
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            if st.stagger_at_submit:
                rec.stages.extend((H2D_STAGGER, t0, t0))
            rec.stages.extend((BACKEND_SUBMIT, t0, clock()))
            rec.backend_result = -1
            raise
        t1 = clock()
        if st.stagger_at_submit:  # the no-op stagger ran just before (attach._skip_noop_stagger)
            rec.stages.extend((H2D_STAGGER, t0, t0, BACKEND_SUBMIT, t0, t1))
        else:
            rec.stages.extend((BACKEND_SUBMIT, t0, t1))
        rec.t_backend_return = t1  # completion starts only after a normal return
        if type(result) is int:
            rec.backend_result = result
        sizes = args[2] if len(args) > 2 else kwargs.get("sizes")
        if sizes is not None:  # one home for lists and numpy arrays (small ones summed via tolist())
            rec.nbytes += total_bytes(sizes)
        return result

    return _mark(_batch_copy_with_limits, original)


# ---- attention gate -------------------------------------------------------------------------------


GATE_STAMP_ATTR = "_kvtrace_gate"  # on a gate: (first record ns, StreamPosition, timing mark or None)
_NO_DICT = {GATE_STAMP_ATTR: None}  # what a gate without ``__dict__`` reads as: already stamped, so never stamped


def gate_record_rule(original: Callable, rt: Runtime) -> Callable:
    """THE gate's record wrapper: stamp the first record of a gate (time, stream position, device mark) before
    the original notifies (a waiter woken by it must see the stamp). The reference of ``_probes.GateRecord``
    (:data:`NATIVE_GATE_RECORD`), which runs it in C on the forward thread and hands it the calls that want a
    device-timing mark (``rt.npu_timing_wanted``); ``tests/instrument/test_gate_record.py`` holds the two equal.
    A gate without ``__dict__`` (slots) gets no stamp: its waiters record it as opened before tracing
    (``gate_stamp`` returns None), never an error in the caller."""
    clock = rt.recorder.clock

    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_event", None) is None and rt.recorder.enabled and \
                GATE_STAMP_ATTR not in getattr(self, "__dict__", _NO_DICT):
            try:
                recorded = clock()
                log = rt.stream_log  # stream_order.next_position, inlined (forward-thread frames)
                done_by = log.done_by
                if len(done_by) >= MAX_EVENTS_PER_LOG:
                    log = rt.stream_log = StreamLog()
                    done_by = log.done_by
                done_by.append(FAR_FUTURE)
                position = StreamPosition(log, len(done_by) - 1)
                mark = None
                if rt.npu_timing_wanted:
                    timing = attach.npu_timing_for(rt)
                    if timing is not None:
                        # Recorded just before the gate's own event on the same stream, with no work in
                        # between, so the device reaches both at the same point.
                        mark = timing.mark(*args, **kwargs)
                setattr(self, GATE_STAMP_ATTR, (recorded, position, mark))
            except Exception as exc:
                rt.fail(exc)
        return original(self, *args, **kwargs)

    return record


NATIVE_GATE_RECORD: Any = native_probe("GateRecord")
"""The native gate record wrapper (``None``: :func:`gate_record_rule`'s Python function is installed)."""


def wrap_gate_record(original: Callable, rt: Runtime) -> Callable:
    """P7: the gate's ``record``, :func:`gate_record_rule` (in C when the extension is built)."""
    record = gate_record_rule(original, rt)
    if NATIVE_GATE_RECORD is not None:
        record = NATIVE_GATE_RECORD(original, rt, rt.recorder.clock, record, GATE_STAMP_ATTR, StreamLog,
                                    StreamPosition, MAX_EVENTS_PER_LOG, FAR_FUTURE)
    return _mark(record, original)


_GATE_BITS = (1 << DEP_GATE_RECORD) | (1 << DEP_GATE_NPU)
_GATE_RECORD_LO = 2 * DEP_GATE_RECORD
_GATE_NPU_LO = 2 * DEP_GATE_NPU


def gate_rule(p: str, gate: str) -> str:
    """THE gate-dependency rule, as statements over names prefixed ``p``: after a successful ``wait()`` of the
    gate ``gate`` that ran from ``g0`` to ``g1`` (its record stamp read first: ``gstamp``), the condition wait until
    the record was seen, then the NPU synchronize; the record time is exact, the NPU completion bounded
    (tightened by stream order: ``StreamLog.observe`` inlined). The wrapper below (``p=""``) and the
    compiled probes (``rewrite._GATE_AFTER``, ``p="__kvtrace_"``) are both generated from this text: one
    definition, no frame of its own on either path (TaskRecord.dep_exact/dep_bounds inlined too).
    ``_probes.GateAfter`` (``NATIVE_GATE``) is this rule in C, statement by statement, called once in its place
    (``gate_after(rec, gate, g0, g1, stages)``); without the extension the text is inlined
    (``tests/instrument/test_gate_after.py`` holds the two equal; :func:`gate_after_rule` is the text as a
    function, the C's fallback and the tests' reference)."""
    return f"""
try:
    {p}gstamp = {gate}.__dict__.get({GATE_STAMP_ATTR!r})
except {p}AttributeError:  # a gate without __dict__ (slots): as if recorded before tracing
    {p}gstamp = None
{p}deps = {p}rec.deps
{p}rec.has_dep |= {_GATE_BITS}
if {p}gstamp is None:  # recorded before tracing started (or a gate without __dict__): only our own wait bounds it
    {p}stages += ({GATE_NPU_SYNC}, {p}g0, {p}g1)
    {p}deps[{_GATE_RECORD_LO}] = {p}deps[{_GATE_NPU_LO}] = {p}rec.t_enqueue
    {p}deps[{_GATE_RECORD_LO + 1}] = {p}g0
    {p}deps[{_GATE_NPU_LO + 1}] = {p}g1
else:
    {p}grec, {p}gpos, {p}gmark = {p}gstamp
    {p}gcond = {p}grec if {p}grec < {p}g1 else {p}g1  # max(g0, min(grec, g1)) without two builtin calls
    if {p}gcond < {p}g0:
        {p}gcond = {p}g0
    if {p}gcond > {p}g0:
        {p}stages += ({GATE_COND_WAIT}, {p}g0, {p}gcond, {GATE_NPU_SYNC}, {p}gcond, {p}g1)
    else:
        {p}stages += ({GATE_NPU_SYNC}, {p}gcond, {p}g1)
    {p}glog = {p}gpos.log
    {p}gp = {p}gpos.position
    if {p}g1 < {p}glog.done_by[{p}gp]:
        {p}glog.done_by[{p}gp] = {p}g1
    if {p}gp > {p}glog.observed:
        {p}glog.observed = {p}gp
    {p}deps[{_GATE_RECORD_LO}] = {p}deps[{_GATE_RECORD_LO + 1}] = {p}deps[{_GATE_NPU_LO}] = {p}grec
    {p}deps[{_GATE_NPU_LO + 1}] = {p}g1
    {p}rec.npu_marks.append(({DEP_GATE_NPU}, {p}gpos))  # tightened to the earliest later completion
    if {p}gmark is not None:
        {p}rec.npu_marks.append(({DEP_GATE_NPU}, {p}gmark))
"""


_GATE_AFTER_SOURCE = f"""
def make():
    def gate_after(rec, gate, g0, g1, stages):
{indent_rule(gate_rule("", "gate"), 8)}
    return gate_after
"""


def gate_after_rule() -> Callable:
    """:func:`gate_rule`'s text as the function ``gate_after(rec, gate, g0, g1, stages)`` (compiled once, its lines in
    ``linecache``): what ``_probes.GateAfter`` hands a stamp it does not take (not None, not a tuple of three),
    and the reference ``tests/instrument/test_gate_after.py`` compares it with."""
    return generated("gate_after")()


NATIVE_GATE: Any = native_probe("GateAfter")
"""The native gate rule (``None``: :func:`gate_rule` is inlined). Read when the gate stamps' text is generated
(``rewrite._GATE_AFTER`` at ``rewrite``'s import, the wrapper's at install) and when the callable is made
(:func:`make_gate_after`); a test that sets it to None swaps ``rewrite._GATE_AFTER`` too."""


def make_gate_after() -> Any:
    """``NATIVE_GATE`` over the rule's own constants and types, or None without the extension."""
    if NATIVE_GATE is None:
        return None
    return NATIVE_GATE(gate_after_rule(), TaskRecord, StreamLog, StreamPosition, GATE_STAMP_ATTR, GATE_COND_WAIT,
                       GATE_NPU_SYNC, DEP_GATE_NPU, _GATE_BITS, _GATE_RECORD_LO, _GATE_NPU_LO)


def _gate_wait_source(native: bool) -> str:
    rule = "gate_after(rec, self, g0, g1, stages)\n" if native else gate_rule("", "self")
    return f"""
def make(original, clock, state_by_thread, get_ident, rt, gate_after):
    def wait(self, *args, **kwargs):
        st = state_by_thread.get(get_ident())
        if st is None or st.current is None:
            return original(self, *args, **kwargs)
        g0 = clock()
        ok = original(self, *args, **kwargs)
        g1 = clock()
        try:
            rec = st.current
            if rec is not None:
                stages = rec.stages
                if not ok:  # timed out waiting for the record
                    stages += ({GATE_COND_WAIT}, g0, g1)
                else:
{indent_rule(rule, 20)}
        except Exception as exc:
            rt.fail(exc)
        return ok
    return wait
"""


_GATE_WAIT_SOURCE = {native: _gate_wait_source(native) for native in (False, True)}
"""The gate wait wrapper's text, with the gate rule inlined (False) or native (True): see :func:`gate_rule`."""


def wrap_gate_wait(original: Callable, rt: Runtime) -> Callable:
    """Stages and dependencies of one gate ``wait()`` (:func:`gate_rule`) on a recv thread of the wrapper path."""
    gate_after = make_gate_after()
    wait = generated("gate_wait", gate_after is not None)(original, rt.recorder.clock, rt.state_by_thread, get_ident,
                                                          rt, gate_after)
    return _mark(wait, original)


# ---- KVPoolWorker (forward side) ------------------------------------------------------------------


def wrap_start_load_kv(original: Callable, rt: Runtime) -> Callable:
    def start_load_kv(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rt.recorder.enabled:
            try:
                ws = attach.worker_state(self, rt)
                if ws.driven or ws.seen_layers:  # seen_layers: tasks recorded before the first step began
                    ws.step += 1
                    ws.seen_layers.clear()
                ws.driven = True
                rt.stream_log = StreamLog()  # NPU events of this step, in stream order
                leftovers = list(ws.step_records.values())
                ws.step_records.clear()
                for rec in leftovers:  # the forward never waited for these: stop holding them
                    release(rt, rec, REASON_STEP_BOUNDARY)
            except Exception as exc:
                rt.fail(exc)
        return original(self, *args, **kwargs)

    return _mark(start_load_kv, original)


def wrap_wait_for_layer_load(original: Callable, rt: Runtime) -> Callable:
    recorder = rt.recorder

    def wait_for_layer_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        ws = None
        layer = -1
        if rt.recorder.enabled:
            try:
                ws = self.__dict__.get(WORKER_ATTR) or attach.worker_state(self, rt)  # one frame less per layer
                layer = getattr(self, "current_layer", -1)
                ws.forward_layer = layer
            except Exception as exc:
                rt.fail(exc)
                ws = None
        try:
            return original(self, *args, **kwargs) if args or kwargs else original(self)  # upstream: no arguments
        finally:
            if ws is not None:
                try:
                    rec = ws.step_records.pop(layer, None)
                    if rec is not None:  # release(), inlined: the forward pays for every frame
                        try:
                            last = rec.holds.pop() == _HOLD_RECV
                        except IndexError:
                            last = False
                        if last:
                            recorder.submit_consumer(rec, REASON_WAITED)
                except Exception as exc:
                    rt.fail(exc)

    return _mark(wait_for_layer_load, original)


def wrap_save_kv_layer(original: Callable, rt: Runtime) -> Callable:
    def save_kv_layer(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rt.recorder.enabled:
            try:
                ws = self.__dict__.get(WORKER_ATTR) or attach.worker_state(self, rt)
                ws.forward_layer = getattr(self, "current_layer", -1)
            except Exception as exc:
                rt.fail(exc)
        return original(self, *args, **kwargs)

    return _mark(save_kv_layer, original)


def wrap_start_threads(original: Callable, rt: Runtime) -> Callable:
    def _start_kv_transfer_threads(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if rt.recorder.enabled:
            try:
                attach.attach_worker(self, rt)
            except Exception as exc:
                rt.fail(exc)
        return result

    return _mark(_start_kv_transfer_threads, original)
