"""msServiceProfiler importers on fixture files written from the documented schemas (research §1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.analysis import CANNOT_TELL, EFFECTIVE, NOT_EFFECTIVE, check
from otel_kvtrace.asynccheck.importers import import_paths
from otel_kvtrace.asynccheck.tables import connect, load_run
from otel_kvtrace.asynccheck.units import epoch_unit, to_ns

from .captures import EPOCH_NS, build_db, copy_fixture


def test_chrome_tracing_units_markers_and_malformed_events(tmp_path: Path) -> None:
    path = copy_fixture("mindie_async_chrome_tracing.json", tmp_path / "chrome_tracing.json")
    result = import_paths([path], "r")
    sched = sorted(s.start_ns for s in result.spans if s.name == m.BATCH_SCHEDULE)
    # ts 1767225600000000.5 µs -> exact ns, no float rounding at epoch magnitude
    assert sched[0] == EPOCH_NS + 500
    assert len(sched) == 4
    forward = [s for s in result.spans if s.origin == "forward(async)"]
    assert forward and forward[0].end_ns - forward[0].start_ns == 150_250  # dur 150.25 µs
    execute = sorted((s for s in result.spans if s.origin == "Execute"), key=lambda s: s.start_ns)
    assert execute[0].start_ns == EPOCH_NS + 1_500_500  # ts given as a numeric string
    markers = {mk.marker: mk.count for mk in result.markers}
    assert markers == {m.MARKER_MINDIE_ASYNC_FORWARD: 4, m.MARKER_MINDIE_ASYNC_SPANS: 4}
    assert [(i.line, i.reason.split(":")[0]) for i in result.issues] == [
        (15, "event 'BatchSchedule'"),
        (16, "event is not a JSON object"),
    ]
    assert all(i.file == str(path) for i in result.issues)


def test_chrome_tracing_mindie_async_capture_is_effective(tmp_path: Path) -> None:
    path = copy_fixture("mindie_async_chrome_tracing.json", tmp_path / "chrome_tracing.json")
    result = check([path])
    assert result.verdict == EFFECTIVE
    # schedule(n+1) = [10000, 11500] µs vs execute(n) = [1500, 11100] (end of its last kernel, the
    # all-reduce): 1100 of 1500 µs
    assert result.metrics.overlap_ratio == pytest.approx(1100 / 1500)
    # next step's first kernel starts 0.9 ms after this step's all-reduce ends
    assert result.metrics.gap_p50_ms == pytest.approx(0.9)
    # all-reduce [10900, 11100] µs, compute ends at 11000: half of it exposed
    assert result.metrics.comm_exposed_share == pytest.approx(0.5)
    assert result.import_errors == 2


def test_forward_and_batch_csv_unit_conventions(tmp_path: Path) -> None:
    fwd = copy_fixture("forward.csv", tmp_path / "forward.csv")
    batch = copy_fixture("batch.csv", tmp_path / "batch.csv")
    result = import_paths([fwd, batch], "r")
    forward = sorted(s.start_ns for s in result.spans if s.name == m.FORWARD)
    sched = sorted(s.start_ns for s in result.spans if s.name == m.BATCH_SCHEDULE)
    assert forward[0] == EPOCH_NS + 1_700_000  # 1767225600001.700 ms
    assert sched[1] == EPOCH_NS + 10_000_000  # 1767225600010000 "ms" is epoch µs
    unit_warnings = [w for w in result.warnings if w.kind == m.WARN_UNIT_GUESS]
    assert len(unit_warnings) == 1 and "read as us" in unit_warnings[0].message
    assert unit_warnings[0].file == str(batch)
    lines = sorted((Path(i.file).name, i.line) for i in result.issues)
    assert lines == [("batch.csv", 4), ("forward.csv", 5)]


def test_csv_capture_with_low_overlap_cannot_tell(tmp_path: Path) -> None:
    """forward.csv drops MindIE's ``async`` attribute: a low overlap may be a host launch, not async off."""
    fwd = copy_fixture("forward.csv", tmp_path / "forward.csv")
    batch = copy_fixture("batch.csv", tmp_path / "batch.csv")
    result = check([fwd, batch])
    assert result.verdict == CANNOT_TELL
    assert result.metrics.overlap_ratio == 0.0
    assert result.metrics.gap_p50_ms == pytest.approx(2.0)  # forward(n+1) start - forward(n) end
    assert m.WARN_FORWARD_KIND_UNKNOWN in {w["kind"] for w in result.warnings}


def test_profiler_db_with_vllm_sync_hooks_cannot_tell(tmp_path: Path) -> None:
    db = build_db("profiler_vllm_hooks.sql", tmp_path / "profiler.db")
    result = check([db])
    assert result.verdict == CANNOT_TELL
    assert m.WARN_NPU_SYNC_HOOKS in {w["kind"] for w in result.warnings}
    assert sorted((i["line"], i["reason"].split(":")[0]) for i in result.import_error_samples) == [
        (90, "slice 'modelExec'"),
        (91, "slice 'modelExec'"),
    ]


