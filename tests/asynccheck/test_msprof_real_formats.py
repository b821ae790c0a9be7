"""Importers on captures written the way msServiceProfiler's writer and both parser generations write them
(``msprof_writer.py`` names the source file of every schema), and on the real 2024 MindIE capture."""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
from pathlib import Path

import pytest

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.analysis import CANNOT_TELL, EFFECTIVE, check
from otel_kvtrace.asynccheck.msprof import norm_pid
from otel_kvtrace.asynccheck.msprof_csv import datetime_ns
from otel_kvtrace.asynccheck.tables import connect, load_run

from .msprof_writer import MS, T0_NS, mindie_async, write_csvs, write_parse_folder, write_raw_dbs

SHARED = Path(__file__).resolve().parents[3] / "shared"
"""``../shared`` beside the checkout (CI lays it there; a user's clone may not have it)."""
REAL_MINDIE = SHARED / "data" / "msprof" / "real_mindie_2024" / "chrome_tracing.json"


@pytest.mark.parametrize("raw", [False, True], ids=["parse-folder", "with-raw-dbs"])
@pytest.mark.parametrize("older", [False, True], ids=["current-parser", "parser-2025-12"])
def test_mindie_async_parse_folder_with_raw_dbs_is_effective_once(tmp_path: Path, older: bool, raw: bool) -> None:
    """The normal parse output (chrome_tracing.json, batch.csv, forward.csv, profiler.db), with or without
    the raw DBs: was "not effective" (forward.csv's host launches read as device-synchronised forwards)."""
    folder = write_parse_folder(tmp_path / "out", older=older, raw=raw)
    result = check([folder])
    assert result.verdict == EFFECTIVE, result.reasons
    assert result.metrics.steps == 12  # raw + profiler.db + chrome + CSVs: each step once
    assert result.metrics.overlap_ratio == pytest.approx(1.0)
    kinds = {w["kind"] for w in result.warnings}
    assert m.WARN_MULTI_PROCESS not in kinds and "unsupported_db" not in kinds
    assert result.import_errors == 0
    # the async markers are counted once per span, not once per file that repeats it
    assert result.markers == {m.MARKER_MINDIE_ASYNC_FORWARD: 12, m.MARKER_MINDIE_ASYNC_SPANS: 12}


@pytest.mark.parametrize("files", [["chrome_tracing.json"], ["profiler.db"], ["raw"]])
def test_kernels_go_to_the_step_whose_api_launched_them(tmp_path: Path, files: list[str]) -> None:
    folder = write_parse_folder(tmp_path / "out")
    con = connect()
    load_run(con, [folder / f for f in files], "r")
    done = [d for (d,) in con.execute("SELECT done FROM async_steps WHERE run = 'r' ORDER BY step").fetchall()]
    # truth: step n's last kernel ends at 10n + 11.8 ms; "last launch before it" gives 10n + 7.0
    truth = [T0_NS + (10 * n + 11.8) * MS for n in range(12)]
    assert done == pytest.approx(truth, abs=1000)  # chrome rows are whole µs
    gap = check([folder / f for f in files]).metrics.gap_p50_ms
    assert gap == pytest.approx(0.2, abs=0.01)  # the device idles 0.2 ms between steps


def test_kernels_without_api_rows_warn_and_degrade(tmp_path: Path) -> None:
    spans, dev = mindie_async()
    folder = tmp_path / "raw"
    write_raw_dbs(folder, spans, dev)
    db = folder / "ascend_service_profiler_host-200.db"
    con = sqlite3.connect(db)
    con.execute("DROP TABLE Api")
    con.commit()
    con.close()
    result = check([folder])
    assert m.WARN_KERNELS_BY_TIME in {w["kind"] for w in result.warnings}


