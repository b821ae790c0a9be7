"""The torch_npu profiler import: files shaped as the writer code in Ascend/pytorch writes them
(``torch_npu/profiler/analysis/prof_view``), read into attention/copy/communication slices and placed on
the KV tasks' time axis in the Perfetto export."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.load import load_traces
from otel_kvtrace.npu_profile import read_npu_profile, us_to_ns

from .trace_event_format import check_trace


def _us(ns: int, tail: str = "") -> str:
    """µs as torch_npu writes them (prof_common_func/_constant.py convert_ns2us_str)."""
    text = str(ns)
    return text[:-3] + "." + text[-3:] + tail


@pytest.fixture(scope="module")
def task_times(synthetic_trace_dir: Path) -> list[tuple[str, int, int]]:
    con = load_traces([synthetic_trace_dir]).con
    return con.execute("""SELECT correlation_id, backend_submit_start, backend_submit_end FROM tasks
                          WHERE backend_submit_start IS NOT NULL ORDER BY queue, seq LIMIT 3""").fetchall()


@pytest.fixture(scope="module")
def profiler_dirs(tmp_path_factory: pytest.TempPathFactory, task_times) -> tuple[Path, Path]:
    """rank0: trace_view.json (msprof timeline + torch_npu events); rank1: kernel_details.csv and
    communication.json only. Kernels sit at the KV tasks' backend_submit times."""
    root = tmp_path_factory.mktemp("prof")
    (_, s0, e0), (_, s1, e1), (_, s2, e2) = task_times
    out0 = root / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out0.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_name", "pid": 4, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "thread_name", "pid": 4, "tid": 2, "args": {"name": "Stream 2"}},
        {"ph": "M", "name": "thread_name", "pid": 4, "tid": 5, "args": {"name": "Stream 5"}},
        {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "Communication"}},
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 0, "args": {"name": "Plane 0"}},
        {"ph": "X", "name": "aten::matmul", "pid": 1, "tid": 9, "ts": _us(s0), "dur": 3.0},  # host op: not NPU
        {"ph": "X", "name": "FusedInferAttentionScore", "pid": 4, "tid": 2, "ts": _us(s0),
         "dur": (e0 - s0) / 1e3, "args": {"Task Type": "AI_CORE"}},
        {"ph": "X", "name": "MEMCPY_ASYNC", "pid": 4, "tid": 5, "ts": _us(s1), "dur": (e1 - s1) / 1e3,
         "args": {"Task Type": "MEMCPY_ASYNC"}},
        {"ph": "X", "name": "aclnnMatmul_MatMulV2_MatMulV2", "pid": 4, "tid": 2, "ts": _us(s1), "dur": 1.0,
         "args": {"Task Type": "AI_CORE"}},
        {"ph": "X", "name": "hcom_allReduce__123_0_1", "pid": 7, "tid": 0, "ts": _us(s2), "dur": 2.5},
        {"ph": "X", "name": "FlashAttentionScore", "pid": 4, "tid": 2, "ts": "not-a-time", "dur": 1.0},
        {"ph": "s", "bp": "e", "name": "torch_to_npu", "id": 1, "pid": 1, "tid": 9, "ts": _us(s0), "cat": "async_npu"},
    ]
    (out0 / "trace_view.json").write_text(json.dumps(events))
    out1 = root / "rank1_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out1.mkdir(parents=True)
    with (out1 / "kernel_details.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Step Id", "Device_id", "Name", "Type", "Accelerator Core", "Start Time(us)",
                         "Duration(us)", "Wait Time(us)", "Block Num"])
        writer.writerow([1, 1, "PagedAttention_1", "PagedAttention", "AI_CORE", _us(s0, "\t"), "12.5", "0", "24"])
        writer.writerow([1, 1, "H2D_copy_2", "MemcpyAsync", "AI_VECTOR_CORE", _us(s1, "\t"), "3", "0", "1"])
        writer.writerow([1, 1, "Add_3", "Add", "AI_VECTOR_CORE", _us(s1, "\t"), "1", "0", "1"])
    (out1 / "communication.json").write_text(json.dumps({"step1": {
        "collective": {"hcom_allGather__9_1@group": {"Communication Time Info": {
            "Start Timestamp(us)": _us(s2), "Elapse Time(ms)": 0.25, "Transit Time(ms)": 0.2}},
            "Total Op Info": {"Communication Time Info": {"Elapse Time(ms)": 0.25}}},
        "p2p": {"hcom_send__1_2": {"Communication Time Info": {"Elapse Time(ms)": 1.0}}}}}))
    return out0.parent, out1.parent


