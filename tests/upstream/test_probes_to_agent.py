"""End to end on the REAL vLLM-Ascend recv thread: compiled probes -> ring -> exporter agent -> files.

The same drive (every recv stage: a save wait that blocks, a gate wait that blocks, dependencies met
before the task, an empty task, a failed copy, several steps with their own ``SharedBlockData``) runs
twice on a started upstream ``KVCacheStoreLayerRecvingThread`` with the compiled probes (the default):
once with ``exporter=None`` (the records stay in the recorder: the reference) and once with
``exporter="agent"`` (records go through the shared-memory ring to the exporter agent process, which
writes OTLP/JSON lines). Both are loaded with the project's loader (``load_traces``; the reference's
spans built with the exporter's own ``SpanBuilder`` and written by the file sink), and every task of
the agent's files must match its reference task in everything that does not depend on timing (stage
set and each stage's call count, outcome, status, layer, seq, step, source layer, gate id, bytes,
blocks, request and group ids, which dependencies have a time), must match the recorded ``TaskRecord``
fields directly, and must have ordered times.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from otel_kvtrace.api import start_tracing
from otel_kvtrace.export.sinks import JsonLinesFileSink
from otel_kvtrace.export.spans import SpanBuilder
from otel_kvtrace.instrument import patches
from otel_kvtrace.load.loader import load_traces
from otel_kvtrace.load.tasks_sql import DEPS, RECV_THREAD_STAGES, STAGES
from otel_kvtrace.record.model import NO_TIME, OUTCOME_NAMES, STAGE_SPAN_NAMES

from tests.polling import wait_until
from .harness import FakeBackend, Upstream

pytestmark = pytest.mark.upstream

N_LAYERS = 6
STEPS = 4
RUN_ID = "probes-to-agent"
KINDS = ("met", "late_save", "late_gate", "empty", "failed_copy", "no_gate")
"""What each layer >= 1 of a step does, rotating with step and layer (layer 0: gate only, no save)."""


def _in_wait(thread: threading.Thread) -> bool:
    """The thread is blocked inside ``threading``'s ``wait`` (an Event or a Condition) called from its
    ``_handle_request`` (not in the idle ``queue.get``)."""
    frame = sys._current_frames().get(thread.ident)  # noqa: SLF001 - test introspection
    names = []
    while frame is not None:
        names.append((frame.f_code.co_name, frame.f_code.co_filename == threading.__file__))
        frame = frame.f_back
    return bool(names) and names[0] == ("wait", True) and "_handle_request" in (n for n, _ in names)


def _drive(up: Upstream, env: Any) -> list[str]:
    """Every task one at a time through the started recv thread; the kind of each task, in order."""
    thread = env.thread
    requests = [up.request(f"req-{i}", 2 + i % 3) for i in range(STEPS + 1)]
    kinds = []
    for step in range(STEPS):
        reqs = requests[step:step + 2]
        shared = up.shared_data(reqs)  # one per step, on every layer's task, as upstream builds them
        for layer in range(N_LAYERS):
            kind = "first" if layer == 0 else KINDS[(step + layer) % len(KINDS)]
            kinds.append(kind)
            gate = None if kind == "no_gate" else up.gate_class()
            if gate is not None and kind != "late_gate":
                gate.record()
            if layer and kind != "late_save":
                env.save_done[layer - 1].set()
            if kind == "failed_copy":
                env.backend.results.append(5)
            task = up.gva_task(layer, [] if kind == "empty" else reqs, gate=gate, shared=shared,
                               wait_for_save_layer=layer - 1 if layer else None)
            thread.add_request(task)
            if kind in ("late_save", "late_gate"):  # released only once the recv thread blocks in the wait
                assert wait_until(lambda: _in_wait(thread), timeout_s=10), f"{kind}: the recv thread never waited"
                if kind == "late_save":
                    env.save_done[layer - 1].set()
                else:
                    gate.record()
            assert env.load_done[layer].wait(10), f"step {step} layer {layer} ({kind}) never loaded"
            env.load_done[layer].clear()
            for ev in env.save_done:
                ev.clear()
    return kinds


def _run(up: Upstream, exporter: str | None, out: Path) -> tuple[list[Any], Any, dict[str, str]]:
    """The drive under a session with ``exporter``: (records when in-process, session, probe paths)."""
    targets = up.binding.to_targets()
    session = start_tracing(targets, exporter=exporter, out_dir=out, run_id=RUN_ID)
    records: list[Any] = []
    try:
        paths = patches.probe_paths(targets)
        if exporter is None:
            session.recorder.npu_resolver = None
        env = up.gva_thread(N_LAYERS, FakeBackend())
        kinds = _drive(up, env)
        if exporter is None:
            assert wait_until(lambda: session.recorder.pending >= len(kinds), timeout_s=10)
            records = session.recorder.drain(1 << 16)
            # the reference through the exporter's own span builder and file sink: the same loader reads both
            builder = SpanBuilder(session.recorder.anchor)
            sink = JsonLinesFileSink(out, RUN_ID, {"kvtrace.run_id": RUN_ID})
            sink.export([builder.build_json(r) for r in records], 0)
            sink.shutdown()
    finally:
        stats = session.shutdown(30.0)
    assert stats.disabled_reason is None, stats.disabled_reason
    return records, stats, paths


_ORDER = {name: i for i, name in enumerate(STAGES)}
_ATTRS = ("seq", "step", "layer_id", "final_layer", "wait_for_save_layer", "gate_id", "num_blocks", "bytes",
          "outcome", "status_code", "correlation_id", "group_ids", "request_ids")


def _tasks(out: Path) -> dict[int, dict[str, Any]]:
    """Per seq: the loaded task's timing-free fields, its child spans and its times."""
    con = load_traces(out).con
    cols = [c[0] for c in con.execute("SELECT * FROM tasks LIMIT 0").description]
    tasks = {}
    for row in con.execute("SELECT * FROM tasks ORDER BY seq").fetchall():
        t = dict(zip(cols, row, strict=True))
        tasks[t["seq"]] = t
    children: dict[str, list[tuple[str, int, int, Any]]] = {}
    for trace_id, name, start, end, calls in con.execute(
            "SELECT trace_id, name, start_ns, end_ns, attrs['kvtrace.calls'] FROM spans "
            "WHERE parent_span_id IS NOT NULL").fetchall():
        children.setdefault(trace_id, []).append((name, start, end, int(calls or 1)))
    status = dict(con.execute("SELECT trace_id, status_message FROM spans WHERE parent_span_id IS NULL").fetchall())
    out_tasks = {}
    for seq, t in tasks.items():
        spans = sorted(children.get(t["trace_id"], []), key=lambda c: (c[1], c[2], _ORDER[c[0]]))
        out_tasks[seq] = {
            "fields": {**{a: t[a] for a in _ATTRS}, "status_message": status.get(t["trace_id"])},
            "deps": tuple(any(t[f"ts_dep_{d}{s}"] is not None for s in ("", "_lo", "_hi")) for d in DEPS),
            "stages": [(name, n) for name, _, _, n in spans],  # in start order
            "spans": spans,
            "row": t,
        }
    return out_tasks