@pytest.mark.parametrize("older", [False, True], ids=["current-parser", "parser-2025-12"])
def test_csvs_alone_cannot_tell_a_host_launch_forward(tmp_path: Path, older: bool) -> None:
    spans, _ = mindie_async()
    batch, forward = write_csvs(tmp_path, spans, older=older)
    result = check([batch, forward])
    assert result.metrics.steps == 12 and result.import_errors == 0
    assert result.verdict == CANNOT_TELL
    assert m.WARN_FORWARD_KIND_UNKNOWN in {w["kind"] for w in result.warnings}


def test_older_csv_datetimes_are_shanghai_time() -> None:
    assert datetime_ns("2026-01-01 08:00:00:100000") == T0_NS
    assert datetime_ns("2026-01-01 08:00:00:100001") == T0_NS + 1000


def test_pid_forms_agree() -> None:
    assert norm_pid(200) == norm_pid("200") == norm_pid("ms_service_host-1-200") == 200


def test_wal_dbs_open_in_a_read_only_folder_without_writing(tmp_path: Path) -> None:
    folder = write_parse_folder(tmp_path / "out", raw=True)
    odd = folder / "raw" / "ms_service_h#x?mode=rwc-100.db"
    (folder / "raw" / "ms_service_host-100.db").rename(odd)
    for d in (folder, folder / "raw"):
        os.chmod(d, stat.S_IRUSR | stat.S_IXUSR)
    try:
        before = sorted(p.name for p in folder.rglob("*"))
        result = check([folder / "raw"])
        assert result.verdict == EFFECTIVE and result.metrics.steps == 12
        assert sorted(p.name for p in folder.rglob("*")) == before
    finally:
        for d in (folder, folder / "raw"):
            os.chmod(d, stat.S_IRWXU)


def test_db_with_unmerged_wal_is_read_with_its_wal(tmp_path: Path) -> None:
    spans, dev = mindie_async()
    (db,) = [p for p in write_raw_dbs(tmp_path / "live", spans, []) if "100" in p.name]
    writer = sqlite3.connect(db)  # a writer that has not closed: rows only in the -wal file
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("DELETE FROM slice WHERE id > 4")
    writer.commit()
    try:
        con = connect()
        load_run(con, [db], "r")
        assert con.execute("SELECT count(*) FROM async_spans").fetchone() == (4,)
    finally:
        writer.close()


@pytest.mark.skipif(not REAL_MINDIE.exists(), reason="../shared is absent (a user's clone): no real MindIE capture to read")
def test_real_mindie_2024_capture(tmp_path: Path) -> None:
    shutil.copy(REAL_MINDIE, tmp_path / "chrome_tracing.json")
    result = check([tmp_path / "chrome_tracing.json"])
    # 250 decode steps, BatchSchedule/modelExec only, no device data: no verdict can be proved
    assert result.metrics.steps == 250
    assert result.verdict == CANNOT_TELL
    assert any("no output-ready" in r for r in result.reasons)
    assert result.import_errors == 0
    # PROVENANCE.md's hand check: step period median 20186 µs (modelExec to modelExec)
    assert result.outcome.step_interval_p50_ms == pytest.approx(20.186, abs=0.01)


def _vllm_hooks(overlapping: bool, lost_start: bool) -> list:
    """msServiceProfiler's stock vLLM hooks (patcher/vllm/handlers/v1/model_handlers.py, batch_handlers.py):
    batchFrameworkProcessing (Schedule), modelExec ended in the Future's done-callback (output ready),
    modelRunnerExec in the worker, the hook-synchronised forward."""
    from .msprof_writer import Span

    at = lambda ms: T0_NS + int(round(ms * MS))  # noqa: E731
    spans = []
    for n in range(10):
        b = 10 * n + (0 if overlapping else 1.6 * n)
        spans.append(Span("batchFrameworkProcessing", "Schedule", at(b), at(b + 1), 100, 101))
        exec_start = 0 if lost_start else at(b + 1)
        spans.append(Span("modelExec", "Execute", exec_start, at(b + 11.5), 100, 102))
        spans.append(Span("modelRunnerExec", "Execute", at(b + 1.2), at(b + 11.3), 200, 201))
        spans.append(Span("forward", "Execute", at(b + 1.5), at(b + 10.5), 200, 201))
    return spans


