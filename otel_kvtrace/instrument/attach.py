"""Per-instance attachment: queue/worker state and the proxies that replace collaborators in place.

Attachment happens once per object, off the per-task path: from the ``_start_kv_transfer_threads``
post-hook when the worker is instrumented, otherwise lazily at a thread's first ``add_request`` or
``_handle_request``. Everything replaced is remembered in ``QueueState.undo`` for an exact restore.
"""

from __future__ import annotations

import os
import sys
import types
from threading import get_ident
from typing import Any

from otel_kvtrace.instrument.npu_timing import NpuTiming
from otel_kvtrace.instrument.points import class_path
from otel_kvtrace.instrument.proxies import (
    DirectSetLoadEvent,
    DirectWaitSaveEvent,
    TracedBuilder,
    TracedKeyStore,
    TracedLoadEvent,
    TracedNpuEvent,
    TracedSaveEvent,
    _Proxy,
    traced_slot_waiter,
)
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.state import QueueState, WorkerState
from otel_kvtrace.record.model import QueueInfo

STATE_ATTR = "_kvtrace_state"
GATE_ID_ATTR = "_kvtrace_gate_id"  # on an attention gate: the forward layer that created it
WORKER_ATTR = "_kvtrace_worker"
COMPILED_ATTR = "__kvtrace_compiled__"  # on a _handle_request / add_request built by instrument/rewrite.py
FALLBACK_ATTR = "__kvtrace_fallback__"  # on the wrapper installed instead of a compiled method: why


def thread_path(thread: Any) -> str:
    """``key`` for the key-based recv/send threads, ``gva`` otherwise (upstream class naming)."""
    override = getattr(thread, "kvtrace_path", None)
    return override if override in ("gva", "key") else class_path(type(thread))


def is_send_thread(thread: Any) -> bool:
    return "Send" in type(thread).__name__


def worker_state(worker: Any, rt: Runtime) -> WorkerState:
    """The worker's ``WorkerState``; creating it also adopts the worker's transfer threads."""
    state = worker.__dict__.get(WORKER_ATTR)
    if state is None:
        state = WorkerState()
        setattr(worker, WORKER_ATTR, state)
        rt.workers.append(worker)
        attach_worker(worker, rt)
    return state


def _ranks(owner: Any) -> dict[str, int]:
    def rank(*names: str) -> int:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
        return 0

    return {
        "dp": rank("dp_rank"),
        "pp": rank("pp_rank"),
        "tp": rank("tp_rank"),
        "pcp": rank("pcp_rank"),
        "dcp": rank("dcp_rank"),
    }


def _queue_info(thread: Any, worker: Any, rt: Runtime) -> QueueInfo:
    ranks = _ranks(worker if worker is not None else thread)
    if worker is None:
        ranks["tp"] = getattr(thread, "tp_rank", ranks["tp"]) or 0
    num_layers = int(getattr(thread, "num_layers", 0) or getattr(worker, "num_layers", 0) or 0)
    return QueueInfo(
        run_id=rt.run_id,
        path=thread_path(thread),
        thread_name=str(getattr(thread, "name", "recv")),
        pid=os.getpid(),
        num_layers=num_layers,
        **ranks,
    )


def queue_state(thread: Any, rt: Runtime, worker: Any = None) -> QueueState:
    """The thread's ``QueueState``, attaching the thread on first use."""
    state = thread.__dict__.get(STATE_ATTR)
    if state is not None:
        return state
    ws = worker_state(worker, rt) if worker is not None else WorkerState()
    state = thread.__dict__.get(STATE_ATTR)  # worker_state() may just have attached it
    if state is not None:
        return state
    info = _queue_info(thread, worker, rt)
    final_layer = getattr(thread, "final_layer_id", None)
    state = QueueState(
        info=info,
        worker=ws,
        is_send=is_send_thread(thread),
        final_layer_id=int(final_layer) if isinstance(final_layer, int) else info.num_layers - 1,
        consumer_tracking=worker is not None and not is_send_thread(thread),
    )
    setattr(thread, STATE_ATTR, state)
    state.undo.append((thread, STATE_ATTR, None))
    rt.queues.append(state)
    _attach_thread_collaborators(thread, state, rt)
    return state


def bind_thread(state: QueueState, rt: Runtime) -> None:
    """Remember which OS thread runs this queue (proxies act only on that thread)."""
    ident = get_ident()
    if state.thread_ident:
        rt.state_by_thread.pop(state.thread_ident, None)
    state.thread_ident = ident
    rt.state_by_thread[ident] = state


def npu_timing_for(rt: Runtime, event_type: Any = None) -> NpuTiming | None:
    """The session's device-time mapper, created once, at attach time (never per task).

    The event class comes from the first NPU event seen, else from ``Targets.npu_event_class``, else
    from an already imported ``torch.npu.Event``; with none of them, timing stays off (bounds only).
    """
    if not rt.npu_timing_wanted:
        return None
    if rt.npu_timing is None:
        event_type = event_type or rt.npu_event_class or _imported_torch_npu_event()
        if event_type is None:
            return None
        rt.npu_timing = NpuTiming(event_type, rt.recorder.clock)  # applied by Runtime.resolve
    return rt.npu_timing


def _imported_torch_npu_event() -> Any:
    torch = sys.modules.get("torch")  # never import torch ourselves
    npu = getattr(torch, "npu", None) if torch is not None else None
    return getattr(npu, "Event", None)


def _replace_items(lst: Any, make: Any, state: QueueState) -> None:
    if not isinstance(lst, list):
        return
    for index, item in enumerate(lst):
        if isinstance(item, _Proxy):
            continue
        lst[index] = make(index, item)
        state.undo.append((lst, index, item))


