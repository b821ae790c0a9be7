"""The vLLM plugin in a process without vLLM-Ascend: it must log once and never raise.

Kept apart from the other upstream modules because their module-scoped fixture makes ``vllm_ascend``
importable (from the fetched tree) while it is active.
"""

from __future__ import annotations

import logging

import pytest

from otel_kvtrace.instrument import plugin


pytestmark = pytest.mark.usefixtures("no_plugin_session_leak")


def test_plugin_never_raises_when_vllm_ascend_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(plugin.ENV_ENABLED, "1")
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        plugin.register()  # no upstream fixture: vllm_ascend is not importable here
        plugin.register()
    assert plugin.current_session() is None
    assert [r for r in caplog.records if "vllm_ascend is not importable" in r.getMessage()]
    assert len([r for r in caplog.records if "tracing off" in r.getMessage()]) == 1  # tried once


def test_sdk_disabled_keeps_the_plugin_from_patching(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_kvtrace.instrument import plugin
    from otel_kvtrace.instrument.targets import Targets

    class Recv:
        def add_request(self, item):
            return item

        def _handle_request(self, item):
            return item

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    plugin.stop()
    try:
        assert plugin.ensure_started(Targets(recv_thread_classes=(Recv,))) is None
        assert not hasattr(Recv.__dict__["_handle_request"], "__kvtrace_wrapped__")
    finally:
        plugin.stop()