def test_profiler_db_slice_times_are_ns_and_pid_comes_from_thread(tmp_path: Path) -> None:
    db = build_db("profiler_vllm_hooks.sql", tmp_path / "profiler.db")
    result = import_paths([db], "r")
    first = min(
        (s for s in result.spans if s.name == m.BATCH_SCHEDULE), key=lambda s: s.start_ns
    )
    assert (first.start_ns, first.end_ns) == (EPOCH_NS, EPOCH_NS + 1_500_000)
    assert first.attrs["pid"] == 500


def test_raw_db_without_schedule_domain_warns(tmp_path: Path) -> None:
    db = build_db("ms_service_no_schedule.sql", tmp_path / "ms_service_host-300.db")
    result = check([db])
    assert result.verdict == CANNOT_TELL
    kinds = {w["kind"] for w in result.warnings}
    assert m.WARN_SCHEDULE_DOMAIN_MISSING in kinds
    assert any("domain filter dropped 'Schedule'" in r for r in result.reasons)


def test_mspti_communication_exposure_and_malformed_row(tmp_path: Path) -> None:
    db = build_db("mspti.sql", tmp_path / "ascend_service_profiler_host-4242.db")
    con = connect()
    result = load_run(con, [db], "r")
    comm = con.execute("SELECT count(*), min(attrs->>'pid') FROM async_spans WHERE name = 'communication'").fetchone()
    assert comm == (2, "4242")  # pid from the file name; the broken row is skipped
    assert [(i.line, "ends before" in i.reason or "end >= start" in i.reason) for i in result.issues] == [(3, True)]
    checked = check([db])
    assert checked.metrics.comm_total_ms == pytest.approx(0.7)
    assert checked.metrics.comm_exposed_share == pytest.approx(500 / 700)


@pytest.mark.parametrize(("name", "warned"), [("service_profiling_symbols.yaml", True),
                                              ("service_profiling_symbols_clean.yaml", False)])
def test_symbols_file_with_synchronising_hooks(tmp_path: Path, name: str, warned: bool) -> None:
    path = copy_fixture(name, tmp_path / name)
    result = import_paths([path], "r")
    assert (m.WARN_NPU_SYNC_HOOKS in {w.kind for w in result.warnings}) is warned


def test_syntax_error_in_chrome_array_is_reported_with_line(tmp_path: Path) -> None:
    path = tmp_path / "chrome_tracing.json"
    path.write_text('[\n{"name": "BatchSchedule", "ph": "X", "ts": 1767225600000000, "dur": 1, "pid": 1, "tid": "Schedule(1)"},\n{"name": oops}\n]\n')
    result = import_paths([path], "r")
    assert len(result.spans) == 1
    assert [i.line for i in result.issues] == [3]


def test_unknown_file_and_missing_path(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    result = import_paths([other], "r")
    assert [w.kind for w in result.warnings] == ["unsupported_file"]
    with pytest.raises(FileNotFoundError, match="no-such"):
        import_paths([tmp_path / "no-such"], "r")


@pytest.mark.parametrize(("value", "unit"), [(1.7e18, "ns"), (1.7e15, "us"), (1.7e12, "ms"), (1.7e9, "s"), (12.5, None)])
def test_epoch_magnitude(value: float, unit: str | None) -> None:
    assert epoch_unit(value) == unit


def test_to_ns_is_exact_at_epoch_magnitude() -> None:
    assert to_ns(1767225600000000.25, "us") == 1767225600000000250
    assert to_ns(1767225600001.5, "ms") == 1767225600001500000


def test_forward_csv_alone_asks_for_batch_csv(tmp_path: Path) -> None:
    fwd = copy_fixture("forward.csv", tmp_path / "forward.csv")
    result = check([fwd])
    assert result.verdict == CANNOT_TELL
    assert m.WARN_SCHEDULE_MISSING in {w["kind"] for w in result.warnings}
    assert m.WARN_SCHEDULE_DOMAIN_MISSING not in {w["kind"] for w in result.warnings}
    assert any("add batch.csv" in r for r in result.reasons)
    assert result.metrics.gap_p50_ms == pytest.approx(2.0)  # gaps still come from the forwards


def test_mindie_async_without_device_times_cannot_tell_but_shows_markers(tmp_path: Path) -> None:
    text = copy_fixture("mindie_async_chrome_tracing.json", tmp_path / "full.json").read_text()
    lines = [ln for ln in text.splitlines() if '"Kernel"' not in ln]
    path = tmp_path / "chrome_tracing.json"
    path.write_text("\n".join(lines) + "\n")
    result = check([path])
    assert result.verdict == CANNOT_TELL
    assert any("no output-ready (device completion) times" in r for r in result.reasons)
    assert any("async path markers present" in r and m.MARKER_MINDIE_ASYNC_FORWARD in r for r in result.reasons)
