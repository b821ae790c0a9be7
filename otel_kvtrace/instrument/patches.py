"""The patch table: one list drives both instrument and uninstrument.

Each ``PatchPoint`` names a role (which class of ``Targets``), a method, the wrapper factory and whether
the point is required for a useful trace. ``kvtrace doctor`` reads the same table to report what a given
vLLM-Ascend version offers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from otel_kvtrace.instrument import wrappers
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.targets import Targets


@dataclass(slots=True, frozen=True)
class PatchPoint:
    role: str  # "recv" | "send" | "gate" | "worker"
    attr: str
    make_wrapper: Callable[[Callable, Runtime], Callable]
    required: bool
    meaning: str


PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint("recv", "add_request", wrappers.wrap_add_request, True, "enqueue time, queue depth"),
    PatchPoint("recv", "_handle_request", wrappers.wrap_handle_request, True, "dequeue, completion, current task"),
    PatchPoint("recv", "_stagger_h2d_submit", wrappers.wrap_stagger, False, "h2d_stagger busy wait (GVA)"),
    PatchPoint("recv", "_batch_copy_with_limits", wrappers.wrap_batch_copy, False, "backend_submit (GVA batch_copy)"),
    PatchPoint("send", "add_request", wrappers.wrap_add_request, False, "save task enqueue"),
    PatchPoint("send", "_handle_request", wrappers.wrap_handle_request, False, "save task run"),
    PatchPoint("send", "_batch_copy_with_limits", wrappers.wrap_batch_copy, False, "save copy (GVA L2G)"),
    PatchPoint("gate", "record", wrappers.wrap_gate_record, False, "gate record time (first wins)"),
    PatchPoint("gate", "wait", wrappers.wrap_gate_wait, False, "gate_cond_wait + gate_npu_sync"),
    PatchPoint("worker", "start_load_kv", wrappers.wrap_start_load_kv, False, "step counter"),
    PatchPoint("worker", "wait_for_layer_load", wrappers.wrap_wait_for_layer_load, False, "consumer_wait, gate ids"),
    PatchPoint("worker", "save_kv_layer", wrappers.wrap_save_kv_layer, False, "save task layer"),
    PatchPoint("worker", "_start_kv_transfer_threads", wrappers.wrap_start_threads, False, "per-instance attach"),
)

_INHERITED = object()


def classes_for(role: str, targets: Targets) -> tuple[type, ...]:
    if role == "recv":
        return tuple(targets.recv_thread_classes)
    if role == "send":
        return tuple(targets.send_thread_classes)
    if role == "gate":
        return (targets.gate_class,) if targets.gate_class is not None else ()
    if role == "worker":
        return (targets.worker_class,) if targets.worker_class is not None else ()
    raise ValueError(f"unknown role {role!r}")


@dataclass(slots=True)
class InstalledPatch:
    owner: type
    attr: str
    original: object  # the class's own attribute, or _INHERITED
    wrapper: Callable


def install(targets: Targets, rt: Runtime, points: tuple[PatchPoint, ...] = PATCH_POINTS) -> list[InstalledPatch]:
    """Wrap every patch point present on the target classes. Raises if a required one is missing.
    ``points``: another table (the scheduler's, ``otel_kvtrace.schedule.install``) through the same mechanism."""
    installed: list[InstalledPatch] = []
    try:
        for point in points:
            owners = classes_for(point.role, targets)
            if point.required and not owners:
                raise LookupError(f"no class for required role {point.role!r}")
            for owner in owners:
                current = getattr(owner, point.attr, None)
                if current is None:
                    if point.required:
                        raise LookupError(f"{owner.__qualname__}.{point.attr} not found")
                    continue
                if getattr(current, "__kvtrace_wrapped__", None) is not None:
                    # Already instrumented: a second install, or the method is inherited from another
                    # target class we just wrapped (wrapping it again would record every task twice).
                    continue
                original = owner.__dict__.get(point.attr, _INHERITED)
                wrapper = point.make_wrapper(current, rt)
                setattr(owner, point.attr, wrapper)
                installed.append(InstalledPatch(owner, point.attr, original, wrapper))
    except BaseException:
        uninstall(installed)
        raise
    return installed


def uninstall(installed: list[InstalledPatch]) -> None:
    """Undo ``install`` exactly: restore the class's own attribute, or remove ours if it was inherited."""
    for patch in reversed(installed):
        if patch.owner.__dict__.get(patch.attr) is not patch.wrapper:
            continue  # someone re-patched on top of us; leave their wrapper alone
        if patch.original is _INHERITED:
            delattr(patch.owner, patch.attr)
        else:
            setattr(patch.owner, patch.attr, patch.original)
    installed.clear()
