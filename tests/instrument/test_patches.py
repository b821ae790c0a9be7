"""The patch table: install/uninstall are exact inverses, idempotent, and all-or-nothing."""

from __future__ import annotations

import pytest

from otel_kvtrace.instrument import patches
from otel_kvtrace.instrument.runtime import Runtime
from otel_kvtrace.instrument.targets import Targets
from otel_kvtrace.record.recorder import Recorder


class BaseThread:
    def add_request(self, item):  # inherited by the subclass (vLLM-Ascend main)
        return ("base", item)


class RecvThread(BaseThread):
    def _handle_request(self, item):
        return ("handled", item)

    def _batch_copy_with_limits(self, *args):
        return 0


class OverridingRecvThread(BaseThread):
    def add_request(self, item):  # overridden per subclass (release 0.23)
        return ("own", item)

    def _handle_request(self, item):
        return ("handled", item)


class Gate:
    def record(self, stream=None):
        return None

    def wait(self, timeout=10.0):
        return True


def _runtime() -> Runtime:
    return Runtime(recorder=Recorder(), run_id="t")


def _class_attrs(*classes: type) -> dict:
    return {(c, k): v for c in classes for k, v in vars(c).items()}


def test_install_then_uninstall_restores_every_attribute_exactly() -> None:
    before = _class_attrs(BaseThread, RecvThread, OverridingRecvThread, Gate)
    targets = Targets(recv_thread_classes=(RecvThread, OverridingRecvThread), gate_class=Gate)
    installed = patches.install(targets, _runtime())
    assert RecvThread.__dict__["add_request"].__kvtrace_wrapped__ is BaseThread.add_request
    assert OverridingRecvThread.__dict__["add_request"].__kvtrace_wrapped__ is before[(OverridingRecvThread, "add_request")]
    assert BaseThread.__dict__["add_request"] is before[(BaseThread, "add_request")], "base class untouched"
    patches.uninstall(installed)
    assert _class_attrs(BaseThread, RecvThread, OverridingRecvThread, Gate) == before
    assert "add_request" not in RecvThread.__dict__


def test_wrapped_methods_behave_like_the_originals() -> None:
    targets = Targets(recv_thread_classes=(RecvThread, OverridingRecvThread), gate_class=Gate)
    installed = patches.install(targets, _runtime())
    try:
        assert RecvThread()._handle_request(None) == ("handled", None)
        assert RecvThread().add_request(None) == ("base", None)
        assert OverridingRecvThread().add_request(None) == ("own", None)
        assert Gate().wait() is True
    finally:
        patches.uninstall(installed)


def test_second_install_is_a_no_op() -> None:
    targets = Targets(recv_thread_classes=(RecvThread,))
    first = patches.install(targets, _runtime())
    second = patches.install(targets, _runtime())
    assert second == []
    patches.uninstall(first)
    assert "add_request" not in RecvThread.__dict__


def test_missing_required_point_raises_and_rolls_back() -> None:
    class NoHandle(BaseThread):
        pass

    before = _class_attrs(RecvThread, NoHandle)
    with pytest.raises(LookupError, match="_handle_request"):
        patches.install(Targets(recv_thread_classes=(RecvThread, NoHandle)), _runtime())
    assert _class_attrs(RecvThread, NoHandle) == before


def test_no_recv_class_is_an_error() -> None:
    with pytest.raises(LookupError, match="recv"):
        patches.install(Targets(gate_class=Gate), _runtime())


def test_targets_coerce_mapping_and_reject_unknown_roles() -> None:
    t = Targets.coerce({"recv_thread_classes": [RecvThread], "gate_class": Gate})
    assert t.recv_thread_classes == (RecvThread,)
    with pytest.raises(ValueError, match="unknown target roles"):
        Targets.coerce({"recv": RecvThread})


def test_a_target_inheriting_from_another_target_is_wrapped_once() -> None:
    class KeyRecvThread(RecvThread):  # e.g. a key-path class deriving from the GVA class
        pass

    installed = patches.install(Targets(recv_thread_classes=(RecvThread, KeyRecvThread)), _runtime())
    try:
        assert "_handle_request" not in KeyRecvThread.__dict__, "the inherited wrapper already covers it"
        assert KeyRecvThread._handle_request is RecvThread.__dict__["_handle_request"]
    finally:
        patches.uninstall(installed)
    assert "_handle_request" not in KeyRecvThread.__dict__


def test_a_second_session_on_the_same_classes_is_refused() -> None:
    from otel_kvtrace.api import start_tracing

    first = start_tracing(Targets(recv_thread_classes=(RecvThread,)), exporter=None)
    try:
        with pytest.raises(RuntimeError, match="already instrumented"):
            start_tracing(Targets(recv_thread_classes=(RecvThread,)), exporter=None)
    finally:
        first.shutdown()
    again = start_tracing(Targets(recv_thread_classes=(RecvThread,)), exporter=None)
    again.shutdown()


class ExtraArgsThread(BaseThread):
    def add_request(self, item, *extra, **options):
        return ("own", item, extra, options)

    def _handle_request(self, item, *extra, **options):
        return ("handled", item, extra, options)


class ExtraArgsWorker:
    def wait_for_layer_load(self, *extra, **options):
        return ("waited", extra, options)


def test_wrappers_pass_extra_arguments_and_signature_errors_through_unchanged() -> None:
    """The task wrappers call the original without ``*``/``**`` re-packing when there is nothing extra;
    extra arguments, and a call the original's signature rejects, behave exactly as without them."""
    plain = ExtraArgsThread()
    expected_errors = {}
    for name in ("add_request", "_handle_request"):
        with pytest.raises(TypeError) as err:
            getattr(OverridingRecvThread(), name)(None, 1)
        expected_errors[name] = str(err.value)
    targets = Targets(recv_thread_classes=(ExtraArgsThread, OverridingRecvThread), gate_class=Gate,
                      worker_class=ExtraArgsWorker)
    installed = patches.install(targets, _runtime())
    try:
        worker = ExtraArgsWorker()
        assert worker.wait_for_layer_load() == ("waited", (), {})
        assert worker.wait_for_layer_load("layer.3", key=1) == ("waited", ("layer.3",), {"key": 1})
        for name, tag in (("add_request", "own"), ("_handle_request", "handled")):
            method = getattr(plain, name)
            assert method(None) == (tag, None, (), {})
            assert method(None, 1, 2) == (tag, None, (1, 2), {})
            assert method(None, 3, key="v") == (tag, None, (3,), {"key": "v"})
            assert method(item=None) == (tag, None, (), {})
            with pytest.raises(TypeError) as err:
                getattr(OverridingRecvThread(), name)(None, 1)
            assert str(err.value) == expected_errors[name]
    finally:
        patches.uninstall(installed)
