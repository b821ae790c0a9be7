"""Every report question is answered by a ``queries/*.sql`` file run through ``otel_kvtrace.analyse``:
no SQL text in the report package, and parameters reach the query."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json

import otel_kvtrace.report
from otel_kvtrace.analyse import run_query
from otel_kvtrace.load import load_traces
from otel_kvtrace.report.model import stage_samples, timeline_data

SQL = re.compile(r"\b(SELECT|FROM|WITH|JOIN|WHERE|CREATE|DROP|INSERT|QUALIFY|GROUP BY|ORDER BY|UNPIVOT)\b")


def _sql_literals(path: Path) -> list[str]:
    return [f"{path.name}:{node.lineno}: {node.value[:60]!r}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value)]


def test_no_sql_text_in_the_report_package() -> None:
    package = Path(otel_kvtrace.report.__file__).parent
    found = [hit for path in sorted(package.glob("*.py")) for hit in _sql_literals(path)]
    assert not found, "SQL belongs in queries/*.sql: " + "; ".join(found)


def test_the_detector_sees_sql(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text('q = f"""\n  SELECT x FROM {t} WHERE y"""\nlabel = "Longest HOL intervals"\n')
    assert [hit.split(":")[1] for hit in _sql_literals(sample)] == ["1", "1"]  # both parts of the f-string


@pytest.fixture(scope="module")
def con(tmp_path_factory: pytest.TempPathFactory):
    groups = [(spec := QueueSpec(run_id=f"r{i}", pid=900 + i, cfg_label=f"c{i % 2}"),
               simulate_queue(spec, 200, seed=i, hol_probability=0.2)) for i in range(3)]
    return load_traces(write_otlp_json(tmp_path_factory.mktemp("t") / "t.jsonl", groups)).con


def test_parameters_reach_the_query_and_are_reset(con) -> None:
    small = stage_samples(con, per_stage=3)
    assert small and all(len(v) <= 3 for stages in small.values() for v in stages.values())
    assert any(len(v) > 3 for stages in stage_samples(con).values() for v in stages.values())
    assert con.execute("SELECT getvariable('stage_sample')").fetchall() == [(None,)]
    with pytest.raises(KeyError, match="no parameter"):
        run_query(con, "stage_samples", {"timeline_tasks": 5})


def test_timeline_windows_follow_timeline_tasks(con) -> None:
    narrow, wide = timeline_data(con, 60), timeline_data(con, 600)
    assert narrow["shown"] == 3 * 20 < wide["shown"]  # max(20, 60 // 3 queues) tasks per queue
    assert narrow["total"] == wide["total"] == 600
