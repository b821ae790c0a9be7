"""Loader defects of issue 16 and wrong inputs of issue 15, one test each; each fails on c84d075."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from synthetic_traces import QueueSpec, request_lines, simulate_queue, write_otlp_json

from otel_kvtrace.load import LoadError, NoTasksError, load_traces

SPEC = QueueSpec(run_id="inputs")
# The OTLP spec's own example (open-telemetry/opentelemetry-proto, examples/trace.json): pretty-printed,
# upper-case hex ids, times as JSON integers.
SPEC_EXAMPLE = """{
  "resourceSpans": [
    {
      "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "my.service"}}]},
      "scopeSpans": [
        {
          "scope": {"name": "my.library", "version": "1.0.0",
                    "attributes": [{"key": "my.scope.attribute", "value": {"stringValue": "some scope attribute"}}]},
          "spans": [
            {
              "traceId": "5B8EFFF798038103D269B633813FC60C",
              "spanId": "EEE19B7EC3C1B174",
              "parentSpanId": "EEE19B7EC3C1B173",
              "name": "I'm a server span",
              "startTimeUnixNano": 1544712660000000000,
              "endTimeUnixNano": 1544712661000000000,
              "kind": 2,
              "attributes": [{"key": "my.span.attr", "value": {"stringValue": "some value"}}]
            }
          ]
        }
      ]
    }
  ]
}
"""
# What Jaeger's query API (and the UI's "Download JSON") returns: {"data": [trace]}, spans with
# traceID/spanID/operationName, microsecond startTime/duration, processes by id.
JAEGER = {"data": [{"traceID": "5b8efff798038103", "spans": [{
    "traceID": "5b8efff798038103", "spanID": "eee19b7ec3c1b174", "operationName": "backend_submit",
    "references": [], "startTime": 1544712660000000, "duration": 1000, "tags": [], "logs": [],
    "processID": "p1", "warnings": None}], "processes": {"p1": {"serviceName": "kvtrace", "tags": []}},
    "warnings": None}], "total": 0, "limit": 0, "offset": 0, "errors": None}


def _good(tmp_path: Path, name: str = "good.jsonl", n: int = 8) -> Path:
    return write_otlp_json(tmp_path / name, [(SPEC, simulate_queue(SPEC, n, seed=3))])


def _first_line_doc() -> dict:
    return orjson.loads(next(iter(request_lines(SPEC, simulate_queue(SPEC, 2, seed=4), tasks_per_line=2))))


@pytest.mark.parametrize("value", ["9999999999999999999", "--5", "\u0661\u0662", str(2**63), "-5", "1e3", 1.5])
def test_out_of_range_times_are_rejected_and_named_not_nulled(tmp_path: Path, value: object) -> None:
    doc = _first_line_doc()
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[1]["endTimeUnixNano"] = value
    (tmp_path / "t.jsonl").write_bytes(orjson.dumps(doc) + b"\n")
    result = load_traces(tmp_path / "t.jsonl")
    assert [m.reason for m in result.stats.malformed] == ["span 1: endTimeUnixNano is not an integer in [0, 2^63)"]
    assert result.stats.spans == len(spans) - 1
    assert result.con.execute("SELECT count(*) FROM spans WHERE start_ns IS NULL OR end_ns IS NULL").fetchall() == [(0,)]


@pytest.mark.parametrize("line", [b"{}", b"5", b'{"resourceSpans":5}', b'{"a":1,}',
                                  b'{"resourceSpans":[{"scopeSpans":[{"spans":[NaN]}]}]}'])
def test_json_that_is_not_otlp_or_not_strict_is_listed(tmp_path: Path, line: bytes) -> None:
    path = _good(tmp_path)
    with open(path, "ab") as f:
        f.write(line + b"\n")
    result = load_traces(path)
    assert [(m.line, m.reason.split(" (")[0]) for m in result.stats.malformed] in (
        [(len(path.read_bytes().splitlines()), "not an OTLP trace request")],
        [(len(path.read_bytes().splitlines()), "not JSON")])
    assert result.stats.tasks == 8


def test_a_bad_resource_attribute_costs_that_attribute_not_the_entry(tmp_path: Path) -> None:
    doc = _first_line_doc()
    doc["resourceSpans"][0]["resource"]["attributes"].append({"key": "bad", "value": {"intValue": "x"}})
    (tmp_path / "t.jsonl").write_bytes(orjson.dumps(doc) + b"\n")
    result = load_traces(tmp_path / "t.jsonl")
    assert [m.reason for m in result.stats.malformed] == [
        "resourceSpans[0] resource attribute 'bad': intValue is not an int64 (attribute dropped)"]
    assert result.stats.spans == len(doc["resourceSpans"][0]["scopeSpans"][0]["spans"])
    assert result.con.execute("SELECT DISTINCT run_id FROM spans").fetchall() == [("inputs",)]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "flipped"])
def test_damaged_gzip_is_named_for_that_file_and_the_rest_loads(tmp_path: Path, damage: str) -> None:
    _good(tmp_path, "a.jsonl")
    packed = gzip.compress(b"".join(request_lines(SPEC, simulate_queue(QueueSpec(run_id="gz"), 8, seed=9))))
    bad = {"truncated": packed[: len(packed) // 2], "garbage": b"\x1f\x8bnot gzip at all",
           "flipped": packed[:40] + bytes([packed[40] ^ 0xFF]) + packed[41:]}[damage]
    (tmp_path / "b.jsonl.gz").write_bytes(bad)
    result = load_traces(tmp_path)
    assert result.stats.tasks >= 8
    assert [m.file.endswith("b.jsonl.gz") and "damaged compressed data" in m.reason
            for m in result.stats.malformed] == [True]


def test_one_empty_file_among_good_ones_is_listed_not_fatal(tmp_path: Path) -> None:
    _good(tmp_path)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    result = load_traces(tmp_path)
    assert result.stats.tasks == 8 and [Path(f).name for f in result.stats.empty_files] == ["empty.jsonl"]


def test_tasks_missing_key_columns_are_counted(tmp_path: Path) -> None:
    doc = _first_line_doc()
    for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        if span["name"] == "kvtrace.recv.task":
            span["attributes"] = [a for a in span["attributes"] if a["key"] != "kvtrace.queue"]
            break
    (tmp_path / "t.jsonl").write_bytes(orjson.dumps(doc) + b"\n")
    result = load_traces(tmp_path / "t.jsonl")
    assert result.stats.incomplete_tasks == 1 and result.stats.tasks == 1
    assert [m.reason.split(" ", 3)[3] for m in result.stats.malformed] == ["has no queue; left out of tasks"]


def test_pretty_printed_otlp_loads_and_without_kvtrace_spans_says_so(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(SPEC_EXAMPLE)
    result = load_traces(path, require_tasks=False)
    assert (result.stats.spans, result.stats.malformed) == (1, [])
    with pytest.raises(NoTasksError, match=r"1 OTLP span\(s\) but no kvtrace task.*I'm a server span"):
        load_traces(path)


def test_a_cache_written_without_tasks_still_refuses_a_load_that_needs_them(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(SPEC_EXAMPLE)
    cache = tmp_path / "cache"
    assert load_traces(path, cache_dir=cache, require_tasks=False).stats.cache == "miss"
    with pytest.raises(NoTasksError, match=r"1 OTLP span\(s\) but no kvtrace task"):
        load_traces(path, cache_dir=cache)  # cache hit: the same check as a fresh parse


def _kvtrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def _inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each wrong input, and a phrase its one-sentence answer must contain."""
    jaeger_pretty = tmp_path / "jaeger" / "trace.json"
    jaeger_pretty.parent.mkdir()
    jaeger_pretty.write_text(json.dumps(JAEGER, indent=2))
    otlp = tmp_path / "otlp" / "trace.json"
    otlp.parent.mkdir()
    otlp.write_text(SPEC_EXAMPLE)
    empty = tmp_path / "empty"
    empty.mkdir()
    from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
    asyn = run_replica(ReplicaConfig(mode="async", num_steps=4), out_dir=tmp_path / "async")
    return {"jaeger": (jaeger_pretty, "Jaeger UI export"), "otlp": (otlp, "no kvtrace task"),
            "empty": (empty, "holds no trace files"), "async": (asyn, "kvtrace async check")}


