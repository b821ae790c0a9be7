"""`kvtrace report` end to end on synthetic traces: terminal, --json, --png-dir, --html, --db."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
from click.testing import CliRunner
from PIL import Image

from otel_kvtrace.analyse import hol_intervals
from otel_kvtrace.cli import main
from otel_kvtrace.load import load_traces
from otel_kvtrace.report import build_report, print_summary


def test_report_cli_writes_json_pngs_html_and_db(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "report", str(synthetic_trace_dir), "--json", str(out / "r.json"), "--png-dir", str(out / "png"),
        "--html", str(out / "r.html"), "--db", str(out / "kv.duckdb"), "--timeline-tasks", "200"])
    assert result.exit_code == 0, result.output
    assert "HOL blocking found" in result.output

    doc = json.loads((out / "r.json").read_text())
    expected = hol_intervals(load_traces(synthetic_trace_dir).con).records()
    assert doc["hol"]["events"] == len({(r["queue"], r["head_correlation_id"]) for r in expected}) > 0
    assert len(doc["hol"]["intervals"]) == len(expected)
    assert {i["class"] for i in doc["hol"]["intervals"]} == {"proven", "possible"}
    first = doc["hol"]["intervals"][0]
    assert first["head_correlation_id"] and first["evidence_correlation_id"] and first["end_ns"] > first["start_ns"]
    assert doc["hol"]["total_ms"] == sum(r["dur_ns"] for r in expected) / 1e6
    assert doc["hol"]["p50_ms"] <= doc["hol"]["p95_ms"] <= doc["hol"]["p99_ms"]
    assert doc["tasks"]["count"] == 700 and doc["tasks"]["send_tasks"] > 0
    assert {s["stage"] for s in doc["stages"]} >= {"queue_wait", "backend_submit", "task_total"}

    pngs = sorted(p.name for p in (out / "png").glob("*.png"))
    assert pngs == ["hol_durations.png", "stage_cdf.png", "timeline_queue0.png", "timeline_queue1.png"]
    for png in (out / "png").glob("*.png"):
        with Image.open(png) as image:
            assert image.size[0] > 400 and len(image.convert("L").getcolors(256)) > 10  # not blank

    page = (out / "r.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert page.count("data:image/png;base64,") == 4

    con = duckdb.connect(str(out / "kv.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM tasks").fetchall()[0][0] == 700
    assert con.execute("SELECT sum(hol_events) FROM hol_summary").fetchall()[0][0] == doc["hol"]["events"]


def test_report_cli_names_the_bad_path(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(tmp_path / "missing.jsonl"), "--no-cache"])
    assert result.exit_code == 2
    assert "missing.jsonl" in result.output and "PATHS" in result.output


def test_print_summary_reports_no_hol_plainly(tmp_path: Path) -> None:
    from rich.console import Console
    from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json

    spec = QueueSpec(run_id="calm")
    tasks = simulate_queue(spec, 40, seed=3, hol_probability=0.0)
    for task in tasks:  # no dependencies at all: nothing ever waits
        task.deps.clear()
        for stage in ("save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "slot_release_wait"):
            task.stages.pop(stage, None)
    path = write_otlp_json(tmp_path / "calm.jsonl", [(spec, tasks)])
    console = Console(record=True, width=120)
    report = print_summary([path], console)
    assert report.hol_overall["events"] == 0
    assert "No head-of-line blocking" in console.export_text()


def test_build_report_accepts_a_load_result(synthetic_trace_dir: Path) -> None:
    loaded = load_traces(synthetic_trace_dir)
    report = build_report(loaded)
    assert report.stats is loaded.stats
    assert report.timeline["shown"] > 0 and report.timeline["hol"]


def test_traces_with_only_send_tasks_report_plainly(tmp_path: Path) -> None:
    import orjson
    from synthetic_traces import QueueSpec, resource_attributes, send_task_span

    spec = QueueSpec(run_id="sendonly")
    spans = [send_task_span(spec, 0, layer, 10**18 + layer * 1000, 10**18 + layer * 1000 + 500, layer)
             for layer in range(4)]
    doc = {"resourceSpans": [{"resource": {"attributes": resource_attributes(spec)},
                              "scopeSpans": [{"scope": {"name": "otel_kvtrace"}, "spans": spans}]}]}
    path = tmp_path / "send.jsonl"
    path.write_bytes(orjson.dumps(doc) + b"\n")
    result = CliRunner().invoke(main, ["report", str(path), "--no-cache", "--html", str(tmp_path / "r.html"),
                                       "--png-dir", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    assert "No recv tasks in these traces (4 send tasks" in " ".join(result.output.split())


def test_timelines_start_with_the_queue_with_most_hol_and_cdfs_are_per_config(tmp_path: Path) -> None:
    """The PNG timeline of queue 0 is the HOL queue even when a calm queue sorts first by name and is
    larger; the stage CDF samples are kept per configuration, not pooled."""
    from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json

    calm = QueueSpec(run_id="aaa-calm", pid=1, cfg_label="calm")
    busy = QueueSpec(run_id="zzz-hol", pid=2, cfg_label="hol")
    path = write_otlp_json(tmp_path / "t.jsonl", [(calm, simulate_queue(calm, 300, seed=4, hol_probability=0.0)),
                                                  (busy, simulate_queue(busy, 100, seed=5, hol_probability=0.3))])
    report = build_report([path], timeline_tasks=200)
    hol_by_queue: dict[str, int] = {}
    for r in report.hol_intervals.records():
        hol_by_queue[r["queue"]] = hol_by_queue.get(r["queue"], 0) + r["dur_ns"]
    assert report.timeline["queues"][0] == max(hol_by_queue, key=hol_by_queue.get) == busy.queue_id
    assert set(report.stage_samples) == {"calm", "hol"}
    assert sum(len(v) for v in report.stage_samples["calm"].values()) > sum(
        len(v) for v in report.stage_samples["hol"].values())


def test_report_fits_80_columns_when_piped(synthetic_trace_dir: Path) -> None:
    """`COLUMNS=80 kvtrace report ... | cat`: no line over 80 characters, nothing cut to `…`, full task
    ids (the run stays visible), one unit (ms) and shares in %."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", "report", str(synthetic_trace_dir), "--no-cache"],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in proc.stdout
    report = build_report([synthetic_trace_dir])
    longest = max(report.hol_intervals.records(), key=lambda r: r["dur_ns"])
    assert longest["head_correlation_id"] in proc.stdout and longest["evidence_correlation_id"] in proc.stdout
    assert f"{longest['dur_ns'] / 1e6:.3f}" in proc.stdout  # the duration in ms, not ns
    assert "% of dep wait" in proc.stdout and " ns" not in proc.stdout
    for label in report.configs.column("cfg_label"):
        assert label in proc.stdout  # in the legend, whole


def test_one_call_report_api_writes_each_output(synthetic_trace_dir: Path, tmp_path: Path) -> None:
    from otel_kvtrace.report import report

    written: list[Path] = []
    result = report([synthetic_trace_dir], json=tmp_path / "r.json", html=tmp_path / "r.html",
                    png_dir=tmp_path / "png", written=written, timeline_tasks=100)
    assert {p.name for p in written} >= {"r.json", "r.html", "stage_cdf.png"}
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["hol"]["events"] == result.hol_overall["events"] == len(result.hol_events.rows) > 0
    result = CliRunner().invoke(main, ["report", str(synthetic_trace_dir), "--no-cache", "--jaeger-url", "ftp://x"])
    assert result.exit_code != 0 and "http(s) URL" in result.output
