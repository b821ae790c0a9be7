"""One patch-point table (instrument/points.py) drives both the patcher and `kvtrace doctor`: the same rows,
the same `required` column, and the patcher enforces it the way doctor reports it."""

from __future__ import annotations

import pytest

from otel_kvtrace.instrument import patches, points, upstream
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.targets import Targets
from otel_kvtrace.record.recorder import Recorder
from otel_kvtrace.replica import replica_targets


def test_doctor_and_patcher_read_the_same_rows() -> None:
    assert upstream.PATCH_POINTS is points.PATCH_POINTS
    assert set(patches.PATCH_POINTS) <= set(points.PATCH_POINTS)
    assert [p for p in points.PATCH_POINTS if p.wrapper] == list(patches.PATCH_POINTS)
    for p in points.PATCH_POINTS:
        assert p.role in upstream.CLASS_ROLES, p
        assert not p.core or p.required, f"{p.id}: a core point is required for doctor too"
        if p.wrapper:
            assert callable(patches._wrapper(p)), f"{p.id}: no wrapper {p.wrapper}"
            assert p.role in points.TARGET_ROLES and p.member != "__init__", p
    ids = [p.id for p in points.PATCH_POINTS]
    assert len(ids) == len(set(ids))


def _targets(source: str, **replace: object) -> Targets:
    t = Targets.coerce(replica_targets("main"))
    t.source = source
    for key, value in replace.items():
        setattr(t, key, value)
    return t


def test_a_missing_required_point_stops_upstream_targets_only() -> None:
    base = Targets.coerce(replica_targets("main")).gate_class

    class GateWithoutRecord(base):  # type: ignore[misc, valid-type]
        record = None  # as if vLLM-Ascend had renamed it: P7 (required, not core)

    rt = Runtime(recorder=Recorder(), run_id="t")
    with pytest.raises(LookupError, match="P7"):
        patches.install(_targets("upstream", gate_class=GateWithoutRecord), rt)
    installed = patches.install(_targets("replica", gate_class=GateWithoutRecord), rt)  # stage absent, fine
    try:
        assert {(p.owner, p.attr) for p in installed} >= {(GateWithoutRecord, "wait")}
    finally:
        patches.uninstall(installed)


def test_every_required_wrapped_point_is_installed_on_complete_targets() -> None:
    rt = Runtime(recorder=Recorder(), run_id="t")
    installed = patches.install(_targets("upstream"), rt)
    try:
        wrapped_members = {p.attr for p in installed}
        for p in patches.PATCH_POINTS:
            if p.required:
                assert p.member in wrapped_members, p
    finally:
        patches.uninstall(installed)
