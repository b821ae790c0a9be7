"""Loader: files, directories, globs, .gz, malformed lines with file:line, empty files, Parquet cache."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import orjson
import pytest
from synthetic_traces import QueueSpec, request_lines, simulate_queue, write_otlp_json

from otel_kvtrace.analyse.queries import run_query
from otel_kvtrace.load import LoadError, load_traces, tasks_columns

SPEC = QueueSpec(run_id="load")


def _lines(n_tasks: int = 12, per_line: int = 3) -> list[bytes]:
    return list(request_lines(SPEC, simulate_queue(SPEC, n_tasks, seed=5), tasks_per_line=per_line))


def _count(con, sql: str) -> int:
    return con.execute(sql).fetchall()[0][0]


def test_tasks_table_has_the_schema_columns_and_values(tmp_path: Path) -> None:
    tasks = simulate_queue(SPEC, 16, seed=1, bounded_probability=0.5)
    path = write_otlp_json(tmp_path / "t.jsonl", [(SPEC, tasks)], with_send_tasks=True)
    result = load_traces(path)
    con = result.con
    columns = [d[0] for d in con.execute("SELECT * FROM tasks LIMIT 0").description]
    assert columns == tasks_columns()
    assert result.stats.tasks == 16 and result.stats.send_tasks == sum(t.wait_for_save_layer is not None for t in tasks)
    rows = {r[0]: r for r in con.execute(
        "SELECT seq, ts_enqueue, ts_ready, ts_ready_lo, final_layer, queue_wait_start, backend_submit_ns, "
        "ts_dep_gate_npu, ts_dep_gate_npu_lo, ts_dep_gate_npu_hi, cfg_label, ready_precision, request_ids "
        "FROM tasks").fetchall()}
    for task in tasks:
        row = rows[task.seq]
        assert row[1] == task.enqueue and row[2] == task.ready and row[4] == task.final_layer
        assert row[3] == (task.ready_lo if task.bounded else None)
        assert row[5] == task.stages["queue_wait"][0]
        assert row[6] == task.stages["backend_submit"][1] - task.stages["backend_submit"][0]
        gate = task.deps.get("gate_npu")
        if gate is None:
            assert row[7:10] == (None, None, None)
        elif gate[0] == gate[1]:
            assert row[7:10] == (gate[0], None, None)
        else:
            assert row[7:10] == (None, gate[0], gate[1])
        assert row[10] == SPEC.cfg_label and row[11] == ("bounded" if task.bounded else "exact")
        assert row[12] == [f"req-{task.step}"]
    # Child spans carry their task's correlation id and their attributes as a MAP.
    assert _count(con, "SELECT count(*) FROM spans WHERE correlation_id IS NULL") == 0
    assert con.execute("SELECT attrs['kvtrace.thread'] FROM spans WHERE name = 'consumer_wait' LIMIT 1"
                       ).fetchall() == [("forward",)]


def test_malformed_lines_are_skipped_counted_and_located(tmp_path: Path) -> None:
    lines = _lines()
    bad_span = orjson.loads(lines[1])
    spans = bad_span["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[0]["startTimeUnixNano"] = "not-a-time"  # one bad span in an otherwise good line
    content = [lines[0], b"this is not json\n", orjson.dumps(bad_span) + b"\n", b"\n",
               b'{"resourceSpans": 5}\n', *lines[2:], lines[-1][: len(lines[-1]) // 2] + b"\n"]
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b"".join(content))
    result = load_traces(path)
    where = {(m.line, m.reason) for m in result.stats.malformed}

    def found(line: int, reason: str) -> bool:
        return any(n == line and text.startswith(reason) for n, text in where)

    assert found(2, "not JSON")
    assert found(3, "span 0: startTimeUnixNano is not an integer")
    assert found(5, "not an OTLP trace request (no resourceSpans list)")
    assert found(len(content), "not JSON")
    assert result.stats.malformed_count == 4
    assert all(m.file == str(path.resolve()) for m in result.stats.malformed)
    # Nothing valid is dropped: every span of the intact lines and the other spans of line 3 are there.
    expected = sum(len(orjson.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in lines) - 1
    assert result.stats.spans == expected


def test_gzip_directories_and_globs(tmp_path: Path) -> None:
    lines = _lines(24, 4)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.jsonl").write_bytes(b"".join(lines[:3]))
    with gzip.open(tmp_path / "d" / "sub" / "b.jsonl.gz", "wb") as out:
        out.write(b"".join(lines[3:]))
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    by_dir = load_traces(tmp_path / "d")
    by_glob = load_traces(str(tmp_path / "d" / "**" / "*.jsonl*"))
    assert by_dir.stats.tasks == by_glob.stats.tasks == 24
    assert len(by_dir.stats.files) == 2


def test_errors_name_the_problem(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(LoadError, match="no usable spans in .*empty.jsonl"):
        load_traces(empty)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"hello\nworld\n")
    with pytest.raises(LoadError, match=r"garbage.jsonl.*garbage.jsonl:1: not JSON"):
        load_traces(garbage)
    with pytest.raises(LoadError, match="no such file"):
        load_traces(tmp_path / "nope.jsonl")
    with pytest.raises(LoadError, match="matches no files"):
        load_traces(str(tmp_path / "*.nothing"))


def test_parquet_cache_is_used_while_inputs_are_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(_lines(20, 5)))
    cache = tmp_path / "cache"
    first = load_traces(path, cache_dir=cache)
    assert first.stats.cache == "miss"
    expected = first.con.execute("SELECT * FROM tasks ORDER BY seq").fetchall()
    # Same size and mtime but unparseable content: a cache hit never reads the JSON.
    stat = path.stat()
    path.write_bytes(b"x" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = load_traces(path, cache_dir=cache)
    assert second.stats.cache == "hit"
    assert second.con.execute("SELECT * FROM tasks ORDER BY seq").fetchall() == expected
    assert second.con.execute("SELECT count(*) FROM spans WHERE correlation_id IS NOT NULL").fetchall()[0][0] \
        == first.stats.spans
    # A changed file (new mtime) misses the cache and is parsed again.
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(LoadError):
        load_traces(path, cache_dir=cache)


def test_collector_file_exporter_shape_with_extra_fields(tmp_path: Path) -> None:
    """The Collector writes kind, flags, events, links, dropped counts, schemaUrl; none may break loading."""
    doc = orjson.loads(_lines(3, 3)[0])
    doc["resourceSpans"][0]["schemaUrl"] = "https://opentelemetry.io/schemas/1.26.0"
    doc["resourceSpans"][0]["scopeSpans"][0]["scope"]["version"] = "1.0"
    for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        span["flags"] = 257
        span["droppedAttributesCount"] = 0
        span["events"] = [{"timeUnixNano": span["startTimeUnixNano"], "name": "x", "attributes": []}]
        span["links"] = [{"traceId": span["traceId"], "spanId": span["spanId"]}]
        span["status"] = {"code": "STATUS_CODE_ERROR", "message": "boom"} if span["name"] == "completion" else {}
        span["attributes"].append({"key": "n", "value": {"intValue": 7}})  # a number, not a string
    path = tmp_path / "collector.json"
    path.write_bytes(orjson.dumps(doc) + b"\n")
    result = load_traces(path)
    assert result.stats.tasks == 3 and not result.stats.malformed
    assert result.con.execute("SELECT DISTINCT status_code FROM spans WHERE name = 'completion'").fetchall() == [(2,)]
    assert result.con.execute("SELECT DISTINCT attrs['n'] FROM spans").fetchall() == [("7",)]


def test_loading_into_a_given_connection_replaces_previous_tables(tmp_path: Path) -> None:
    import duckdb

    con = duckdb.connect()
    a = write_otlp_json(tmp_path / "a.jsonl", [(SPEC, simulate_queue(SPEC, 8, seed=1))])
    b = write_otlp_json(tmp_path / "b.jsonl", [(SPEC, simulate_queue(SPEC, 5, seed=1))])
    load_traces(a, con=con)
    load_traces(b, con=con)
    assert _count(con, "SELECT count(*) FROM tasks") == 5
    load_traces(a, con=con, cache_dir=tmp_path / "cache")  # miss: tables
    assert load_traces(a, con=con, cache_dir=tmp_path / "cache").stats.cache == "hit"  # views over Parquet
    assert _count(con, "SELECT count(*) FROM tasks") == 8
    load_traces(b, con=con)  # back to tables
    assert _count(con, "SELECT count(*) FROM tasks") == 5


def test_exporter_drop_counter_is_read_from_scope_attributes(tmp_path: Path) -> None:
    """Each line's scope carries the exporter's cumulative drop count; the loader keeps the latest."""
    docs = [orjson.loads(line) for line in _lines(9, 3)]
    for doc, dropped in zip(docs, (0, 5, 7)):
        doc["resourceSpans"][0]["scopeSpans"][0]["scope"]["attributes"] = [
            {"key": "kvtrace.exporter.dropped", "value": {"intValue": str(dropped)}}]
    path = tmp_path / "dropped.jsonl"
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    assert load_traces(path).stats.exporter_dropped == 7
    cache = tmp_path / "cache"
    load_traces(path, cache_dir=cache)
    assert load_traces(path, cache_dir=cache).stats.exporter_dropped == 7


def test_a_file_loaded_twice_is_reported_and_spans_do_not_fan_out(tmp_path: Path) -> None:
    path = write_otlp_json(tmp_path / "a.jsonl", [(SPEC, simulate_queue(SPEC, 6, seed=1))])
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    result = load_traces([path, copy])
    assert result.stats.duplicate_tasks == 6
    assert _count(result.con, "SELECT count(*) FROM spans") == result.stats.spans


def test_a_duplicated_trace_file_changes_no_hol_figure(tmp_path: Path) -> None:
    """The same file under two names (or a task exported twice) must not add tasks, HOL rows or HOL time:
    a head's own copy is not a later task of its queue, and evidence joins must not fan out."""
    spec = QueueSpec(run_id="dup")
    tasks = simulate_queue(spec, 60, seed=3, hol_probability=0.3, bounded_probability=0.3)
    path = write_otlp_json(tmp_path / "a.jsonl", [(spec, tasks)], with_send_tasks=True)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())

    def figures(paths: list[Path]) -> tuple:
        result = load_traces(paths)
        con = result.con
        intervals = run_query(con, "hol_intervals").records()
        summary = run_query(con, "hol_summary").records()
        return result.stats, _count(con, "SELECT count(*) FROM tasks"), intervals, summary

    single_stats, single_tasks, single_intervals, single_summary = figures([path])
    stats, n_tasks, intervals, summary = figures([path, copy])
    assert single_intervals, "the workload must have HOL for this test to mean anything"
    assert single_stats.send_tasks > 0, "send roots must be present: they are not duplicated recv tasks"
    assert n_tasks == single_tasks == stats.tasks == len(tasks)
    assert stats.spans == single_stats.spans and stats.send_tasks == single_stats.send_tasks
    assert intervals == single_intervals
    assert summary == single_summary
    assert stats.duplicate_tasks == len(tasks) and single_stats.duplicate_tasks == 0


def test_a_task_exported_twice_under_new_span_ids_is_one_task(tmp_path: Path) -> None:
    """A copy with other span ids survives the (trace_id, span_id) dedupe; tasks still has one row per
    trace (the earliest root), so the head's copy is not a later task of its own queue."""
    spec = QueueSpec(run_id="reexport")
    tasks = simulate_queue(spec, 40, seed=4, hol_probability=0.3)
    path = write_otlp_json(tmp_path / "a.jsonl", [(spec, tasks)])
    docs = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    for doc in docs:
        for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            for key in ("spanId", "parentSpanId"):
                if span.get(key):
                    span[key] = span[key][::-1]  # other span ids, same trace id and times
    copy = tmp_path / "reexported.jsonl"
    copy.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    single = load_traces(path)
    both = load_traces([path, copy])
    assert both.stats.tasks == single.stats.tasks == len(tasks)
    assert both.stats.duplicate_tasks == len(tasks)
    intervals = run_query(single.con, "hol_intervals").records()
    assert intervals and run_query(both.con, "hol_intervals").records() == intervals
    assert run_query(both.con, "hol_summary").records() == run_query(single.con, "hol_summary").records()
