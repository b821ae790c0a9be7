"""A checker for Chrome Trace Event Format documents, written from what Perfetto's JSON importer
(google/perfetto ``src/trace_processor/importers/json/json_trace_parser_impl.cc``) and the format's
definition require, independent of the exporter under test.

Per phase: ``X`` needs a numeric ``ts`` and a numeric ``dur >= 0`` (the importer drops an ``X`` without
``dur``); ``C`` needs an ``args`` object of numbers (else ``json_parser_failure``); ``s``/``f`` need an
``id`` (a flow is the triple id, cat, name; else ``flow_invalid_id``); ``M`` process/thread names need
``args.name``. Every event needs ``ph``, ``name``, ``pid`` and ``tid``. Beyond the importer: ``X``
slices of one thread nest (a thread cannot run two slices at once), every flow has exactly one start
and one end, the end not before the start, and each end with ``bp: "e"`` (and each start) lies inside a
slice of its own thread, so it binds to one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

EPS = 1e-6


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_trace(doc: dict[str, Any]) -> list[str]:
    """Every violation found, as readable sentences (empty: valid)."""
    problems: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    slices: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    flows: dict[tuple[Any, Any, Any], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: {"s": [], "f": []})
    for i, e in enumerate(events):
        ph = e.get("ph")
        for key in ("ph", "name", "pid", "tid"):
            if key not in e:
                problems.append(f"event {i} ({ph}) has no {key}")
        if ph != "M" and not _num(e.get("ts")):
            problems.append(f"event {i} ({ph}) has no numeric ts")
        if ph == "X":
            if not _num(e.get("dur")) or e["dur"] < 0:
                problems.append(f"event {i} (X {e.get('name')}) has no numeric dur >= 0")
            else:
                slices[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(_num(v) for v in args.values()):
                problems.append(f"event {i} (C {e.get('name')}) args are not an object of numbers")
        elif ph in ("s", "t", "f"):
            if "id" not in e or "cat" not in e:
                problems.append(f"event {i} (flow {ph}) has no id or cat")
            flows[(e.get("id"), e.get("cat"), e.get("name"))].setdefault(ph, []).append(e)
        elif ph == "M" and e.get("name") in ("process_name", "thread_name"):
            if not isinstance(e.get("args", {}).get("name"), str):
                problems.append(f"event {i} (M {e['name']}) has no args.name")
        elif ph not in ("M", "B", "E", "i", "I", "b", "e", "n"):
            problems.append(f"event {i} has unknown phase {ph!r}")
    for track, spans in slices.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -(s[1] - s[0]))):
            while stack and stack[-1] <= start + EPS:
                stack.pop()
            if stack and end > stack[-1] + EPS:
                problems.append(f"slices on {track} overlap without nesting at ts {start}")
                break
            stack.append(end)

    def inside(e: dict[str, Any]) -> bool:
        return any(s - EPS <= e["ts"] <= t + EPS for s, t in slices.get((e.get("pid"), e.get("tid")), []))

    for key, by_phase in flows.items():
        starts, ends = by_phase["s"], by_phase["f"]
        if len(starts) != 1 or len(ends) != 1:
            problems.append(f"flow {key} has {len(starts)} start(s) and {len(ends)} end(s)")
            continue
        if ends[0]["ts"] < starts[0]["ts"]:
            problems.append(f"flow {key} ends before it starts")
        if not inside(starts[0]) or not inside(ends[0]):
            problems.append(f"flow {key} does not bind to a slice at both ends")
    return problems
