"""Read the Ascend PyTorch profiler's output (``torch_npu.profiler``) into NPU timeline events: attention
kernels, H2D/D2D copies and collective/P2P communication, in epoch ns on the KV tasks' axis.

Why: the HOL question ("why was this layer's KV not ready?") needs the attention kernels and copies
beside the recv queue. Formats come from the writer code (Ascend/pytorch, ``torch_npu/profiler/analysis``;
docs/analysis.md, "NPU timeline", lists each field and its source):

- ``ASCEND_PROFILER_OUTPUT/trace_view.json`` (``prof_view/_trace_view_parser.py``): a JSON array of
  Chrome trace events (msprof's timeline plus torch_npu's own), ``ts`` in µs as a number or a string
  (``prof_common_func/_constant.py:convert_ns2us_str``), ``dur`` µs; processes named by ``M``
  ``process_name`` events: ``Ascend Hardware`` (device tasks, ``tid`` = stream, ``args["Task Type"]``),
  ``Communication`` (HCCL operators).
- ``kernel_details.csv`` (``prof_view/_kernel_view_parser.py``, headers from
  ``prof_common_func/_csv_headers.py:OP_SUMMARY_KERNEL_BASE_HEADERS``): ``Name``, ``Type``,
  ``Accelerator Core``, ``Start Time(us)`` (a µs string, maybe ending in a tab), ``Duration(us)``.
- ``communication.json`` (``prof_view/_communication_parser.py``): ``{step: {"p2p"|"collective": {op:
  {"Communication Time Info": {"Start Timestamp(us)", "Elapse Time(ms)", ...}}}}}``.

When ``trace_view.json`` is present it is the one read (it holds the kernels and the communication);
otherwise ``kernel_details.csv`` and ``communication.json`` are; with no torch_npu output at all, msprof's
own timeline (``PROF_*/mindstudio_profiler_output/msprof_*.json``, the events torch_npu copies into
``trace_view.json``: ``TraceViewParser.generate_view``) is read like ``trace_view.json``. Every skipped record is counted and
named (``file:index: reason``).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
TRACE_VIEW = "trace_view.json"
KERNEL_DETAILS = "kernel_details.csv"
COMMUNICATION = "communication.json"
MSPROF_TIMELINE = re.compile(r"^msprof_\d+(_\d+)*(_slice_\d+(_\d+)*)?\.json$")
"""msprof's timeline file names (torch_npu ``prof_parse/_cann_file_parser.py``, ``MSPROF_TIMELINE``)."""

_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
_COPY = re.compile(r"memcpy|mem_?copy|tensormove|(?<![a-z])[hd]2[hd](?![a-z])", re.IGNORECASE)
_DIRECTION = re.compile(r"([HD])2([HD])", re.IGNORECASE)
_COMMUNICATION = re.compile(r"^hcom_|hccl", re.IGNORECASE)
_INT64_MAX = 2**63 - 1
MAX_SLICE_NS = 3600 * 10**9
"""A slice longer than an hour is a damaged record, not a kernel: it would stretch every timeline."""
MAX_FROM_MEDIAN_NS = 24 * 3600 * 10**9
"""A slice starting more than a day from the profile's median start is skipped (a corrupt ``ts``)."""


@dataclass(slots=True)
class NpuEvent:
    """One NPU timeline slice; ``lane`` is the stream or communication plane it ran on."""

    kind: str  # attention, copy (with direction in ``name`` when known) or communication
    name: str
    lane: str
    start_ns: int
    end_ns: int
    source: str  # file:index


@dataclass(slots=True)
class NpuProfile:
    events: list[NpuEvent] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # file:index: reason
    other_kernels: int = 0  # device tasks that are neither attention, copy nor communication


def us_to_ns(value: Any) -> int:
    """µs (number or string, maybe tab-terminated, as torch_npu writes them) to integer ns, exactly."""
    text = str(value).strip().strip("\t")
    try:
        us = Decimal(text)
    except InvalidOperation as exc:
        raise ValueError(f"not a time in µs: {value!r}") from exc
    if not us.is_finite():
        raise ValueError(f"not a finite time: {value!r}")
    return int(us * 1000)


def classify(name: str, task_type: str = "", process: str = "") -> str | None:
    """attention, copy, communication, or None for any other kernel."""
    if process == "Communication" or _COMMUNICATION.search(name):
        return "communication"
    if "MEMCPY" in task_type.upper() or _COPY.search(name):
        return "copy"
    if _ATTENTION.search(name):
        return "attention"
    return None


def _copy_name(name: str) -> str:
    match = _DIRECTION.search(name)
    return f"{match.group(1).upper()}2{match.group(2).upper()} {name}" if match else name


def _add(profile: NpuProfile, kind: str | None, name: str, lane: str, start_ns: int, dur_ns: int, src: str) -> None:
    if kind is None:
        profile.other_kernels += 1
        return
    if dur_ns < 0:
        profile.skipped.append(f"{src}: negative duration")
        return
    if not 0 <= start_ns <= _INT64_MAX - dur_ns:
        profile.skipped.append(f"{src}: time outside the int64 ns range ({start_ns} ns)")
        return
    if dur_ns > MAX_SLICE_NS:
        profile.skipped.append(f"{src}: duration {dur_ns / 1e9:.0f} s is longer than an hour")
        return
    label = _copy_name(name) if kind == "copy" else name
    profile.events.append(NpuEvent(kind, label, lane, start_ns, start_ns + dur_ns, src))