def test_reader_takes_kernels_copies_and_communication_at_exact_times(profiler_dirs, task_times) -> None:
    rank0, rank1 = profiler_dirs
    (_, s0, e0), (_, s1, _), (_, s2, _) = task_times
    profile = read_npu_profile([rank0])
    assert [(e.kind, e.lane) for e in profile.events] == [
        ("attention", "Stream 2"), ("copy", "Stream 5"), ("communication", "Plane 0")]
    assert profile.events[0].start_ns == s0 and abs(profile.events[0].end_ns - e0) <= 1
    assert profile.other_kernels == 1  # the MatMul; the host op is not a device task at all
    assert len(profile.skipped) == 1 and "trace_view.json:11: not a time" in profile.skipped[0]

    other = read_npu_profile([rank1])
    kinds = sorted((e.kind, e.name, e.start_ns, e.end_ns - e.start_ns) for e in other.events)
    assert kinds == [("attention", "PagedAttention_1", s0, 12_500), ("communication", "hcom_allGather__9_1", s2, 250_000),
                     ("copy", "H2D H2D_copy_2", s1, 3_000)]
    assert any("hcom_send__1_2" in p for p in other.skipped)  # no start timestamp: named, not guessed
    assert us_to_ns("1764000000000123.456\t") == 1764000000000123456


