"""The live scheduler on the REAL vLLM-Ascend GVA recv thread (release sdist, or main via
``KVTRACE_UPSTREAM_SRC``), for each live policy, traced and untraced.

Upstream's ``run()`` and ``_handle_request`` run unchanged; only the ``request_queue`` is the scheduler's
(installed through the patch table on the real class's ``__init__``). The test plays the producers.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.schedule import SchedulingQueue, install_scheduler

from tests.polling import wait_until
from .harness import FakeBackend, Upstream, records_to_spans, task_traces

pytestmark = pytest.mark.upstream

N = 6


@pytest.fixture(params=["fifo", "ready_queue"])
def policy(request: pytest.FixtureRequest, upstream: Upstream) -> Iterator[str]:
    install_scheduler(upstream.binding.to_targets(), request.param)
    yield request.param
    install_scheduler(upstream.binding.to_targets(), "fifo")  # the rollback removes the patch


@pytest.fixture(params=[False, True], ids=["untraced", "traced"])
def traced(request: pytest.FixtureRequest, upstream: Upstream) -> Iterator[Any]:
    if not request.param:
        yield None
        return
    session = start_tracing(upstream.binding.to_targets(), exporter=None, run_id="sched")
    yield session
    session.shutdown()


def _copies(backend: FakeBackend) -> list[str]:
    return [c.op for c in backend.calls]


def test_ready_task_passes_a_head_waiting_on_its_save(upstream: Upstream, policy: str, traced: Any) -> None:
    backend = FakeBackend(copy_s=0.001)
    env = upstream.gva_thread(N, backend)
    q = env.thread.request_queue
    assert isinstance(q, SchedulingQueue) == (policy == "ready_queue")  # fifo patches nothing
    head = upstream.gva_task(2, [upstream.request("r1", 2)], wait_for_save_layer=0)
    free = upstream.gva_task(3, [upstream.request("r1", 2)])
    final = upstream.gva_task(N - 1, [upstream.request("r1", 2)])
    for task in (head, free, final):
        env.thread.add_request(task)

    if policy == "ready_queue":
        assert wait_until(lambda: env.load_done[3].is_set())  # 3 passes the waiting head
    else:  # synchronisation point: the thread took the head and waits in it, so 3 cannot have run
        assert wait_until(lambda: q.qsize() == 2)
        assert not env.load_done[3].is_set()
    assert not env.load_done[2].is_set() and not env.load_done[N - 1].is_set()  # head and final still wait
    env.save_done[0].set()  # the send thread finishes layer 0's save
    assert wait_until(lambda: env.load_done[N - 1].is_set())
    assert env.load_done[2].is_set() and env.load_done[3].is_set()
    assert not env.save_done[0].is_set()  # the head consumed (cleared) its save event, as upstream
    assert _copies(backend).count("batch_remove_lease") == 1 and _copies(backend)[-1] == "batch_remove_lease"
    assert wait_until(lambda: env.thread.request_queue.unfinished_tasks == 0)  # one task_done per get
    if policy == "ready_queue":
        assert q.bypassed == 1
    if traced is not None:
        assert wait_until(lambda: traced.stats().submitted >= 3)
        layers = sorted(t.attrs["kvtrace.layer_id"] for t in task_traces(records_to_spans(traced)))
        assert layers == [2, 3, N - 1]


def test_gate_not_reached_is_never_bypassed(upstream: Upstream, policy: str) -> None:
    backend = FakeBackend()
    env = upstream.gva_thread(N, backend)
    q = env.thread.request_queue
    gate = upstream.gate_class()
    held_back = (lambda: q.blocked_by["dependency"]) if policy == "ready_queue" else (lambda: 0)
    try:
        env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 1)], wait_for_save_layer=0))
        env.thread.add_request(upstream.gva_task(3, [upstream.request("r1", 1)], gate=gate))
        # synchronisation point: the scheduler looked at 3 and held it back (fifo: the head is out)
        assert wait_until(lambda: held_back() >= 1 if policy == "ready_queue" else q.qsize() == 1)
        assert not env.load_done[3].is_set()  # gate not recorded
        upstream.torch.npu.Event.device_lag_s = 3600.0  # the device reaches the gate only when told below
        gate.record()
        upstream.torch.npu.Event.device_lag_s = 0.0
        upstream.torch.npu.Event.stream_tail = 0.0
        seen = held_back()
        env.thread.add_request(upstream.gva_task(4, [upstream.request("r1", 1)]))
        if policy == "ready_queue":  # the thread stays free for a task that is ready ...
            assert wait_until(lambda: env.load_done[4].is_set() and held_back() > seen)
            assert gate._event.sync_calls == 0  # ... and never synchronized the recorded gate
        else:
            assert wait_until(lambda: q.qsize() == 2)
            assert not env.load_done[4].is_set()
        assert not env.load_done[3].is_set()  # recorded, device not there yet: not passed
        gate._event.done_at = 0.0  # the device reaches the gate
        if policy == "ready_queue":
            assert wait_until(lambda: env.load_done[3].is_set())
        else:
            assert not env.load_done[3].is_set()  # still behind the waiting head
    finally:
        upstream.torch.npu.Event.device_lag_s = 0.0
        upstream.torch.npu.Event.stream_tail = 0.0
        env.save_done[0].set()
    assert wait_until(lambda: all(env.load_done[k].is_set() for k in (2, 3, 4)))


def test_failed_copy_in_a_bypassing_task_follows_the_version_semantics(upstream: Upstream, policy: str) -> None:
    backend = FakeBackend()
    backend.results = [7]  # the first G2L copy fails: the bypassing task's in ready_queue, the head's in fifo
    env = upstream.gva_thread(N, backend, save_failure_checker=None)
    env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 1)], wait_for_save_layer=0))
    env.thread.add_request(upstream.gva_task(3, [upstream.request("r1", 1)]))
    time.sleep(0.05)
    env.save_done[0].set()
    if upstream.is_main:  # main: the thread dies, raise_if_failed re-raises, later items stay queued
        assert wait_until(lambda: not env.thread.is_alive())
        with pytest.raises(Exception):
            env.thread.raise_if_failed()
        assert env.thread.request_queue.unfinished_tasks >= 1
    else:  # 0.23: logged, the load event is set anyway, the loop goes on
        assert wait_until(lambda: env.load_done[2].is_set() and env.load_done[3].is_set())
        assert env.thread.is_alive()
        assert wait_until(lambda: env.thread.request_queue.unfinished_tasks == 0)


def test_runtime_switch_back_to_fifo_drains(upstream: Upstream) -> None:
    targets = upstream.binding.to_targets()
    install_scheduler(targets, "ready_queue")
    try:
        env = upstream.gva_thread(N, FakeBackend())
    finally:
        install_scheduler(targets, "fifo")  # rollback while the thread has a scheduler queue
    q = env.thread.request_queue
    assert isinstance(q, SchedulingQueue) and q.policy == "fifo"
    env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 1)], wait_for_save_layer=0))
    env.thread.add_request(upstream.gva_task(3, [upstream.request("r1", 1)]))
    assert wait_until(lambda: q.qsize() == 1)  # synchronisation point: the head is out, waiting in its wait
    assert not env.load_done[3].is_set()  # FIFO again: 3 waits behind 2
    env.save_done[0].set()
    assert wait_until(lambda: env.load_done[3].is_set())
    assert type(upstream.gva_thread(N, FakeBackend()).thread.request_queue) is queue.Queue  # patch removed


@pytest.mark.usefixtures("no_plugin_session_leak")
@pytest.mark.parametrize("tracing_on", [False, True], ids=["tracing-off", "tracing-on"])
def test_plugin_honours_the_switch_whether_tracing_is_on_or_off(upstream: Upstream, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any, tracing_on: bool) -> None:
    import sys

    from otel_kvtrace.instrument import plugin

    assert plugin.WATCHED_MODULE in sys.modules  # the harness imported the worker module, as vLLM does
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_KVTRACE_SCHEDULER", "ready_queue")
    if tracing_on:
        monkeypatch.setenv(plugin.ENV_ENABLED, "1")
        monkeypatch.setenv("OTEL_KVTRACE_RUN_ID", "sched-plugin")
    else:
        monkeypatch.delenv(plugin.ENV_ENABLED, raising=False)
    try:
        plugin.register()
        env = upstream.gva_thread(N, FakeBackend())
        assert isinstance(env.thread.request_queue, SchedulingQueue)
        assert (plugin.current_session() is not None) == tracing_on
        if tracing_on:
            from otel_kvtrace.instrument.instrumentor import upstream_resource

            assert upstream_resource(upstream.binding.to_targets())["kvtrace.cfg.scheduler"] == "ready_queue"
    finally:
        install_scheduler(upstream.binding.to_targets(), "fifo")


@pytest.mark.usefixtures("no_plugin_session_leak")
def test_plugin_with_an_unknown_name_warns_once_and_stays_fifo(upstream: Upstream, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from otel_kvtrace.instrument import plugin

    monkeypatch.delenv(plugin.ENV_ENABLED, raising=False)
    monkeypatch.setenv("OTEL_KVTRACE_SCHEDULER", "ready-queue")
    plugin.register()
    env = upstream.gva_thread(N, FakeBackend())
    assert type(env.thread.request_queue) is queue.Queue
    warnings = [r for r in caplog.records if "OTEL_KVTRACE_SCHEDULER" in r.getMessage()]
    assert len(warnings) == 1 and "stays fifo" in warnings[0].getMessage()


def _resource_schedulers(out_dir: Any) -> list[str]:
    import json
    from pathlib import Path

    found = []
    for path in sorted(Path(out_dir).rglob("*.json*")):
        for line in path.read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                for attr in rs["resource"]["attributes"]:
                    if attr["key"] == "kvtrace.cfg.scheduler":
                        found.append(attr["value"]["stringValue"])
    return found


def test_resource_scheduler_is_the_policy_the_queue_really_runs(upstream: Upstream, tmp_path: Any) -> None:
    from otel_kvtrace.schedule import scheduler_in_force, threads_seen

    targets = upstream.binding.to_targets()
    install_scheduler(targets, "ready_queue")
    since = threads_seen()
    session = start_tracing(targets, exporter="thread", out_dir=str(tmp_path), run_id="cfg-sched")
    try:
        env = upstream.gva_thread(N, FakeBackend())
        assert scheduler_in_force(since) == "ready_queue"  # this session's thread (earlier tests' stay parked)
        env.thread.add_request(upstream.gva_task(2, [upstream.request("r1", 1)]))
        assert wait_until(lambda: session.stats().submitted >= 1)
        assert session.flush(30)
        assert _resource_schedulers(tmp_path)[-1:] == ["ready_queue"]
        # a blocking slot waiter wired after attach: the queue falls back to fifo, and so does the resource
        env.thread.external_slot_release_waiter = lambda layer_id: None
        env.thread.add_request(upstream.gva_task(3, [upstream.request("r1", 1)]))
        assert wait_until(lambda: session.stats().submitted >= 2)
        assert env.thread.request_queue.policy == "fifo" and scheduler_in_force(since) == "fifo"
        assert session.flush(30)
        assert _resource_schedulers(tmp_path)[-1] == "fifo"
    finally:
        session.shutdown()
        install_scheduler(targets, "fifo")
