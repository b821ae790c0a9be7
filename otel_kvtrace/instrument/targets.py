"""Which classes to patch: the real vLLM-Ascend ones or the replica's look-alikes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Targets:
    """The classes that play upstream's roles. Any role may be missing (``None`` / empty)."""

    worker_class: type | None = None
    recv_thread_classes: tuple[type, ...] = ()
    send_thread_classes: tuple[type, ...] = ()
    gate_class: type | None = None
    # The NPU event class (``torch.npu.Event`` or the replica's fake), for OTEL_KVTRACE_NPU_TIMING marks.
    npu_event_class: Any = None
    source: str = "replica"
    version: str = ""
    flags: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def coerce(cls, value: Targets | Mapping[str, Any]) -> Targets:
        """Accept a ``Targets`` or a plain role -> class mapping (what providers may return)."""
        if isinstance(value, Targets):
            return value
        known = {f for f in cls.__slots__}  # type: ignore[attr-defined]
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown target roles: {sorted(unknown)}; known: {sorted(known)}")
        kwargs = dict(value)
        for key in ("recv_thread_classes", "send_thread_classes"):
            if key in kwargs and kwargs[key] is not None and not isinstance(kwargs[key], tuple):
                kwargs[key] = tuple(kwargs[key]) if isinstance(kwargs[key], (list, set)) else (kwargs[key],)
        return cls(**kwargs)
