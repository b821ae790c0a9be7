"""Auto-enable paths on the real upstream classes: the vLLM plugin, the OTel instrumentor, the JSON export.

Inside the ``upstream`` fixture ``vllm_ascend`` is importable (from the fetched source tree under stubs),
so ``register()`` binds exactly as it would in a vLLM worker process, and what it exports is read back
from the OTLP/JSON lines file the embedded sink writes.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from otel_kvtrace.instrument import plugin
from otel_kvtrace.instrument.instrumentor import KVTraceInstrumentor

from tests.polling import wait_until
from .harness import FakeBackend, Upstream, exported_spans, task_traces

pytestmark = [pytest.mark.upstream, pytest.mark.usefixtures("no_plugin_session_leak")]


def _enable_plugin_with_file_export(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_id: str) -> None:
    """Switch the plugin on with ``run_id`` and no OTLP endpoint, so it exports to JSON lines under ``tmp_path``."""
    monkeypatch.setenv(plugin.ENV_ENABLED, "1")
    monkeypatch.setenv("OTEL_KVTRACE_RUN_ID", run_id)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.chdir(tmp_path)


def _run_one_task(up: Upstream, layer: int = 0) -> None:
    env = up.gva_thread(4, FakeBackend())
    env.thread.add_request(up.gva_task(layer, [up.request("r1", 2)]))
    assert wait_until(lambda: env.load_done[layer].is_set())


def test_entry_points_are_declared() -> None:
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("otel_kvtrace") == "otel_kvtrace.instrument.plugin:register"
    instrumentors = {ep.name: ep for ep in importlib.metadata.entry_points(group="opentelemetry_instrumentor")}
    assert instrumentors["kvtrace"].load() is KVTraceInstrumentor


def test_plugin_is_off_by_default(upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.ENV_ENABLED, raising=False)
    handle = upstream.binding.classes["recv_gva"].__dict__["_handle_request"]
    plugin.register()
    assert plugin.current_session() is None
    assert upstream.binding.classes["recv_gva"].__dict__["_handle_request"] is handle


def test_plugin_instruments_once_and_exports_json_lines(upstream: Upstream, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _enable_plugin_with_file_export(monkeypatch, tmp_path, "plugin-test")
    plugin.register()
    session = plugin.current_session()
    assert session is not None, "register() must bind to the importable vllm_ascend"
    plugin.register()  # vLLM may call it again in the same process
    assert plugin.current_session() is session
    _run_one_task(upstream)
    assert wait_until(lambda: session.stats().submitted == 1)
    plugin.stop()

    (task,) = task_traces(exported_spans(tmp_path / "kvtrace-data"))
    assert task.attrs["kvtrace.correlation_id"].startswith("plugin-test/")
    assert task.stage_names()[0] == "queue_wait" and "backend_submit" in task.children
    lines = list((tmp_path / "kvtrace-data").rglob("*.jsonl"))
    assert lines and b'"vllm_ascend.version"' in lines[0].read_bytes()
    assert b'"upstream"' in lines[0].read_bytes()


def test_instrumentor_follows_the_switch_and_uninstruments(upstream: Upstream, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.delenv(plugin.ENV_ENABLED, raising=False)
    cls = upstream.binding.classes["recv_gva"]
    original = cls.__dict__["_handle_request"]
    off = KVTraceInstrumentor()
    off.instrument()  # what `opentelemetry-instrument` does: respects OTEL_KVTRACE_ENABLED (off)
    assert off.session is None and cls.__dict__["_handle_request"] is original
    off.uninstrument()

    on = KVTraceInstrumentor()
    on.instrument(targets=upstream.binding, out_dir=tmp_path)
    assert on.session is not None and cls.__dict__["_handle_request"] is not original
    _run_one_task(upstream, layer=1)
    on.uninstrument()
    assert cls.__dict__["_handle_request"] is original
    (task,) = task_traces(exported_spans(tmp_path))
    assert task.attrs["kvtrace.layer_id"] == 1


def test_installed_resolution_and_doctor_without_source(upstream: Upstream) -> None:
    """With ``vllm_ascend`` importable (here: the fetched tree), the no-argument paths bind to it."""
    from otel_kvtrace.doctor import EXIT_OK, doctor
    from otel_kvtrace.instrument.upstream import resolve_targets

    targets = resolve_targets()
    assert targets.source == "upstream"
    assert targets.recv_thread_classes == (upstream.binding.classes["recv_gva"], upstream.binding.classes["recv_key"])
    assert targets.gate_class is upstream.gate_class and targets.worker_class.__name__ == "KVPoolWorker"
    assert targets.flags["raise_if_failed"] == upstream.is_main
    report = doctor()
    assert report.exit_code == EXIT_OK and report.binding.source == "installed"
    assert report.binding.layout == upstream.binding.layout


def test_plugin_waits_for_vllm_to_import_the_worker_module(upstream: Upstream, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """In a fresh vLLM process the KV pool is not imported yet: bind right after vLLM imports it."""
    import importlib
    import sys

    monkeypatch.setenv(plugin.ENV_ENABLED, "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, plugin.WATCHED_MODULE)  # restored (the fixture's module) afterwards
    plugin.register()
    assert plugin.current_session() is None, "nothing may happen before the worker module is imported"
    plugin.register()
    assert sum(isinstance(f, plugin._BindOnImport) for f in sys.meta_path) == 1

    module = importlib.import_module(plugin.WATCHED_MODULE)  # what vLLM does when it builds the worker
    session = plugin.current_session()
    assert session is not None and session.targets.worker_class is module.KVPoolWorker
    assert not any(isinstance(f, plugin._BindOnImport) for f in sys.meta_path)
    assert "_start_kv_transfer_threads" in vars(module.KVPoolWorker)
    assert getattr(vars(module.KVPoolWorker)["start_load_kv"], "__kvtrace_wrapped__", None) is not None
    _run_one_task(upstream, layer=2)
    assert wait_until(lambda: session.stats().submitted == 1)


def test_plugin_adds_the_worker_config_and_ranks_to_the_exported_resource(
        upstream: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resource is known only once a real KVPoolWorker starts its threads (post-hook)."""
    from .harness import drive_step, pool_worker

    _enable_plugin_with_file_export(monkeypatch, tmp_path, "plugin-resource")
    plugin.register()
    session = plugin.current_session()
    assert session is not None
    worker = pool_worker(upstream, 4, 2, FakeBackend())
    drive_step(upstream, worker, {layer: [upstream.request("r1", 2)] for layer in range(4)})
    assert session.flush(10)
    files = list((tmp_path / "kvtrace-data" / "traces").glob("*.jsonl"))
    assert files, "the embedded sink wrote no file"
    import json

    resources = [
        {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
        for f in files for line in f.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
    ]
    assert resources
    last = resources[-1]
    assert last["kvtrace.cfg.num_layers"] == {"intValue": "4"}
    assert last["kvtrace.cfg.prefetch_layers"] == {"intValue": "2"}
    assert "kvtrace.rank.tp" in last and last["kvtrace.source"] == {"stringValue": "upstream"}


@pytest.mark.parametrize("where", ["start_tracing", "after_import"])
def test_a_failing_bind_never_breaks_vllms_import_of_the_worker_module(
        where: str, upstream: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A bug of ours deep inside ``start_tracing`` (a ValueError), or anywhere in the post-import hook:
    vLLM's ``import pool_worker`` still succeeds with the real module, and tracing is off with a reason."""
    import importlib
    import logging
    import sys

    from otel_kvtrace.instrument import patches
    from otel_kvtrace.schedule import install as schedule_install

    def bug(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug deep inside the binding")

    monkeypatch.setattr(patches if where == "start_tracing" else schedule_install,
                        "install" if where == "start_tracing" else "bind_installed", bug)
    monkeypatch.setenv(plugin.ENV_ENABLED, "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, plugin.WATCHED_MODULE)  # restored (the fixture's module) afterwards
    plugin.register()
    with caplog.at_level(logging.WARNING, logger="otel_kvtrace"):
        module = importlib.import_module(plugin.WATCHED_MODULE)  # what vLLM does when it builds the worker
    assert module.KVPoolWorker.__name__ == "KVPoolWorker"
    assert plugin.current_session() is None
    warnings = [r.getMessage() for r in caplog.records if "a bug deep inside the binding" in r.getMessage()]
    assert len(warnings) == 1 and "tracing off" in warnings[0], warnings
    if where == "start_tracing":
        assert KVTraceInstrumentor().off_reason == "ValueError: a bug deep inside the binding"
