"""queries/notebooks/hol_statistics.ipynb executes top to bottom (nbclient) on generated traces: pandas
DataFrames, a parameters cell, the HOL queue chosen automatically, per-config plots, the interactive
page, and text that interprets the numbers."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from otel_kvtrace.report import build_report

NOTEBOOK = Path(__file__).resolve().parents[2] / "queries" / "notebooks" / "hol_statistics.ipynb"


def test_notebook_executes_on_traces(synthetic_trace_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVTRACE_TRACES", str(synthetic_trace_dir))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert "parameters" in nb.cells[1].metadata.get("tags", [])  # papermill-style parameters cell
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "700 recv tasks" in text
    report = build_report([synthetic_trace_dir])
    hol_ms: dict[str, int] = {}
    for r in report.hol_intervals.records():
        hol_ms[r["queue"]] = hol_ms.get(r["queue"], 0) + r["dur_ns"]
    assert f"queue shown: {max(hol_ms, key=hol_ms.get)}" in text  # the HOL queue, chosen automatically
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert html.count('class="dataframe"') >= 6  # the query results are DataFrames
    assert "<iframe" in html and (tmp_path / "hol_report.html").is_file()  # the interactive timeline
    markdown = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "**Answer:** HOL blocking found" in markdown and "% of its dependency wait is proven HOL" in markdown
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # stage CDFs, HOL histogram, timeline, queue depth, consumer stall