@pytest.mark.parametrize("lost_start", [False, True], ids=["modelExec", "start-lost-fallback"])
def test_stock_vllm_hooks_with_measurable_overlap_is_effective(tmp_path: Path, lost_start: bool) -> None:
    write_raw_dbs(tmp_path, _vllm_hooks(overlapping=True, lost_start=lost_start), [])
    result = check([tmp_path])
    kinds = {w["kind"] for w in result.warnings}
    assert result.verdict == EFFECTIVE, result.reasons
    assert m.WARN_NPU_SYNC_HOOKS in kinds
    assert (m.WARN_SPAN_START_LOST in kinds) is lost_start
    con = connect()
    load_run(con, [tmp_path], "r")
    precision = con.execute("SELECT DISTINCT done_precision FROM async_steps").fetchall()
    assert precision == [(m.DONE_SYNCED_FORWARD if lost_start else m.DONE_FUTURE_CALLBACK,)]


def test_stock_vllm_hooks_without_overlap_cannot_tell(tmp_path: Path) -> None:
    write_raw_dbs(tmp_path, _vllm_hooks(overlapping=False, lost_start=False), [])
    result = check([tmp_path])
    assert result.verdict == CANNOT_TELL
    assert any("synchronize the NPU" in r for r in result.reasons)


def test_older_mspti_db_name_gives_the_pid(tmp_path: Path) -> None:
    spans, dev = mindie_async()
    paths = write_raw_dbs(tmp_path, spans, dev, older=True)
    assert paths[-1].name == "ascend_service_profiler_200.db"  # the older writer's name
    con = connect()
    load_run(con, [tmp_path], "r")
    pids = con.execute("SELECT DISTINCT attrs->>'pid' FROM async_spans WHERE name = 'compute'").fetchall()
    assert pids == [("200",)]


def test_unreadable_files_are_not_blamed_on_the_domain_filter(tmp_path: Path) -> None:
    spans, _ = mindie_async()
    write_csvs(tmp_path, [s for s in spans if s.name == "forward"])
    con = sqlite3.connect(tmp_path / "ms_service_host-100.db")
    con.execute("CREATE TABLE something_else (x TEXT)")  # a DB of no known generation
    con.commit()
    con.close()
    result = check([tmp_path])
    kinds = {w["kind"] for w in result.warnings}
    assert "unsupported_db" in kinds and m.WARN_SCHEDULE_DOMAIN_MISSING not in kinds
    assert any("could not be read" in r for r in result.reasons)
    assert not any("domain filter" in r for r in result.reasons)


def test_mstx_message_in_the_cpp_caret_form(tmp_path: Path) -> None:
    """The older parser repairs C++-written messages ``^key^:^value^,`` (db_data_source.py); so do we."""
    db = tmp_path / "ms_service_host-7.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE Mstx (message TEXT,flag INTEGER,markId INTEGER,timestamp INTEGER,endTimestamp INTEGER,"
                "pid INTEGER,tid INTEGER);")
    for n in range(4):
        start = T0_NS + n * 10 * MS
        con.execute("INSERT INTO Mstx VALUES (?,2,?,?,?,7,8)",
                    ("^name^:^BatchSchedule^,^domain^:^Schedule^,^batch_size^:3,", 2 * n, start, start + MS))
        con.execute("INSERT INTO Mstx VALUES (?,2,?,?,?,7,8)",
                    ('{"name": "modelExec", "domain": "Execute"}', 2 * n + 1, start + MS, start + 2 * MS))
    con.commit()
    con.close()
    c = connect()
    result = load_run(c, [db], "r")
    assert result.issues == []
    rows = c.execute("SELECT count(schedule_start), count(launch_start), min(batch_size) FROM async_steps").fetchone()
    assert rows == (4, 4, 3)