def read_trace_view(path: Path, profile: NpuProfile) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        profile.skipped.append(f"{path}:0: neither a JSON array nor an object with traceEvents")
        return
    processes, threads = {}, {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and isinstance(e.get("args"), dict):
            if e.get("name") == "process_name":
                processes[e.get("pid")] = str(e["args"].get("name", ""))
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = str(e["args"].get("name", ""))
    for index, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        process = processes.get(e.get("pid"), "")
        if process not in ("Ascend Hardware", "Communication"):
            continue
        src = f"{path}:{index}"
        try:
            start, dur = us_to_ns(e.get("ts")), us_to_ns(e.get("dur", 0))
        except ValueError as exc:
            profile.skipped.append(f"{src}: {exc}")
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        lane = threads.get((e.get("pid"), e.get("tid")), f"{process} {e.get('tid')}")
        _add(profile, classify(str(e.get("name", "")), str(args.get("Task Type", "")), process),
             str(e.get("name", "")), lane, start, dur, src)


def read_kernel_details(path: Path, profile: NpuProfile) -> None:
    with path.open(newline="", encoding="utf-8") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            src = f"{path}:{line}"
            try:
                start, dur = us_to_ns(row.get("Start Time(us)")), us_to_ns(row.get("Duration(us)"))
            except ValueError as exc:
                profile.skipped.append(f"{src}: {exc}")
                continue
            name = row.get("Name") or ""
            lane = f"device {row.get('Device_id', '')} {row.get('Accelerator Core', '')}".strip()
            _add(profile, classify(name, row.get("Type") or "") or (
                "communication" if (row.get("Accelerator Core") or "").upper() == "HCCL" else None),
                name, lane, start, dur, src)


def read_communication(path: Path, profile: NpuProfile) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        profile.skipped.append(f"{path}:0: not a JSON object of steps")
        return
    for step, groups in data.items():
        for group, ops in (groups or {}).items() if isinstance(groups, dict) else ():
            for op, info in (ops or {}).items() if isinstance(ops, dict) else ():
                if op == "Total Op Info":
                    continue
                src = f"{path}:{step}/{group}/{op}"
                timing = (info or {}).get("Communication Time Info", {}) if isinstance(info, dict) else {}
                try:
                    start = us_to_ns(timing["Start Timestamp(us)"])
                    dur = us_to_ns(Decimal(str(timing["Elapse Time(ms)"])) * 1000)
                except (KeyError, TypeError, ValueError, InvalidOperation) as exc:
                    profile.skipped.append(f"{src}: no usable Start Timestamp(us)/Elapse Time(ms) ({exc})")
                    continue
                _add(profile, "communication", op.split("@")[0], f"HCCL {group}", start, dur, src)


def _files(path: Path) -> list[Path]:
    """The files to read for one path: a file, an ``ASCEND_PROFILER_OUTPUT`` dir or a dir above it, or
    (no torch_npu output) msprof's own timeline files, which torch_npu copies into trace_view.json."""
    if path.is_file():
        return [path]
    found: list[Path] = []
    for out in sorted({p.parent for p in path.rglob(f"{OUTPUT_DIR}/*")}):
        if (out / TRACE_VIEW).is_file():
            found.append(out / TRACE_VIEW)
        else:
            found += [out / n for n in (KERNEL_DETAILS, COMMUNICATION) if (out / n).is_file()]
    if not found:
        found = sorted(p for p in path.rglob("msprof_*.json") if MSPROF_TIMELINE.match(p.name))
    if not found:
        found = [path / n for n in (TRACE_VIEW, KERNEL_DETAILS, COMMUNICATION) if (path / n).is_file()]
    return found


def read_npu_profile(paths: Iterable[str | Path], offset_ns: int = 0) -> NpuProfile:
    """Every attention kernel, copy and communication in ``paths``, shifted by ``offset_ns`` (added to
    the profiler's times; docs/analysis.md explains when it is not 0)."""
    profile = NpuProfile()
    readers = {TRACE_VIEW: read_trace_view, KERNEL_DETAILS: read_kernel_details, COMMUNICATION: read_communication}
    for given in paths:
        files = _files(Path(given))
        if not files:
            raise FileNotFoundError(f"{given}: no {TRACE_VIEW}, {KERNEL_DETAILS} or {COMMUNICATION} found")
        for file in files:
            reader = readers.get(file.name, read_trace_view if file.suffix == ".json" else read_kernel_details)
            try:
                reader(file, profile)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
                profile.skipped.append(f"{file}:0: unreadable ({exc})")
                continue
            profile.files.append(str(file))
    _drop_far(profile)
    for event in profile.events:
        event.start_ns += offset_ns
        event.end_ns += offset_ns
    profile.events.sort(key=lambda e: (e.start_ns, e.lane))
    return profile


def _drop_far(profile: NpuProfile) -> None:
    """Skip (and name) slices more than ``MAX_FROM_MEDIAN_NS`` from the median start: one corrupt ``ts``
    must not stretch the Perfetto export and the HTML timeline over years."""
    if not profile.events:
        return
    starts = sorted(e.start_ns for e in profile.events)
    median = starts[len(starts) // 2]
    kept = []
    for e in profile.events:
        if abs(e.start_ns - median) > MAX_FROM_MEDIAN_NS:
            profile.skipped.append(f"{e.source}: starts {abs(e.start_ns - median) / 3.6e12:.0f} h from the "
                                   "profile's other slices")
        else:
            kept.append(e)
    profile.events = kept
