"""The runner's command rendering and resume rule (no server needed: the command is `false`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import orjson
import yaml

from otel_kvtrace.experiment.matrix import read_matrix
from otel_kvtrace.experiment.runner import render, run_matrix

COMMAND = ("kvtrace serve-replica --port {port} --data-dir {data_dir} --run-id {run_id} "
           "--kv-transfer-config '{kv_transfer_config}'")


def _matrix(tmp: Path, command: str = COMMAND, load: dict | None = None) -> Path:
    doc = {"runs": 1, "server": {"command": command, "startup_timeout_s": 5},
           "kv_transfer_config": {"kv_connector": "A", "kv_connector_extra_config": {"note": "it's here"}},
           "factors": {"prefetch_layers": [4]}, "load": load or {"num_requests": 2}}
    path = tmp / "matrix.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_values_with_spaces_and_quotes_stay_one_argument(tmp_path: Path) -> None:
    m = read_matrix(_matrix(tmp_path))
    data = tmp_path / "my runs" / "data"
    argv, _env = render(m, m.cells[0], 1234, data, "P4-r1")
    assert argv[argv.index("--data-dir") + 1] == str(data)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"note": "it's here", "layerwise_prefetch_layers": 4}


def test_resume_reruns_a_run_whose_command_or_load_changed(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    first = run_matrix(read_matrix(_matrix(tmp_path, command="false {port}")), out)
    assert [o.status for o in first] == ["failed"]
    status_path = out / "cells" / "P4" / "run-1" / "status.json"
    status = orjson.loads(status_path.read_bytes())
    status_path.write_bytes(orjson.dumps({**status, "status": "ok"}))  # as if it had succeeded
    same = run_matrix(read_matrix(_matrix(tmp_path, command="false {port}")), out)
    assert [o.status for o in same] == ["skipped"]
    changed = run_matrix(read_matrix(_matrix(tmp_path, command="false {port}", load={"num_requests": 3})), out)
    assert [o.status for o in changed] == ["failed"]  # run again, not silently reused


def test_port_taken_before_the_server_binds_is_retried(tmp_path: Path) -> None:
    # first attempt: a server that reports the port taken; the next attempt succeeds in binding
    marker = tmp_path / "tried"
    script = tmp_path / "server.py"
    script.write_text(f"import pathlib, sys\nm = pathlib.Path({str(marker)!r})\nif not m.exists():\n"
                      "    m.write_text('1')\n    print('OSError: [Errno 98] Address already in use')\n"
                      "    sys.exit(3)\nsys.exit(5)\n")
    command = f"python3 {script} {{port}}"
    run_matrix(read_matrix(_matrix(tmp_path, command=command)), tmp_path / "exp")
    status = orjson.loads((tmp_path / "exp" / "cells" / "P4" / "run-1" / "status.json").read_bytes())
    assert "code 5" in status["reason"]  # the second attempt ran


def test_health_check_ignores_http_proxy(tmp_path: Path, monkeypatch) -> None:
    import subprocess
    import sys

    from otel_kvtrace.experiment.runner import _wait_healthy

    import urllib.request

    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's cached opener read the env earlier
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    srv = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        line = srv.stdout.readline()
        port = int(line.split("port ")[1].split()[0])
        assert _wait_healthy(srv, f"http://127.0.0.1:{port}/", 10) == ""
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.parametrize(("patch", "message"), [
    ({"server": {"command": "x", "startup_timeout_s": "abc"}}, "server.startup_timeout_s must be a number"),
    ({"factors": {"num_shared_buffers": [{"a": 1}]}}, "factors.num_shared_buffers: level"),
    ({"factors": {"independent_layers": [["a"]]}}, "factors.independent_layers: level"),
    ({"load": {"num_requests": 0}}, "load.num_requests must be an integer >= 1"),
    ({"load": {"output_len": "many"}}, "load.output_len must be an integer"),
    ({"load": {"request_rate": -1}}, "load.request_rate must be a number > 0"),
])
def test_wrong_matrix_values_are_clear_errors(tmp_path: Path, patch: dict, message: str) -> None:
    from click.testing import CliRunner

    from otel_kvtrace.cli import main
    from otel_kvtrace.experiment.matrix import MatrixError

    doc = {"server": {"command": "x"}, "factors": {"prefetch_layers": [2]}, **patch}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(MatrixError, match=message):
        read_matrix(path)
    res = CliRunner().invoke(main, ["experiment", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and message.split(" must")[0].split(":")[0] in res.output
    assert "Traceback" not in res.output
