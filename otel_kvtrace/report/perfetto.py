"""``kvtrace export --perfetto``: the traces as Chrome Trace Event JSON, for ui.perfetto.dev,
chrome://tracing and MindStudio Insight.

Why: Ascend engineers read timelines in those viewers, next to the NPU profiler's own
``trace_view.json``. Layout (docs/analysis.md, "Timeline export"): one process per run; per recv queue a
recv-thread track (task slices with their stages nested inside) and a HOL track (one slice per HOL
event, the evidence task ready behind the head); per process a forward-thread track (consumer waits)
and a send-thread track (save tasks); flow arrows from each HOL head to its HOL slice, one per event;
counters of queue depth and in-flight tasks per queue. Slices that overlap on one thread (which a real
thread cannot do, but traces from several sources can) go to numbered extra tracks so every track
nests properly. Times are microseconds since the earliest exported event (``otherData.t0_unix_ns``),
which keeps nanosecond precision that epoch microseconds in a double would lose.

Every slice and counter comes from ``queries/trace_slices.sql``, ``hol_events.sql`` and
``queue_depth.sql``; nothing is computed here but the layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import orjson

from otel_kvtrace.analyse.queries import run_query
from otel_kvtrace.load import LoadResult, load_traces
from otel_kvtrace.npu_profile import NpuEvent, NpuProfile

FLOW_CATEGORY = "kvtrace.hol"
FLOW_NAME = "HOL: head -> ready task behind it"
NPU_PROCESS = "NPU (torch_npu profiler)"


@dataclass(slots=True)
class _Tracks:
    """pid per run, tid per (pid, track name), in first-seen order, plus their metadata events."""

    pids: dict[tuple[str, ...], int] = field(default_factory=dict)
    tids: dict[tuple[int, str], int] = field(default_factory=dict)
    meta: list[dict[str, Any]] = field(default_factory=list)
    lanes: dict[tuple[int, str], list[int]] = field(default_factory=dict)  # track -> end ns of each lane

    def pid(self, key: tuple[str, ...], name: str) -> int:
        if key not in self.pids:
            pid = self.pids[key] = len(self.pids) + 1
            self.meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                              "args": {"name": name}})
            self.meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                              "args": {"sort_index": pid}})
        return self.pids[key]

    def run_pid(self, run_id: str, label: str) -> int:
        return self.pid(("run", run_id), f"run {run_id} ({label})")

    def tid(self, pid: int, name: str) -> int:
        key = (pid, name)
        if key not in self.tids:
            tid = self.tids[key] = len(self.tids) + 1
            self.meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                              "args": {"name": name}})
            self.meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "ts": 0,
                              "args": {"sort_index": tid}})
        return self.tids[key]

    def lane_tid(self, pid: int, name: str, start_ns: int, end_ns: int) -> int:
        """The first lane of track ``name`` free at ``start_ns`` (lane 0 is the track itself)."""
        ends = self.lanes.setdefault((pid, name), [])
        for lane, end in enumerate(ends):
            if start_ns >= end:
                ends[lane] = end_ns
                break
        else:
            lane = len(ends)
            ends.append(end_ns)
        return self.tid(pid, name if lane == 0 else f"{name} (overlap {lane})")


def _short(queue: str, run_id: str) -> str:
    """A queue id without its run prefix (the process already names the run)."""
    return queue[len(run_id) + 1:] if queue.startswith(run_id + "/") else queue


def perfetto_trace(con: duckdb.DuckDBPyConnection, npu: NpuProfile | None = None) -> dict[str, Any]:
    """The Trace Event JSON document (``traceEvents`` and ``otherData``) for the loaded traces, with the
    NPU profiler's attention kernels, copies and communication when ``npu`` is given."""
    slices = run_query(con, "trace_slices").records()
    events = run_query(con, "hol_events").records()
    depth = run_query(con, "queue_depth").records()
    npu_events = npu.events if npu else []
    starts = [s["start_ns"] for s in slices] + [e["start_ns"] for e in events] + [d["ts_ns"] for d in depth]
    starts += [e.start_ns for e in npu_events]
    t0 = min(starts, default=0)

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 3)

    tracks = _Tracks()
    out: list[dict[str, Any]] = []
    recv_tid: dict[str, tuple[int, int]] = {}  # correlation id -> (pid, tid) of its recv task slice
    parent_tid: dict[tuple[str, str], tuple[int, int]] = {}
    for s in sorted(slices, key=lambda s: (s["level"], s["start_ns"], -(s["end_ns"] - s["start_ns"]))):
        pid = tracks.run_pid(s["run_id"], s["cfg_label"])
        key = (s["thread"], s["correlation_id"])
        if s["level"] == 0:
            where = s["queue"] if s["thread"] in ("recv", "send") else s["process"]
            name = f"{s['thread']} {_short(where, s['run_id'])}"
            tid = tracks.lane_tid(pid, name, s["start_ns"], s["end_ns"])
            parent_tid[key] = (pid, tid)
            if s["thread"] == "recv":
                recv_tid[s["correlation_id"]] = (pid, tid)
        elif key in parent_tid:
            pid, tid = parent_tid[key]
        else:
            continue
        args = {"correlation_id": s["correlation_id"], "seq": s["seq"], "step": s["step"], "layer": s["layer_id"]}
        if s["level"] == 0 and s["outcome"] is not None:
            args["outcome"] = s["outcome"]
        out.append({"ph": "X", "cat": f"kvtrace.{s['thread']}", "name": s["name"], "pid": pid, "tid": tid,
                    "ts": us(s["start_ns"]), "dur": round((s["end_ns"] - s["start_ns"]) / 1e3, 3), "args": args})
    out += _hol_events(events, tracks, recv_tid, us)
    out += _counters(depth, tracks, us)
    out += _npu_slices(npu_events, tracks, us)
    out.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return {"traceEvents": tracks.meta + out, "displayTimeUnit": "ms",
            "otherData": {"t0_unix_ns": t0, "producer": "otel-kvtrace export --perfetto",
                          "time_unit": "microseconds since t0_unix_ns"}}


