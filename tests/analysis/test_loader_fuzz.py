"""Seeded fuzz of the loader and the report: both load paths agree, nothing crashes, every rejection named.

Each case is one file: a few valid OTLP/JSON lines of kvtrace tasks, then one mutation (a field of one
span, resource or attribute replaced by a hostile value or removed, or a line made non-strict, cut,
replaced by a non-OTLP document, or a .gz damaged). All cases load in one ``load_traces`` call (the fast
path with its SQL screen, halving on unparsable files) and are compared file by file with the same file
forced through the cleaner (the rules in ``clean.py``): the same rows, the same problems. On top, the
spans the mutation did not touch are all loaded (a bad attribute costs the attribute, not the span).
The report (terminal, JSON, HTML) of everything that loaded must then build without an exception.
``bench/fuzz.py`` runs the same checks on thousands of cases.
"""

from __future__ import annotations

import copy
import gzip
import random
import tempfile
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pytest
from synthetic_traces import QueueSpec, request_lines, simulate_queue

from otel_kvtrace.load import LoadError, load_traces
from otel_kvtrace.load.loader import RAW_SPANS, LoadStats, _load_cleaned
from otel_kvtrace.load.otlp_sql import create_raw_spans_sql

HOSTILE: list[Any] = [
    5, -1, 1.5, True, None, "", "x", [], {}, [1], {"a": 1}, "9999999999999999999", "--5", "\u0661\u0662",
    2**63, 2**64 + 1, "18446744073709551616", "+5", " 5", "1e3", "007", "-0", "NaN", "0" * 32, "g" * 32, "A" * 16,
    "<script>alert(1)</script>", "a\u0000b", "{", "[x",
]
COLUMNS = ("trace_id, span_id, parent_span_id, name, start_ns, end_ns, status_code, attributes::VARCHAR, "
           "service_name, run_id, cfg_label, rank_tp, pid, exporter_dropped")


def _base_docs(seed: int, index: int) -> list[dict]:
    spec = QueueSpec(run_id=f"fuzz{index}")  # ids derive from the run: no two cases share a span
    tasks = simulate_queue(spec, 4, seed=seed)
    return [orjson.loads(line) for line in request_lines(spec, tasks, tasks_per_line=2)]


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every (container, key) path inside ``doc``."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += _paths(value, (*prefix, key))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool) -> None:
    for key in path[:-1]:
        doc = doc[key]
    if delete and isinstance(doc, dict):
        del doc[path[-1]]
    elif delete and isinstance(doc, list):
        doc.pop(path[-1])
    else:
        doc[path[-1]] = value


def _dump(doc: Any) -> bytes:
    try:
        return orjson.dumps(doc)
    except TypeError:  # integers beyond 64 bits
        import json
        return json.dumps(doc, separators=(",", ":")).encode()


