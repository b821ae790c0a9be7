"""Install and uninstall the class-level wrappers of the patch-point table (``instrument/points.py``).

``patch_attr``/``uninstall`` are the one patch helper of the package: the KV tables, the scheduler's
and the engine-loop table (``asynccheck/instrument.py``) all wrap and restore through them.

The table is the one ``kvtrace doctor`` checks: every row with a ``wrapper`` is wrapped here on the
target classes of its role; ``core`` and ``required`` are enforced as the table's docstring says.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_kvtrace.instrument import attach, rewrite, wrappers
from otel_kvtrace.instrument.points import TARGET_ROLES, PatchPoint, class_path, wrapped_points
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.targets import Targets

PATCH_POINTS: tuple[PatchPoint, ...] = wrapped_points()
"""The rows this module installs (a view of ``points.PATCH_POINTS``)."""

_INHERITED = object()


def classes_for(role: str, targets: Targets) -> tuple[type, ...]:
    """The target classes playing ``role`` (a table role: ``recv_gva``, ``gate``, ...)."""
    field_name = TARGET_ROLES.get(role)
    if field_name is None:
        raise ValueError(f"role {role!r} is not wrapped at class level")
    value = getattr(targets, field_name)
    if field_name in ("recv_thread_classes", "send_thread_classes"):
        path = role.rsplit("_", 1)[1]
        return tuple(c for c in value if class_path(c) == path)
    return (value,) if value is not None else ()


def _wrapper(point: PatchPoint) -> Callable[[Callable, Runtime], Callable]:
    """The factory a row names: a ``wrappers.*`` name (the tracing table) or a callable (another table
    going through the same mechanism, e.g. the live scheduler's ``schedule/install.py:POINTS``)."""
    if callable(point.wrapper):
        return point.wrapper
    return getattr(wrappers, point.wrapper, None) or getattr(rewrite, point.wrapper)


@dataclass(slots=True)
class InstalledPatch:
    owner: type
    attr: str
    original: object  # the class's own attribute, or _INHERITED
    wrapper: Callable


def install(targets: Targets, rt: Runtime | None,
            points: tuple[PatchPoint, ...] = PATCH_POINTS) -> list[InstalledPatch]:
    """Wrap every patch point present on the target classes. Raises ``LookupError`` (and rolls back) when
    there is no recv class, or a class lacks a point it must have (``core``; ``required`` for upstream).
    ``points``: another table through the same mechanism (the scheduler's, ``otel_kvtrace.schedule.install``)."""
    if not targets.recv_thread_classes:
        raise LookupError("no class for required role 'recv'")
    strict = targets.source == "upstream"
    installed: list[InstalledPatch] = []
    try:
        for point in points:
            must = point.core or (strict and point.required)
            owners = classes_for(point.role, targets)
            if must and strict and not owners:
                raise LookupError(f"{point.id}: no class for required role {point.role!r}")
            for owner in owners:
                covered = _probed(owner, targets) if point.probed else "none"
                if covered == "some" and rt is not None:  # wrapped once a wrapper-path recv thread attaches
                    rt.deferred[point.id] = _deferred(owner, point, rt, installed)
                if covered != "none":
                    continue  # the compiled probes stamp this point inline
                if inspect.getattr_static(owner, point.member, None) is None:
                    if must:
                        raise LookupError(f"{point.id}: {owner.__qualname__}.{point.member} not found")
                    continue
                make = _wrapper(point)
                patch = patch_attr(owner, point.member, lambda current, make=make: make(current, rt))
                if patch is not None:
                    installed.append(patch)
    except BaseException:
        uninstall(installed)
        raise
    return installed


def _probed(owner: type, targets: Targets) -> str:
    """How far the compiled probes cover ``owner``'s point: ``all`` (its own ``_handle_request`` got them,
    or, for a collaborator class such as the gate, every recv class did), ``some`` (a collaborator of
    compiled and wrapper-path recv classes: wrapped when a wrapper-path thread attaches) or ``none``."""
    recv = targets.recv_thread_classes if owner not in targets.recv_thread_classes else (owner,)
    compiled = [rewrite.is_compiled(inspect.getattr_static(c, "_handle_request", None)) for c in recv]
    return "all" if all(compiled) else "some" if any(compiled) else "none"


def _deferred(owner: type, point: PatchPoint, rt: Runtime, installed: list[InstalledPatch]) -> Callable[[], None]:
    """Wrap ``point`` on ``owner`` later (into the session's own ``installed`` list, so uninstall undoes it)."""
    make = _wrapper(point)

    def install_now() -> None:
        patch = patch_attr(owner, point.member, lambda current: make(current, rt))
        if patch is not None:
            installed.append(patch)

    return install_now


def probe_paths(targets: Targets) -> dict[str, str]:
    """What an install did (for the tests and benches): per recv class ``compiled`` or ``wrappers`` (its
    ``_handle_request``), and per GVA recv class ``<class>.add_request``: ``compiled``, ``wrapper: <why>``
    (the reason the install logged) or ``not installed``."""
    paths = {c.__qualname__: "compiled" if rewrite.is_compiled(inspect.getattr_static(c, "_handle_request", None))
             else "wrappers" for c in targets.recv_thread_classes}
    for c in classes_for("recv_gva", targets):
        paths[f"{c.__qualname__}.add_request"] = enqueue_path(c)
    return paths


def enqueue_path(cls: type) -> str:
    """``compiled``, ``wrapper: <why>`` or ``not installed``: how ``cls.add_request`` is instrumented now."""
    fn = inspect.getattr_static(cls, "add_request", None)
    if rewrite.is_compiled(fn):
        return "compiled"
    if is_wrapped(fn):
        return f"wrapper: {getattr(fn, attach.FALLBACK_ATTR, None) or 'not compiled'}"
    return "not installed"


def is_wrapped(obj: object) -> bool:
    """True for a wrapper of ours: the one idempotence mark, ``__kvtrace_wrapped__`` (the original)."""
    return getattr(obj, "__kvtrace_wrapped__", None) is not None


def patch_attr(owner: type, attr: str, make: Callable[[Any], Any]) -> InstalledPatch | None:
    """Set ``owner.attr`` to ``make(current)``; ``None`` when absent or already one of ours.

    ``current`` is looked up statically (``inspect.getattr_static``: a staticmethod stays one, an
    inherited method is the base's). Already ours covers a second install and a method inherited from a
    class wrapped just before (wrapping it again would record every call twice). Undo with ``uninstall``.
    """
    current = inspect.getattr_static(owner, attr, None)
    if current is None or is_wrapped(current):
        return None
    original = owner.__dict__.get(attr, _INHERITED)
    wrapper = make(current)
    setattr(owner, attr, wrapper)
    return InstalledPatch(owner, attr, original, wrapper)


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