def _hol_events(events: Sequence[dict[str, Any]], tracks: _Tracks, recv_tid: dict[str, tuple[int, int]],
                us: Any) -> list[dict[str, Any]]:
    """Per HOL event: a slice on its queue's HOL track and a flow from the head's task slice to it."""
    out: list[dict[str, Any]] = []
    for flow_id, e in enumerate(events, start=1):
        head = recv_tid.get(e["head_correlation_id"])
        if head is None:
            continue
        pid = head[0]
        tid = tracks.lane_tid(pid, f"HOL {_short(e['queue'], e['run_id'])}", e["start_ns"], e["end_ns"])
        out.append({"ph": "X", "cat": FLOW_CATEGORY, "name": f"HOL {e['class']}", "pid": pid, "tid": tid,
                    "ts": us(e["start_ns"]), "dur": round((e["end_ns"] - e["start_ns"]) / 1e3, 3),
                    "args": {"head": e["head_correlation_id"], "evidence": e["evidence_correlation_id"],
                             "evidence_ready_us": us(e["evidence_ready_ns"]), "blocked_ms": e["dur_ns"] / 1e6,
                             "intervals": e["intervals"]}})
        at = us((e["start_ns"] + e["first_end_ns"]) // 2)  # inside the head's wait and the HOL slice
        out.append({"ph": "s", "cat": FLOW_CATEGORY, "name": FLOW_NAME, "id": flow_id, "bp": "e",
                    "pid": head[0], "tid": head[1], "ts": at})
        out.append({"ph": "f", "cat": FLOW_CATEGORY, "name": FLOW_NAME, "id": flow_id, "bp": "e",
                    "pid": pid, "tid": tid, "ts": at})
    return out


def _counters(depth: Iterable[dict[str, Any]], tracks: _Tracks, us: Any) -> list[dict[str, Any]]:
    """Queue depth and in-flight tasks per queue, one sample per enqueue, dequeue or completion."""
    out = []
    for d in depth:
        run_id = d["run_id"]
        pid = tracks.run_pid(run_id, d["cfg_label"])
        out.append({"ph": "C", "name": f"queue {_short(d['queue'], run_id)}", "pid": pid, "tid": 0,
                    "ts": us(d["ts_ns"]), "args": {"queued": d["depth"], "in_flight": d["inflight"]}})
    return out


def _npu_slices(events: Iterable[NpuEvent], tracks: _Tracks, us: Any) -> list[dict[str, Any]]:
    """The NPU profiler's slices in one process, a track per kind and stream/plane."""
    out = []
    for e in events:
        pid = tracks.pid(("npu",), NPU_PROCESS)
        tid = tracks.lane_tid(pid, f"{e.kind} {e.lane}", e.start_ns, e.end_ns)
        out.append({"ph": "X", "cat": f"npu.{e.kind}", "name": e.name, "pid": pid, "tid": tid,
                    "ts": us(e.start_ns), "dur": round((e.end_ns - e.start_ns) / 1e3, 3),
                    "args": {"source": e.source}})
    return out


def write_perfetto(paths: Iterable[str | Path] | str | Path | LoadResult, out: str | Path, *,
                   cache_dir: str | Path | None = None, npu: NpuProfile | None = None) -> Path:
    """Load ``paths`` (or reuse a ``LoadResult``) and write the Trace Event JSON to ``out``.

    Example::

        write_perfetto(["kvtrace-data/traces"], "kv.perfetto.json")  # open in ui.perfetto.dev
    """
    loaded = paths if isinstance(paths, LoadResult) else load_traces(paths, cache_dir=cache_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(perfetto_trace(loaded.con, npu)))
    return out