def make_case(rng: random.Random, directory: Path, index: int) -> tuple[Path, set[tuple[str, str]]]:
    """Write one mutated file; return it and the (trace, span) ids that must survive the mutation."""
    docs = _base_docs(rng.randrange(1000), index)
    lines = [orjson.dumps(d) for d in docs]
    target = rng.randrange(len(docs))
    survivors = {(s["traceId"], s["spanId"]) for i, d in enumerate(docs) if i != target
                 for rs in d["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
    kind = rng.random()
    suffix = ".jsonl"
    if kind < 0.7:  # a field somewhere in one line
        doc = copy.deepcopy(docs[target])
        path = rng.choice(_paths(doc))
        _set(doc, path, rng.choice(HOSTILE), delete=rng.random() < 0.2)
        lines[target] = _dump(doc)
        if len(path) >= 5 and path[:1] == ("resourceSpans",) and path[2:3] == ("scopeSpans",) \
                and path[4:5] == ("spans",) and len(path) > 7 and path[6] == "attributes":
            # an attribute of one span: every span of the line but at most that one survives
            spans = docs[target]["resourceSpans"][path[1]]["scopeSpans"][path[3]]["spans"]
            survivors |= {(s["traceId"], s["spanId"]) for j, s in enumerate(spans) if j != path[5]}
    elif kind < 0.8:
        lines[target] = rng.choice([b"{}", b"5", b'{"resourceSpans":5}', b"[]", b"null", b'"x"',
                                    b'{"resourceSpans":[]}', b"garbage", b"{"])
    elif kind < 0.9:  # non-strict JSON DuckDB would accept
        text = lines[target]
        lines[target] = rng.choice([text.replace(b"]", b",]", 1), text.replace(b"}", b",}", 1),
                                    text.replace(b'"stringValue":"', b'"doubleValue":NaN,"x":"', 1),
                                    text.replace(b"false", b"Infinity", 1), text[: len(text) // 2]])
    else:
        suffix = ".jsonl.gz"
    path = directory / f"case{index:04d}{suffix}"
    data = b"\n".join(lines) + b"\n"
    if suffix.endswith(".gz"):
        packed = gzip.compress(data)
        cut = rng.choice([len(packed) // 2, len(packed) - 4, len(packed) - 1])
        packed = packed[:cut] if rng.random() < 0.6 else packed[:cut] + b"\x00garbage"
        path.write_bytes(packed)
        survivors = set()  # what survives depends on where the damage falls
    else:
        path.write_bytes(data)
    return path, survivors


def _rows(con: duckdb.DuckDBPyConnection, file: str) -> list[tuple]:
    return sorted(con.execute(f"SELECT {COLUMNS} FROM {RAW_SPANS} WHERE file = $f", {"f": file}).fetchall(),
                  key=repr)


def check_cases(n: int, seed: int) -> dict[str, int]:
    """Generate ``n`` cases, load them, assert the invariants; return counts for the report."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvtrace-fuzz-") as tmp:
        root = Path(tmp)
        cases = dict(make_case(rng, root, i) for i in range(n))
        loaded = load_traces(root, require_tasks=False)
        forced = duckdb.connect()
        forced.execute(create_raw_spans_sql(RAW_SPANS))
        problems = 0
        for path, survivors in cases.items():
            name = str(path.resolve())
            stats = LoadStats()
            _load_cleaned(forced, path.resolve(), root / "forced", stats)
            fast_problems = sorted(str(m) for m in loaded.stats.malformed if m.file == name and m.line)
            assert fast_problems == sorted(str(m) for m in stats.malformed), name
            assert _rows(loaded.con, name) == _rows(forced, name), name
            ids = {(r[0], r[1]) for r in _rows(loaded.con, name)}
            assert survivors <= ids, (name, survivors - ids)
            assert all(m.line >= 1 or m.reason.endswith("left out of tasks") for m in loaded.stats.malformed)
            problems += len(fast_problems)
        _report_survives(loaded, root / "out")
    return {"cases": n, "problems": problems, "spans": loaded.stats.spans}


def _report_survives(loaded: object, out: Path) -> None:
    """The report (terminal, JSON, HTML) of whatever loaded: no exception."""
    import io

    from rich.console import Console

    from otel_kvtrace.report import build_report, render_terminal, write_html, write_json

    report = build_report(loaded)  # type: ignore[arg-type]
    render_terminal(report, Console(file=io.StringIO(), width=80))
    out.mkdir()
    write_json(report, out / "r.json")
    write_html(report, out / "r.html")


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzzed_inputs_load_the_same_on_both_paths_and_name_every_problem(seed: int) -> None:
    counts = check_cases(120, seed)
    assert counts["problems"] > 40  # the mutations do hit


def test_a_directory_of_nothing_usable_is_one_load_error(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b"{}\n5\n")
    (tmp_path / "b.jsonl").write_bytes(b"")
    with pytest.raises(LoadError, match="no usable spans"):
        load_traces(tmp_path)
