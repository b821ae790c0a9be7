"""Scheduling policies: one small class per policy, one method, looked up by name in a registry.

A policy decides what the recv thread serves next. ``select(state, now)`` returns a list of task
indices (served now to completion, as one batch, blocking in their waits), a 1-tuple ``(i,)`` (run task
``i`` until it completes or reaches a dependency not met yet, then set it aside: cooperative), or a
time to wake up at (``INF``: the next arrival).
Subclasses register themselves under ``name`` (the exact string the CLI accepts); the modules in
``otel_kvtrace.whatif.policies`` are imported automatically, so adding a policy is adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from otel_kvtrace.whatif.engine import QueueState

INF = 1 << 62
"""Wake-up time meaning "at the next arrival"; larger than any replayed time."""


class Policy:
    """Base class: set ``name``, implement ``select``. ``uses_ready_index`` asks the engine to keep
    arrived tasks indexed by when they can next make progress (``state.ready`` / ``state.waiting``).
    ``probes_head``: the live ``get()`` checks the head's waits on every dequeue, a cost FIFO does not
    pay (:mod:`otel_kvtrace.whatif.decision` sizes it from the FIFO recording)."""

    name: ClassVar[str] = ""
    uses_ready_index: ClassVar[bool] = False
    probes_head: ClassVar[bool] = False
    _registry: ClassVar[dict[str, type[Policy]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            if cls.name in Policy._registry and Policy._registry[cls.name] is not cls:
                raise ValueError(f"policy {cls.name!r} registered twice")
            Policy._registry[cls.name] = cls

    def select(self, state: QueueState, now: int) -> list[int] | tuple[int] | int:
        """Indices to serve now (one batch), ``(i,)`` to advance one task, or the time to wake up at."""
        raise NotImplementedError


def _load_builtin() -> None:
    import otel_kvtrace.whatif.policies as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{info.name}")


def policy_names() -> list[str]:
    """Registered policy names, ``fifo`` first."""
    _load_builtin()
    names = sorted(Policy._registry)
    if "fifo" in names:
        names.remove("fifo")
        names.insert(0, "fifo")
    return names


def get_policy(name: str) -> Policy:
    """A fresh instance of the policy registered as ``name``."""
    _load_builtin()
    cls = Policy._registry.get(name)
    if cls is None:
        raise ValueError(f"policy: unknown {name!r}; choose from {', '.join(policy_names())}")
    return cls()