def test_export_places_npu_slices_on_the_kv_axis(synthetic_trace_dir: Path, profiler_dirs, task_times,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "merged.json"
    args = ["export", "--perfetto", str(out), str(synthetic_trace_dir), "--npu-profile", str(profiler_dirs[0]),
            "--npu-profile", str(profiler_dirs[1] / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"),
            "--npu-offset-us", "2.5"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "5 attention/copy/communication slices from 2 file(s); 2 other kernels" in result.output
    assert "1 record(s) skipped" in result.output
    doc = orjson.loads(out.read_bytes())
    assert check_trace(doc) == []
    events = doc["traceEvents"]
    (npu_pid,) = [e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
                  and e["args"]["name"].startswith("NPU")]
    npu = [e for e in events if e["ph"] == "X" and e["pid"] == npu_pid]
    assert {e["cat"] for e in npu} == {"npu.attention", "npu.copy", "npu.communication"}
    cid, s0, _ = task_times[0]
    submit = next(e for e in events if e["ph"] == "X" and e["name"] == "backend_submit"
                  and e["args"]["correlation_id"] == cid)
    attention = next(e for e in npu if e["name"] == "FusedInferAttentionScore")
    assert attention["ts"] == pytest.approx(submit["ts"] + 2.5, abs=1e-3)  # same axis, offset applied


def test_missing_profile_is_a_clear_error(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["export", "--perfetto", str(tmp_path / "x.json"), str(synthetic_trace_dir),
                                       "--npu-profile", str(tmp_path)])
    assert result.exit_code != 0 and "no trace_view.json" in result.output
    assert "Traceback" not in result.output


@pytest.mark.browser
def test_html_report_draws_npu_slices_beside_the_tasks(synthetic_trace_dir: Path, profiler_dirs, task_times,
                                                      tmp_path: Path) -> None:
    from browser import chromium_page

    page_path = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(synthetic_trace_dir), "--no-cache", "--html", str(page_path),
                                       "--timeline-tasks", "2000", "--npu-profile", str(profiler_dirs[0])])
    assert result.exit_code == 0, result.output
    cid = task_times[0][0]
    with chromium_page() as (page, log):
        page.goto(page_path.as_uri())
        page.wait_for_selector("#timeline rect.stage")
        page.click("#zoom-all")
        kinds = page.evaluate("[...document.querySelectorAll('#timeline rect.npu')].map(r => r.getAttribute('class'))")
        timeline = page.evaluate("JSON.parse(document.getElementById('kvtrace-data').textContent).timeline")
        task = next(t for t in timeline["tasks"] if t["cid"] == cid)
        _, start, end = next(s for s in task["stages"] if s[0] == "backend_submit")
        page.evaluate(f"window.kvtraceTimeline.setView({start - 20}, {end + 20})")  # ~1 us per pixel
        boxes = page.evaluate("""cid => {
            const x = el => el ? el.getBBox().x : null;
            const submit = [...document.querySelectorAll('#timeline rect.stage')].find(
                r => r.getAttribute('data-cid') === cid && r.getAttribute('data-stage') === 'backend_submit');
            return {submit: x(submit), attention: x(document.querySelector('#timeline rect.npu-attention'))};
        }""", cid)
    assert log.errors == []
    assert sorted(kinds) == ["npu npu-attention", "npu npu-communication", "npu npu-copy"]
    assert boxes["submit"] is not None and abs(boxes["attention"] - boxes["submit"]) < 0.5  # same axis


def test_msprof_timeline_without_torch_npu_output(profiler_dirs, tmp_path: Path) -> None:
    """A bare msprof collection (no ASCEND_PROFILER_OUTPUT): its msprof_*.json timeline holds the same
    events torch_npu copies into trace_view.json, so it is read the same way."""
    out = tmp_path / "PROF_000001_20261201" / "mindstudio_profiler_output"
    out.mkdir(parents=True)
    timeline = (profiler_dirs[0] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text()
    (out / "msprof_20261201120000.json").write_text(timeline)
    (out / "msprof_notes.json").write_text("{}")  # not a timeline name: not read
    profile = read_npu_profile([tmp_path])
    assert profile.files == [str(out / "msprof_20261201120000.json")]
    assert [e.kind for e in profile.events] == ["attention", "copy", "communication"]


def test_absurd_times_are_skipped_and_named(profiler_dirs, tmp_path: Path) -> None:
    """A corrupt ``ts`` (1e30 µs, beyond int64 ns; a day away) or ``dur`` must not stretch the timelines."""
    events = json.loads((profiler_dirs[0] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    good_ts = next(e["ts"] for e in events if e.get("name") == "FusedInferAttentionScore")
    bad = [("1e30", 1.0), (str(float(good_ts) + 3 * 86400e6), 1.0), (good_ts, 2 * 3600e6), ("-5", 1.0)]
    events += [{"ph": "X", "name": f"FlashAttentionScore_{i}", "pid": 4, "tid": 2, "ts": ts, "dur": dur}
               for i, (ts, dur) in enumerate(bad)]
    (tmp_path / "trace_view.json").write_text(json.dumps(events))
    profile = read_npu_profile([tmp_path / "trace_view.json"])
    assert [e.name for e in profile.events] == ["FusedInferAttentionScore", "MEMCPY_ASYNC", "hcom_allReduce__123_0_1"]
    reasons = sorted(p.split(": ", 1)[1].split(" (")[0] for p in profile.skipped)
    assert len(reasons) == 5, profile.skipped  # the four above and the fixture's "not-a-time"
    assert sum("int64" in r for r in reasons) == 2 and sum("longer than an hour" in r for r in reasons) == 1
    assert sum("from the profile's other slices" in r for r in reasons) == 1
