"""The install table (instrument/patches.py) and the doctor's table of upstream points
(instrument/upstream.py) describe the same class-level methods: doctor never reports a method we do not
wrap, and we never wrap a method doctor does not check."""

from __future__ import annotations

from otel_kvtrace.instrument import patches, upstream

# doctor's roles -> the install table's roles; builder/backend are per-instance proxies, thread_base and
# __init__ points are attributes read at attach time, not wrapped class methods.
ROLE = {"recv_gva": "recv", "recv_key": "recv", "send_gva": "send", "send_key": "send", "gate": "gate",
        "worker": "worker"}


def _doctor_methods() -> set[tuple[str, str]]:
    return {(ROLE[p.role], p.member) for p in upstream.PATCH_POINTS
            if p.role in ROLE and p.member != "__init__"}


def test_every_wrapped_method_is_checked_by_doctor() -> None:
    wrapped = {(p.role, p.attr) for p in patches.PATCH_POINTS}
    # the send threads' add_request / copy wrappers ride on the same classes doctor resolves for P13
    unchecked = wrapped - _doctor_methods() - {("send", "add_request"), ("send", "_batch_copy_with_limits")}
    assert unchecked == set(), f"wrapped but never checked by `kvtrace doctor`: {sorted(unchecked)}"


def test_every_checked_method_is_wrapped() -> None:
    wrapped = {(p.role, p.attr) for p in patches.PATCH_POINTS}
    missing = _doctor_methods() - wrapped
    assert missing == set(), f"`kvtrace doctor` checks methods nothing wraps: {sorted(missing)}"


def test_required_install_points_are_required_for_doctor_too() -> None:
    required_doctor = {(ROLE[p.role], p.member) for p in upstream.PATCH_POINTS if p.required and p.role in ROLE}
    for point in patches.PATCH_POINTS:
        if point.required:
            assert (point.role, point.attr) in required_doctor, point
