"""Several runs in one input get one verdict each; inputs without async spans are refused with a sentence."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.asynccheck.analysis import check
from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
from otel_kvtrace.asynccheck.runs import NothingToCheckError, SeveralRunsError
from otel_kvtrace.cli import main

from .msprof_writer import write_parse_folder

from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json  # bench/, on sys.path via tests/conftest.py


@pytest.fixture(scope="module")
def replica_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async")
    for mode in ("sync", "async", "serialised"):
        run_replica(ReplicaConfig(mode=mode, num_steps=6), out_dir=out)
    return out


def test_replica_folder_gets_one_verdict_per_run(tmp_path: Path, replica_folder: Path) -> None:
    with pytest.raises(SeveralRunsError) as exc:
        check([replica_folder])
    assert set(exc.value.runs or {}) == {"replica-sync", "replica-async", "replica-serialised"}
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["async", "check", str(replica_folder), "--json", str(out)], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "3 runs found" in result.output
    verdicts = {r["run"]: r["verdict"] for r in orjson.loads(out.read_bytes())}
    assert verdicts == {"replica-sync": "not effective", "replica-async": "effective",
                        "replica-serialised": "not effective"}


def test_compare_fits_80_columns_without_truncated_verdicts(replica_folder: Path) -> None:
    args = ["async", "check", "--compare", f"+TASK_QUEUE_ENABLE=2 long label={replica_folder / 'kvtrace-async-replica-sync.jsonl'}",
            "--compare", f"+--async-scheduling={replica_folder / 'kvtrace-async-replica-async.jsonl'}"]
    result = CliRunner().invoke(main, args, terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "not effective" in result.output and "effective " in result.output
    assert "…" not in result.output


def test_capture_and_our_trace_together_are_two_runs(tmp_path: Path, replica_folder: Path) -> None:
    folder = write_parse_folder(tmp_path / "out", raw=False)
    with pytest.raises(SeveralRunsError) as exc:
        check([folder, replica_folder / "kvtrace-async-replica-async.jsonl"])
    assert set(exc.value.runs or {}) == {f"capture {folder}", "replica-async"}


def test_two_capture_folders_are_two_runs(tmp_path: Path) -> None:
    a = write_parse_folder(tmp_path / "a")
    b = write_parse_folder(tmp_path / "b", older=True)
    with pytest.raises(SeveralRunsError) as exc:
        check([a, b])
    assert set(exc.value.runs or {}) == {f"capture {a}", f"capture {b}"}
    assert check([a / "batch.csv", a / "chrome_tracing.json", a / "raw"]).metrics.steps == 12


def test_one_file_mixing_runs_is_refused(tmp_path: Path, replica_folder: Path) -> None:
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"".join((replica_folder / f"kvtrace-async-replica-{m}.jsonl").read_bytes() for m in ("sync", "async")))
    result = CliRunner().invoke(main, ["async", "check", str(mixed)])
    assert result.exit_code == 2
    assert "mixed inside" in result.output and "Traceback" not in result.output


def test_empty_folder_says_what_it_looked_for(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["async", "check", str(tmp_path)])
    assert result.exit_code == 2
    assert "no capture files under" in result.output


def test_kv_recv_traces_name_the_command_that_reads_them(tmp_path: Path) -> None:
    spec = QueueSpec(run_id="runA", pid=11, cfg_label="kv")
    path = write_otlp_json(tmp_path / "kv.jsonl.gz", [(spec, simulate_queue(spec, 40, seed=1))])
    with pytest.raises(NothingToCheckError, match="KV-cache recv trace spans"):
        check([path])
    result = CliRunner().invoke(main, ["async", "check", str(tmp_path)])
    assert result.exit_code == 2 and "kvtrace report" in result.output
