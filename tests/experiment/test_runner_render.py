"""The runner's command rendering and resume rule (no server needed: the command is `false`)."""

from __future__ import annotations

import json
from pathlib import Path

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