@pytest.mark.parametrize("command", ["report", "whatif"])
def test_wrong_inputs_get_one_sentence_and_a_non_zero_exit(tmp_path: Path, command: str) -> None:
    for name, (path, phrase) in _inputs(tmp_path).items():
        extra = ["--no-cache"] if command == "report" else []
        proc = _kvtrace(command, str(path), *extra)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert phrase in proc.stderr, (name, proc.stderr)
        assert "Traceback" not in proc.stderr and "no rows" not in proc.stderr
        assert "explain its total time" not in proc.stdout


def test_cache_dir_with_a_quote_works(tmp_path: Path) -> None:
    path = _good(tmp_path)
    cache = tmp_path / "it's cache"
    first = load_traces(path, cache_dir=cache)
    second = load_traces(path, cache_dir=cache)
    assert (first.stats.cache, second.stats.cache, second.stats.tasks) == ("miss", "hit", 8)


def test_a_directory_of_only_broken_files_is_one_error_naming_what_was_found(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b"")
    with pytest.raises(LoadError, match="all empty"):
        load_traces(tmp_path)


def test_a_40_mb_line_loads(tmp_path: Path) -> None:
    """`kvtrace collect` accepts requests up to 64 MiB; their lines must load (DuckDB's default is 16 MB)."""
    doc = _first_line_doc()
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    template = spans[-1]
    for i in range(150_000):
        spans.append({**template, "spanId": f"{i + 1:016x}", "parentSpanId": template["spanId"],
                      "name": "meta_build", "attributes": [{"key": "pad", "value": {"stringValue": "x" * 200}}]})
    line = orjson.dumps(doc)
    assert len(line) > 40 * 2**20  # DuckDB refuses lines over 2x its 16 MB default object size
    (tmp_path / "big.jsonl").write_bytes(line + b"\n")
    result = load_traces(tmp_path / "big.jsonl")
    assert (result.stats.spans, result.stats.malformed) == (len(spans), [])