def test_every_task_reaches_the_files_as_recorded(upstream: Upstream, tmp_path: Path) -> None:
    records, _, ref_paths = _run(upstream, None, tmp_path / "ref")
    _, stats, agent_paths = _run(upstream, "agent", tmp_path / "agent")
    recv = upstream.binding.classes["recv_gva"].__qualname__
    assert ref_paths[recv] == agent_paths[recv] == "compiled"
    n = STEPS * N_LAYERS
    assert len(records) == n
    assert (stats.submitted, stats.delivered, stats.dropped) == (n, n, 0), stats

    ref, agent = _tasks(tmp_path / "ref"), _tasks(tmp_path / "agent")
    assert sorted(agent) == sorted(ref) == list(range(n))
    for seq in range(n):
        a, r = agent[seq], ref[seq]
        diff = {k: (a[k], r[k]) for k in ("fields", "deps", "stages") if a[k] != r[k]}
        assert not diff, f"task {seq}: agent vs in-process differ in {diff}"

    # the reference itself is what the probes recorded (so a shared mistake cannot hide behind the builder)
    kinds = set()
    for rec in records:
        t = agent[rec.seq]
        f = t["fields"]
        assert (f["layer_id"], f["step"], f["bytes"], f["outcome"]) == (
            rec.layer_id, rec.step, rec.nbytes, OUTCOME_NAMES[rec.outcome]), rec.seq
        assert f["wait_for_save_layer"] == rec.wait_for_save_layer and f["gate_id"] == rec.gate_id, rec.seq
        recorded = {STAGE_SPAN_NAMES[s] for s in rec.stages[0::3]}
        assert recorded <= {name for name, _ in t["stages"]}, (rec.seq, recorded, t["stages"])
        observed = tuple(rec.deps[2 * d] != NO_TIME for d in range(len(DEPS)))
        assert t["deps"] == observed, (rec.seq, t["deps"], observed)
        kinds |= recorded | {f["outcome"]}

    # the drive reached every branch the test is about: blocking save and gate waits, copies, all outcomes
    assert {"save_cpu_wait", "gate_cond_wait", "gate_npu_sync", "meta_build", "backend_submit"} <= kinds, kinds
    assert {"ok", "empty", "error"} <= kinds, kinds
    failed = [a["fields"] for a in agent.values() if a["fields"]["outcome"] == "error"]
    assert failed and all(f["status_code"] == 2 and "5" in f["status_message"] for f in failed), failed
    assert any(a["fields"]["request_ids"] and len(a["fields"]["request_ids"]) == 2 for a in agent.values())

    for seq, t in agent.items():
        row = t["row"]
        assert row["ts_enqueue"] <= row["ts_dequeue"] <= row["ts_complete"], seq
        assert row["start_ns"] <= row["ts_enqueue"] and row["ts_complete"] <= row["end_ns"], seq
        recv_spans = [s for s in t["spans"] if s[0] in RECV_THREAD_STAGES]
        for name, start, end, _ in t["spans"]:
            assert row["start_ns"] <= start <= end <= row["end_ns"], (seq, name)
        for before, after in zip(recv_spans, recv_spans[1:]):  # one after another on the recv thread
            assert before[2] <= after[1], (seq, before, after)
