"""Demo traces -> report: the HOL preset yields HOL events with evidence, the FIFO-optimal preset none.

Runs the real threaded replica through the package's exporter (``otel_kvtrace.demo.run_demo``), then the
loader, the SQL and the JSON renderer on the files it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.demo import run_demo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    return run_demo("both", steps=25, out=tmp_path_factory.mktemp("demo"))


def _report(files: list[Path], tmp_path: Path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = CliRunner().invoke(main, ["report", *map(str, files), "--no-cache", "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_hol_preset_yields_hol_events_with_evidence(demo, tmp_path: Path) -> None:
    scenario = next(s for s in demo.scenarios if s.name == "hol")
    doc = _report(scenario.trace_files, tmp_path, "hol")
    hol = doc["hol"]
    assert hol["events"] > 0 and hol["total_ms"] > 0
    assert doc["tasks"]["count"] == scenario.recv_tasks
    for interval in hol["intervals"]:
        assert interval["evidence_correlation_id"] != interval["head_correlation_id"]
        assert interval["evidence_seq"] > interval["head_seq"]
        assert interval["evidence_ready_ns"] <= interval["start_ns"] < interval["end_ns"]
        assert interval["class"] in ("proven", "possible")


def test_fifo_optimal_preset_yields_no_hol(demo, tmp_path: Path) -> None:
    scenario = next(s for s in demo.scenarios if s.name == "fifo-optimal")
    doc = _report(scenario.trace_files, tmp_path, "fifo")
    assert doc["tasks"]["count"] == scenario.recv_tasks > 0
    assert doc["hol"]["events"] == 0 and doc["hol"]["intervals"] == []
    assert any(r["waiting_tasks"] > 0 for r in doc["hol"]["by_config"])  # heads did wait: nothing was ready


def test_notebook_executes_on_demo_output(demo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """queries/notebooks/hol_statistics.ipynb runs top to bottom on what `kvtrace demo` wrote."""
    import nbformat
    from nbclient import NotebookClient

    notebook = Path(__file__).resolve().parents[2] / "queries" / "notebooks" / "hol_statistics.ipynb"
    trace_dir = demo.scenarios[0].trace_files[0].parent
    monkeypatch.setenv("KVTRACE_TRACES", str(trace_dir))
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    recv_tasks = sum(s.recv_tasks for s in demo.scenarios)
    assert f"{recv_tasks} recv tasks" in text
    markdown = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "**Answer:** HOL blocking found" in markdown
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) >= 5


def test_perfetto_export_of_the_demo_is_valid_trace_event_json(demo, tmp_path: Path) -> None:
    """The real replica's traces (all scenarios) exported: the format holds and every HOL event has its
    one flow, so the viewers draw an arrow from each head to the ready task behind it."""
    from collections import Counter

    from otel_kvtrace.analyse import run_query
    from otel_kvtrace.load import load_traces

    from .trace_event_format import check_trace

    files = [f for s in demo.scenarios for f in s.trace_files]
    out = tmp_path / "demo.perfetto.json"
    result = CliRunner().invoke(main, ["export", "--no-cache", "--perfetto", str(out), *map(str, files)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert check_trace(doc) == []
    events = run_query(load_traces(files).con, "hol_events").rows
    flows = Counter(e["ph"] for e in doc["traceEvents"] if e["ph"] in ("s", "f"))
    assert events and flows == {"s": len(events), "f": len(events)}
    threads = {e["args"]["name"].split()[0] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"recv", "forward", "send", "HOL"} <= threads