def has_compiled_probes(thread: Any) -> bool:
    """True when the thread's class runs the compiled ``_handle_request`` (``instrument/rewrite.py``)."""
    return getattr(getattr(type(thread), "_handle_request", None), COMPILED_ATTR, False) is True


def _switch_class(lst: Any, base: type, direct: type) -> None:
    """Proxies of ``base`` in ``lst`` become ``direct`` (same slots; made before by another thread)."""
    if isinstance(lst, list):
        for item in lst:
            if type(item) is base:
                object.__setattr__(item, "__class__", direct)


def _attach_thread_collaborators(thread: Any, state: QueueState, rt: Runtime) -> None:
    state.compiled = not state.is_send and has_compiled_probes(thread)
    if not state.compiled and not state.is_send:
        for point_id in list(rt.deferred):  # a wrapper-path recv thread: it needs the points the probes skipped
            install = rt.deferred.pop(point_id, None)
            if install is not None:
                install()
    save_proxy = DirectWaitSaveEvent if state.compiled else TracedSaveEvent
    save_events = getattr(thread, "layer_save_finished_events", None)
    _replace_items(save_events, lambda i, ev: save_proxy(ev, rt, state), state)
    sync_events = getattr(thread, "sync_save_events", None)
    if rt.npu_timing_wanted:  # calibrate now, before the gate's first record needs a mark
        first_event = sync_events[0] if isinstance(sync_events, list) and sync_events else None
        npu_timing_for(rt, type(first_event) if first_event is not None else None)
    if isinstance(sync_events, list) and sync_events:  # shared list: whichever thread attaches first
        _replace_items(sync_events, lambda i, ev: TracedNpuEvent(ev, rt, state), state)
    if state.info.path == "key":  # the synchronous backend call of the key path: get (recv), put (send)
        store = thread.__dict__.get("m_store")
        if store is not None:
            thread.m_store = TracedKeyStore(store, rt, state)
            state.undo.append((thread, "m_store", store))
    if state.is_send:
        return
    if state.compiled:  # the probes time waits, builds, stagger, slot release and copy inline
        _switch_class(save_events, TracedSaveEvent, DirectWaitSaveEvent)
        _replace_items(getattr(thread, "layer_load_finished_events", None),
                       lambda i, ev: DirectSetLoadEvent(ev, rt, state, i), state)
        return
    _replace_items(
        getattr(thread, "layer_load_finished_events", None),
        lambda i, ev: TracedLoadEvent(ev, rt, state, i),
        state,
    )
    builders = thread.__dict__.get("group_builders")
    if isinstance(builders, list) and builders:
        thread.group_builders = [TracedBuilder(b, rt, state) for b in builders]
        state.undo.append((thread, "group_builders", builders))
    waiter = thread.__dict__.get("external_slot_release_waiter")
    if waiter is not None:
        thread.external_slot_release_waiter = traced_slot_waiter(waiter, rt, state)
        state.undo.append((thread, "external_slot_release_waiter", waiter))
    _skip_noop_stagger(thread, state)


def _skip_noop_stagger(thread: Any, state: QueueState) -> None:
    """With ``h2d_stagger_us <= 0`` upstream's ``_stagger_h2d_submit`` returns at once, right before the
    batch copy (kv_transfer.py ``_handle_request``: only array concatenation lies between them when no
    slot waiter is wired). The instance then calls the original directly (one recv-thread frame less)
    and the batch_copy wrapper records the zero-length ``h2d_stagger`` stage at its own start."""
    stagger_us = thread.__dict__.get("h2d_stagger_us")
    if type(stagger_us) not in (int, float) or stagger_us > 0:
        return
    if thread.__dict__.get("external_slot_release_waiter") is not None or "_stagger_h2d_submit" in thread.__dict__:
        return
    original = getattr(getattr(type(thread), "_stagger_h2d_submit", None), "__kvtrace_wrapped__", None)
    if original is None:  # not patched: nothing to skip
        return
    thread._stagger_h2d_submit = types.MethodType(original, thread)
    state.undo.append((thread, "_stagger_h2d_submit", None))
    state.stagger_at_submit = True


def attach_worker(worker: Any, rt: Runtime) -> None:
    """Attach both transfer threads of a worker (post-hook of ``_start_kv_transfer_threads``).

    Threads that were attached on their own before the worker was seen (tracing started after the
    threads) are adopted: they get the worker's step counter, ranks and consumer tracking, so step,
    gate ids, consumer waits and correlation ids come out as if tracing had been on from the start.
    """
    ws = worker_state(worker, rt)
    if ws.attached:
        return
    ws.attached = True
    for name in ("kv_recv_thread", "kv_send_thread"):
        thread = getattr(worker, name, None)
        if thread is None:
            continue
        state = thread.__dict__.get(STATE_ATTR)
        if state is None:
            queue_state(thread, rt, worker=worker)
        elif state.worker is not ws:
            state.worker = ws
            state.info = _queue_info(thread, worker, rt)
            state.consumer_tracking = not state.is_send
    for callback in rt.on_worker_attached:
        callback(worker)


def detach(state: QueueState) -> None:
    """Put back every object replaced for this queue, newest first."""
    for owner, key, original in reversed(state.undo):
        if isinstance(key, int):
            current = owner[key]
            if isinstance(current, _Proxy) and current._inner is original:
                owner[key] = original
        elif original is None:
            owner.__dict__.pop(key, None)
        else:
            setattr(owner, key, original)
    state.undo.clear()
