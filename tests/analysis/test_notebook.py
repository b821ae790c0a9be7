"""queries/notebooks/hol_statistics.ipynb executes top to bottom (nbclient) on generated traces."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "queries" / "notebooks" / "hol_statistics.ipynb"


def test_notebook_executes_on_traces(synthetic_trace_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVTRACE_TRACES", str(synthetic_trace_dir))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "700 recv tasks" in text and "HOL events:" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # stage CDF, HOL histogram, timeline, queue depth, consumer stall
