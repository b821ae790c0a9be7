"""`kvtrace async check` / `--compare`: thin shells over the API, results read back from --json."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.asynccheck.analysis import check
from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
from otel_kvtrace.cli import main


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("async")
    return {mode: run_replica(ReplicaConfig(mode=mode, num_steps=8), out_dir=out) for mode in ("sync", "async", "serialised")}


def test_check_writes_the_api_result_as_json(tmp_path: Path, replica_runs: dict[str, Path]) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["async", "check", str(replica_runs["async"]), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "async scheduling: effective" in result.output
    doc = orjson.loads(out.read_bytes())
    assert doc == orjson.loads(orjson.dumps(check([replica_runs["async"]]).to_dict()))


def test_compare_builds_the_ladder_in_order(tmp_path: Path, replica_runs: dict[str, Path]) -> None:
    out = tmp_path / "ladder.json"
    args = ["async", "check", "--json", str(out),
            "--compare", f"baseline={replica_runs['sync']}",
            "--compare", f"+ASCEND_LAUNCH_BLOCKING=1={replica_runs['serialised']}",
            "--compare", f"+--async-scheduling={replica_runs['async']}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = orjson.loads(out.read_bytes())
    assert [(r["run"], r["verdict"]) for r in doc] == [
        ("baseline", "not effective"),
        ("+ASCEND_LAUNCH_BLOCKING=1", "not effective"),
        ("+--async-scheduling", "effective"),
    ]
    assert [r["metrics"]["gap_p50_ms"] for r in doc] == pytest.approx([4.0, 4.0, 0.0])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give capture PATHS or --compare"),
        (["--compare", "nolabel"], "expected LABEL=PATH"),
        (["--compare", "a=/no/such/file"], "no such file or directory"),
    ],
)
def test_check_input_errors_exit_2(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["async", "check", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_help_teaches_with_examples() -> None:
    for sub in ("check", "doctor", "replica"):
        result = CliRunner().invoke(main, ["async", sub, "--help"])
        assert result.exit_code == 0
        assert "Example:" in result.output


def test_replica_command_writes_traces_that_check_reads(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["async", "replica", "--mode", "serialised", "--steps", "5",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    path = tmp_path / "kvtrace-async-replica-serialised.jsonl"
    assert str(path) in result.output
    assert check([path]).metrics.steps == 5
