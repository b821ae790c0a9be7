"""kvtrace experiment against real serve-replica processes: 2 x 2 x 3 runs, report, failures, resume, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import yaml
from click.testing import CliRunner

from otel_kvtrace.cli import main

ROOT = Path(__file__).resolve().parents[2]
SERVER = ("kvtrace serve-replica --port {port} --data-dir {data_dir} --run-id {run_id} "
          "--kv-transfer-config '{kv_transfer_config}' --max-num-seqs {concurrency}")


def _matrix(tmp: Path, factors: dict, *, runs: int = 3, command: str = SERVER, load: dict | None = None,
            env: dict | None = None) -> Path:
    doc = {"name": "t", "runs": runs, "environment": {"hardware": "<b>cpu</b>", "tp": 1},
           "server": {"command": command, "startup_timeout_s": 60, "env": env or {}},
           "kv_transfer_config": {"kv_connector": "AscendStoreConnector",
                                  "kv_connector_extra_config": {"layerwise_independent_layers": [0, 4]}},
           "factors": factors, "load": load or {"num_requests": 4, "prompt_len": 1024, "output_len": 2}}
    path = tmp / "matrix.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_example_matrix_is_valid() -> None:
    from otel_kvtrace.experiment.matrix import read_matrix

    m = read_matrix(ROOT / "examples" / "experiment-replica.yaml")
    assert len(m.cells) == 4 and m.runs >= 3
    assert {c.config["num_shared_buffers"] for c in m.cells} == {2, 4}


@pytest.mark.slow
@pytest.mark.browser
def test_two_by_two_experiment_report_json_contract(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    matrix = _matrix(tmp_path, {"num_shared_buffers": [2, 4], "prefetch_layers": [2, 4], "concurrency": [4]})
    res = CliRunner().invoke(main, ["experiment", str(matrix), "--out", str(out), "--report"])
    assert res.exit_code == 0, res.output
    doc = orjson.loads((out / "report.json").read_bytes())
    assert set(doc) >= {"environment", "cells", "factor_effects", "verdict"}
    assert doc["environment"]["hardware"] == "<b>cpu</b>"
    assert len(doc["cells"]) == 4
    for cell in doc["cells"]:
        assert set(cell) >= {"config", "runs", "ttft_ms", "throughput_tok_s", "hol", "peak_host_rss_mb",
                             "peak_inflight_tasks"}
        assert [r["status"] for r in cell["runs"]] == ["ok"] * 3
        assert set(cell["ttft_ms"]) == {"p50", "p95", "p99"} and cell["ttft_ms"]["p50"] > 0
        assert set(cell["hol"]) >= {"events", "total_ms"} and cell["throughput_tok_s"] > 0
        assert cell["peak_inflight_tasks"] >= 1 and cell["peak_host_rss_mb"] > 10
        assert cell["peak_outstanding_leases"] >= 1 and cell["stage_ms"]["queue_wait"] >= 0
    cells = {(c["config"]["num_shared_buffers"], c["config"]["prefetch_layers"]): c for c in doc["cells"]}
    # hol preset (slow save of layer 1, independent layer 4): HOL needs shared buffers (B=2) AND a window
    # reaching past the slow save (P=4); B=4 or P=2 removes it
    assert cells[(2, 4)]["hol"]["events"] > 0
    assert cells[(4, 2)]["hol"]["events"] == 0
    w = cells[(2, 4)]["wait_percentiles"]
    assert w["hol_event_ms"]["p50"] > 0 and cells[(4, 2)]["wait_percentiles"]["hol_event_ms"]["p50"] is None
    assert 0 <= w["queue_wait_ms"]["p50"] <= w["queue_wait_ms"]["p95"] <= w["queue_wait_ms"]["p99"]
    effects = {(e["factor"], e["metric"]): e for e in doc["factor_effects"]}
    assert {"num_shared_buffers", "prefetch_layers", "num_shared_buffers:prefetch_layers"} <= {f for f, _ in effects}
    assert all(e["noise"] is not None for e in doc["factor_effects"])
    assert effects[("num_shared_buffers", "hol_total_ms")]["effect"] < 0
    assert "HOL time" in doc["verdict"]
    html = (out / "report.html").read_text()
    assert "<b>cpu</b>" not in html and "&lt;b&gt;cpu&lt;/b&gt;" in html  # trace/matrix values are escaped
    _check_in_chromium(out / "report.html")
    # resumable: a second run skips every finished run
    again = CliRunner().invoke(main, ["experiment", str(matrix), "--out", str(out)])
    assert again.exit_code == 0 and "12 of 12 runs ok (12 from before)" in again.output
    # a damaged run folder is reported as unreadable; the report is still written
    next(out.glob("cells/*/run-2/load.json")).unlink()
    res = CliRunner().invoke(main, ["experiment", str(out), "--report"])
    assert res.exit_code == 0, res.output
    runs = [r for c in orjson.loads((out / "report.json").read_bytes())["cells"] for r in c["runs"]]
    assert [r["status"] for r in runs].count("unreadable") == 1


@pytest.mark.slow
def test_scheduler_axis_compares_measured_policies(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    matrix = _matrix(tmp_path, {"scheduler": ["fifo", "ready_queue"]}, runs=2,
                     env={"OTEL_KVTRACE_SCHEDULER": "{scheduler}"})
    res = CliRunner().invoke(main, ["experiment", str(matrix), "--out", str(out), "--report"])
    assert res.exit_code == 0, res.output
    doc = orjson.loads((out / "report.json").read_bytes())
    [m] = doc["measured_policies"]
    assert (m["fifo_cell"], m["policy"], m["policy_cell"]) == ("fifo", "ready_queue", "ready_queue")
    assert "error" not in m, m
    assert isinstance(m["predicted_gain_ms"], float) and isinstance(m["measured_gain_ms"], float) and m["verdict"]
    assert "Measured policies" in (out / "report.md").read_text()


def _check_in_chromium(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from browser import chromium_page

    with chromium_page() as (page, log):
        page.goto(path.as_uri())
        assert page.locator("#verdict").inner_text().startswith("HOL time")
        assert page.locator("table.heatmap[data-metric=hol_total_ms] td.hm").count() == 4
        assert page.locator("table").first.locator("tbody tr").count() == 4
        assert not log.errors, log.errors
        assert all(u.startswith("file:") for u in log.requests), log.requests


def test_server_that_fails_to_start_or_dies_is_reported_and_the_rest_go_on(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    # independent layer 99 does not exist for N=8: that server exits at once with a clear error
    matrix = _matrix(tmp_path, {"independent_layers": [[0, 4], [99]]}, runs=1)
    res = CliRunner().invoke(main, ["experiment", str(matrix), "--out", str(out)])
    assert res.exit_code == 1
    assert "FAILED ind99 run 1: server exited with code 2 before it was healthy" in res.output
    assert "unknown layer 99" in res.output  # the server log tail
    assert "1 of 2 runs ok" in res.output
    status = orjson.loads((out / "cells" / "ind0_4" / "run-1" / "status.json").read_bytes())
    assert status["status"] == "ok"
    # a server killed mid-run: the run fails with the reason, the report still gets written
    died = _matrix(tmp_path, {"prefetch_layers": [4]}, runs=1, command="timeout -s KILL 3 " + SERVER,
                   load={"num_requests": 4, "prompt_len": 100, "output_len": 2000})
    res = CliRunner().invoke(main, ["experiment", str(died), "--out", str(tmp_path / "died")])
    assert res.exit_code == 1
    assert "requests failed" in res.output or "server exited with code" in res.output
    assert "Traceback" not in res.output


def test_ctrl_c_stops_the_server_it_started(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    matrix = _matrix(tmp_path, {"prefetch_layers": [4]}, runs=1,
                     load={"num_requests": 4, "prompt_len": 100, "output_len": 3000})
    proc = subprocess.Popen([sys.executable, "-m", "otel_kvtrace.cli", "experiment", str(matrix), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = out / "cells" / "P4" / "run-1" / "server.pid"
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and (out / "cells" / "P4" / "run-1" / "server.log").stat().st_size) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the load is running
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "interrupted" in err, err
    assert "Traceback" not in err
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
