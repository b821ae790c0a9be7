"""One verdict per run: find the runs in an input and refuse inputs that hold none.

Our traces carry ``kvtrace.run_id`` (lane ``<run_id>/pid<pid>``); an msServiceProfiler capture is one run
per capture folder.
``check`` must never merge several runs into one verdict (``kvtrace async replica`` writes three runs
into one folder), and must say what an input holds when it holds no async-check spans.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from statistics import median
from pathlib import Path

from otel_kvtrace.asynccheck import model as m

CAPTURE_RUN = "capture"


class NothingToCheckError(ValueError):
    """The input holds no async-check spans; the message says what was found and which command reads it."""


class SeveralRunsError(ValueError):
    """The input holds several runs; ``runs`` maps each run to its files (None when files mix runs)."""

    def __init__(self, message: str, runs: dict[str, list[str]] | None) -> None:
        super().__init__(message)
        self.runs = runs


def run_of(span: m.SpanRow) -> str:
    """Our traces: ``kvtrace.run_id``; a capture: ``capture <root folder>`` (``importers._files_with_roots``)."""
    if span.step is not None or span.name in m.WORKER_SPANS:  # a Multiproc worker's spans: same run id
        return span.lane.rsplit("/pid", 1)[0]
    root = span.attrs.get("capture")
    return f"{CAPTURE_RUN} {root}" if root else CAPTURE_RUN


def split_runs(spans: Iterable[m.SpanRow]) -> dict[str, list[str]]:
    """``run -> files`` in first-seen order."""
    runs: dict[str, dict[str, None]] = {}
    for s in spans:
        runs.setdefault(run_of(s), {})[s.file] = None
    return {run: list(files) for run, files in runs.items()}


def refuse_mixed(result: m.ImportResult) -> None:
    """Raise ``SeveralRunsError`` when ``result`` holds more than one run."""
    runs = split_runs(result.spans)
    if len(runs) <= 1:
        return
    owners: dict[str, set[str]] = {}
    for run, files in runs.items():
        for f in files:
            owners.setdefault(f, set()).add(run)
    mixed = sorted(f for f, rs in owners.items() if len(rs) > 1)
    names = ", ".join(sorted(runs))
    if mixed:
        raise SeveralRunsError(
            f"{len(runs)} runs ({names}) are mixed inside {mixed[0]}: one verdict would merge them; "
            "split the file by kvtrace.run_id first", None)
    raise SeveralRunsError(f"{len(runs)} runs found ({names}): one verdict per run", runs)


def refuse_empty(paths: Iterable[str | Path], files: list[Path], result: m.ImportResult) -> None:
    """Raise ``NothingToCheckError`` for an input with no capture files or with KV recv traces only."""
    where = ", ".join(str(p) for p in paths)
    if not files:
        raise NothingToCheckError(
            f"no capture files under {where} (looked for *.jsonl, *.json, *.csv, *.db, *.yaml): "
            "`kvtrace async replica` or the engine-loop plugin writes async traces; msServiceProfiler parse "
            "outputs are read as they are")
    if result.spans:
        return
    other = sum(int(x.split(":", 1)[1]) for x in result.seen if x.startswith("otlp_other:"))
    if other:
        raise NothingToCheckError(
            f"{where} holds {other} KV-cache recv trace spans and no async-scheduling spans: "
            "read them with `kvtrace report`; `kvtrace async check` reads traces of the engine-loop plugin "
            "(OTEL_KVTRACE_ASYNC) or of `kvtrace async replica`")


Notes = dict[str, list[tuple[str, str]]]
"""Per engine process: ``(warning kind, text)`` of what the split did with the other processes."""


def split_processes(spans: list[m.SpanRow]) -> tuple[dict[str, list[m.SpanRow]], Notes]:
    """One run's spans per engine process (DP rank), when it has several: ``{"<run> DP<rank>": spans}``
    where every engine's trace names its DP rank, else ``{"<run> pid<N>": spans}``.

    Engine processes are those with steps (our traces: lanes with ``async.step``) or with schedule spans
    (a capture: ``BatchSchedule``). A ``MultiprocExecutor`` worker's spans go to the engine that is its
    parent process (``process.parent_pid``; a worker without a known parent joins none, with a note); a
    capture's other processes (workers, device DBs) to the engine
    whose schedule ends lie closest before their spans (a note per engine says which). ``({}, {})`` for one.
    """
    if not spans:
        return {}, {}
    base = run_of(spans[0])
    ours = [s for s in spans if s.step is not None or s.name in m.WORKER_SPANS]
    if ours:
        engines = sorted({_lane_pid(s.lane) for s in ours if s.step is not None})
        if len(engines) < 2:
            return {}, {}
        label = _engine_labels(base, engines, ours)
        out: dict[str, list[m.SpanRow]] = {label[e]: [] for e in engines}
        orphans: dict[str, int] = {}
        for s in ours:
            pid = _lane_pid(s.lane) if s.step is not None else str(s.attrs.get("ppid", ""))
            if pid in engines:
                out[label[pid]].append(s)
            else:  # no known parent: joining it to any engine would mix DP ranks
                orphans[_lane_pid(s.lane)] = orphans.get(_lane_pid(s.lane), 0) + 1
        note = [(m.WARN_PROCESS_LEFT_OUT, f"pid {pid}: {n} worker span(s) left out of every engine's verdict: "
                 "no process.parent_pid names one of this run's engine processes")
                for pid, n in sorted(orphans.items())]
        return out, ({key: list(note) for key in out} if note else {})
    by_pid: dict[str, list[m.SpanRow]] = {}
    for s in spans:
        by_pid.setdefault(str(s.attrs.get("pid")), []).append(s)
    engines = sorted(p for p, ss in by_pid.items() if any(s.name == m.BATCH_SCHEDULE for s in ss))
    if len(engines) < 2:
        return {}, {}
    ends = {e: sorted(s.end_ns for s in by_pid[e] if s.name == m.BATCH_SCHEDULE) for e in engines}
    out = {f"{base} pid{e}": list(by_pid[e]) for e in engines}
    notes: Notes = {}
    for pid, ss in by_pid.items():
        if pid in engines:
            continue
        engine = min(engines, key=lambda e: _lead_ns(ends[e], ss))
        out[f"{base} pid{engine}"] += ss
        notes.setdefault(f"{base} pid{engine}", []).append((m.WARN_PROCESS_JOINED, (
            f"pid {pid} (no schedule spans) joined engine pid {engine}: its spans follow that engine's "
            "schedules most closely")))
    return out, notes


def _engine_labels(base: str, engines: list[str], spans: list[m.SpanRow]) -> dict[str, str]:
    """``engine pid -> "<run> DP<rank>"`` when every engine process names its own DP rank (vLLM's
    ``data_parallel_index``, traced as ``vllm.dp_rank``), else ``"<run> pid<pid>"`` for every one."""
    ranks: dict[str, set[object]] = {e: set() for e in engines}
    for s in spans:
        if s.step is not None and "dp_rank" in s.attrs:
            ranks[_lane_pid(s.lane)].add(s.attrs["dp_rank"])
    known = [next(iter(r)) for r in ranks.values() if len(r) == 1]
    if len(known) == len(engines) and len(set(known)) == len(known):
        return {e: f"{base} DP{next(iter(ranks[e]))}" for e in engines}
    return {e: f"{base} pid{e}" for e in engines}


def _lane_pid(lane: str) -> str:
    return lane.rsplit("/pid", 1)[-1]


def _lead_ns(schedule_ends: list[int], spans: list[m.SpanRow]) -> float:
    """Median time from the latest schedule end before each span's start to that start (inf if none)."""
    leads = []
    for s in spans:
        i = bisect_right(schedule_ends, s.start_ns) - 1
        if i >= 0:
            leads.append(s.start_ns - schedule_ends[i])
    return float(median(leads)) if leads else float("inf")


def select_process(result: m.ImportResult, run: str) -> None:
    """Keep the spans of engine process ``run`` (a ``split_processes`` key); with several engine processes
    and no such key, raise ``SeveralRunsError`` (one verdict per process, never a merge of DP ranks)."""
    procs, notes = split_processes(result.spans)
    if not procs:
        return
    if run not in procs:
        base = run_of(result.spans[0])
        files = {key: list(dict.fromkeys(s.file for s in spans)) for key, spans in procs.items()}
        raise SeveralRunsError(f"{len(procs)} engine processes (DP ranks) in {base}: one verdict per process", files)
    result.spans = procs[run]
    result.warnings += [m.CaptureWarning(run, "", kind, text) for kind, text in notes.get(run, [])]
