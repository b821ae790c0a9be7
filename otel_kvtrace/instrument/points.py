"""The one table of patch points: ``kvtrace doctor`` checks every row, the patcher wraps the rows with a
wrapper, and both read ``required`` the same way.

Roles are upstream's class roles (``upstream.CLASS_ROLES``). A row without a ``wrapper`` is not a
class-level wrap: a constructor argument read at attach time (``member == "__init__"``), a collaborator
proxied per instance (builder, backend), or a method only called (``raise_if_failed``).

Two levels, one column each, read the same way everywhere:

- ``core``: the task trace itself (recv enqueue, dequeue/completion). ``patches.install`` raises for
  any targets whose recv class lacks one, and doctor counts them as required too.
- ``required``: what a vLLM-Ascend binding must offer (``core`` points included) for the trace to mean
  what docs/schema.md says. Doctor reports the binding not ok when one is missing (the plugin and
  ``resolve_targets`` then refuse to trace), and ``patches.install`` raises for upstream targets
  (``Targets.source == "upstream"``) that lack one. Other targets (the replica, a test's stand-in
  classes) may omit non-core points: those stages are then absent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PatchPoint:
    """One place the instrumentation hooks into, and what it needs to find there.

    ``member`` is a method name, or ``__init__`` when the point is a constructor argument the per-instance
    wrappers read (``params`` then lists the argument names). ``wrapper`` names the factory in
    ``instrument/wrappers.py`` that wraps the method on the class ("" when nothing is wrapped there); a
    table of another concern (the live scheduler's, asynccheck's engine loop) gives the factory itself.
    """

    id: str
    role: str
    member: str
    params: tuple[str, ...]
    required: bool
    what: str
    wrapper: str | Callable[..., Callable] = ""
    core: bool = False
    # Covered by the compiled probes (instrument/rewrite.py) when the recv class's _handle_request got them:
    # not wrapped on that class then (the gate's wait: not wrapped when every recv class got them).
    probed: bool = False


#: The research note's P1-P13 (docs/compatibility.md lists what each version has).
PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint("P0", "worker", "_start_kv_transfer_threads", ("self",), True,
               "post-hook: per-instance wraps once the transfer threads exist", "wrap_start_threads"),
    PatchPoint("P1", "worker", "start_load_kv", ("self", "metadata"), True, "step counter", "wrap_start_load_kv"),
    PatchPoint("P2", "worker", "wait_for_layer_load", ("self",), True, "forward context + consumer wait",
               "wrap_wait_for_layer_load"),
    PatchPoint("P3", "recv_gva", "add_request", ("self",), True, "GVA enqueue (compiled: record set-up inline)",
               "compile_add_request", core=True),
    PatchPoint("P3k", "recv_key", "add_request", ("self",), True, "key-path enqueue", "wrap_add_request", core=True),
    PatchPoint("P4", "recv_gva", "_handle_request", ("self", "data"), True,
               "GVA dequeue / completion, and every recv stage as compiled probes", "compile_handle_request",
               core=True),
    PatchPoint("P4k", "recv_key", "_handle_request", ("self", "data"), True, "key-path dequeue / completion",
               "wrap_handle_request", core=True),
    PatchPoint("P5", "recv_gva", "__init__", ("layer_load_finished_events", "layer_save_finished_events"), True,
               "load/save event lists (proxied in place)"),
    PatchPoint("P5k", "recv_key", "__init__", ("layer_load_finished_events", "layer_save_finished_events"), True,
               "key-path load/save event lists"),
    PatchPoint("P6", "recv_gva", "__init__", ("sync_save_events",), False,
               "save NPU events synchronized by the recv thread (main only)"),
    PatchPoint("P7", "gate", "record", ("self", "stream"), True, "gate open time (first record)", "wrap_gate_record"),
    PatchPoint("P7w", "gate", "wait", ("self", "timeout"), True, "gate condition wait + NPU sync", "wrap_gate_wait",
               probed=True),
    PatchPoint("P8", "builder", "build_addrs", ("self", "shared", "layer_id"), True, "address build"),
    PatchPoint("P8b", "builder", "build", ("self", "task", "is_save"), False, "full build (no shared data)"),
    PatchPoint("P9", "recv_gva", "_stagger_h2d_submit", ("self", "layer_id"), False, "H2D stagger busy wait",
               "wrap_stagger", probed=True),
    PatchPoint("P10", "recv_gva", "__init__", ("external_slot_release_waiter",), False,
               "external slot release waiter (main only)"),
    PatchPoint("P11", "recv_gva", "_batch_copy_with_limits",
               ("self", "gvas", "addrs", "sizes", "direction", "max_transfer_blocks", "max_transfer_bytes"), True,
               "backend submit (batch_copy)", "wrap_batch_copy", probed=True),
    PatchPoint("P12", "backend", "batch_remove_lease", ("self", "keys"), False, "lease release on the final layer"),
    PatchPoint("P12k", "backend", "get", ("self", "keys", "addrs", "sizes"), False, "key-path synchronous get"),
    PatchPoint("P13", "worker", "save_kv_layer", ("self", "connector_metadata"), False, "save point (forward)",
               "wrap_save_kv_layer"),
    PatchPoint("P13a", "send_gva", "add_request", ("self",), False, "GVA save task enqueue", "wrap_add_request"),
    PatchPoint("P13ak", "send_key", "add_request", ("self",), False, "key-path save task enqueue", "wrap_add_request"),
    PatchPoint("P13s", "send_gva", "_handle_request", ("self",), False, "GVA save task on the send thread",
               "wrap_handle_request"),
    PatchPoint("P13k", "send_key", "_handle_request", ("self",), False, "key-path save task on the send thread",
               "wrap_handle_request"),
    PatchPoint("P13c", "send_gva", "_batch_copy_with_limits", ("self",), False, "save copy (GVA L2G)",
               "wrap_batch_copy"),
    PatchPoint("F1", "thread_base", "raise_if_failed", ("self",), False,
               "fatal-error propagation (main: the thread dies and callers poll it)"),
    PatchPoint("F2", "recv_gva", "__init__", ("save_failure_checker",), False, "send-failure checker (main only)"),
)

#: Class roles the patcher wraps, and the ``Targets`` field that holds their classes.
TARGET_ROLES: dict[str, str] = {
    "worker": "worker_class",
    "recv_gva": "recv_thread_classes",
    "recv_key": "recv_thread_classes",
    "send_gva": "send_thread_classes",
    "send_key": "send_thread_classes",
    "gate": "gate_class",
}


def class_path(cls: type) -> str:
    """``key`` for the key-based recv/send thread classes, ``gva`` otherwise (upstream class naming;
    a class attribute ``kvtrace_path`` overrides it)."""
    override = getattr(cls, "kvtrace_path", None)
    if override in ("gva", "key"):
        return override
    return "key" if "Key" in cls.__name__ else "gva"


def wrapped_points() -> tuple[PatchPoint, ...]:
    """The rows the patcher installs, in table order."""
    return tuple(p for p in PATCH_POINTS if p.wrapper)
