"""One verdict per run: find the runs in an input and refuse inputs that hold none.

Our traces carry ``kvtrace.run_id`` (lane ``<run_id>/pid<pid>``); an msServiceProfiler capture is one run
per capture folder.
``check`` must never merge several runs into one verdict (``kvtrace async replica`` writes three runs
into one folder), and must say what an input holds when it holds no async-check spans.
"""

from __future__ import annotations

from collections.abc import Iterable
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
