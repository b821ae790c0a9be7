"""`kvtrace demo`: traced real-clock scenarios written as OTLP/JSON lines, CLI/API parity."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.demo import run_demo, scenario_configs
from otel_kvtrace.replica.config import ReplicaConfigError


def _roots(path):
    resource, roots = None, []
    for line in path.read_bytes().splitlines():
        for rs in orjson.loads(line)["resourceSpans"]:
            resource = {a["key"]: next(iter(a["value"].values())) for a in rs["resource"]["attributes"]}
            for ss in rs["scopeSpans"]:
                roots += [s for s in ss["spans"] if s["name"] == "kvtrace.recv.task"]
    return resource, roots


def test_run_demo_writes_one_traced_file_per_scenario(tmp_path) -> None:
    progress: list[tuple[str, int, int]] = []
    result = run_demo(steps=3, out=tmp_path, on_progress=lambda *a: progress.append(a))
    assert [s.name for s in result.scenarios] == ["hol", "fifo-optimal"]
    assert progress[-1] == ("fifo-optimal", 3, 3) and ("hol", 3, 3) in progress
    for sc in result.scenarios:
        assert len(sc.trace_files) == 1
        resource, roots = _roots(sc.trace_files[0])
        assert resource["kvtrace.source"] == "replica"
        assert resource["kvtrace.cfg.label"] == sc.config.label
        assert resource["kvtrace.run_id"] == sc.run_id
        assert len(roots) == sc.recv_tasks == 3 * sc.config.num_layers
        assert sc.send_tasks == 3 * sc.config.num_layers
        names = {st.name for st in sc.stages}
        assert {"queue_wait", "backend_submit", "consumer_wait"} <= names
    hol = result.scenarios[0]
    assert "save_cpu_wait" in {st.name for st in hol.stages}


def test_overrides_reshape_every_scenario() -> None:
    configs = scenario_configs("hol", layers=4, buffers=1, prefetch=2, independent="all", requests=3, steps=7, seed=9)
    [(name, cfg)] = configs
    assert name == "hol"
    assert (cfg.num_layers, cfg.num_shared_buffers, cfg.prefetch_layers, cfg.independent_layers,
            cfg.requests_per_step, cfg.steps, cfg.seed) == (4, 1, 2, "all", 3, 7, 9)
    assert cfg.slow.slow_save_layers == (1,)
    [(_, small)] = scenario_configs("hol", layers=2)
    assert small.resolved_independent == (0,) and small.slow.slow_save_layers == (1,)


@pytest.mark.parametrize(("args", "option"), [
    (["--buffers", "0"], "num_shared_buffers"),
    (["--prefetch", "0"], "prefetch_layers"),
    (["--independent", "0,99"], "independent_layers"),
    (["--independent", "x"], "independent_layers"),
])
def test_cli_bad_option_is_a_clear_error(args: list[str], option: str, tmp_path) -> None:
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert option in result.output
    with pytest.raises(ReplicaConfigError, match=option):
        scenario_configs("both", buffers=0 if "buffers" in args[0] else None,
                         prefetch=0 if "prefetch" in args[0] else None,
                         independent=args[1] if "independent" in args[0] else None)


def test_cli_runs_and_summarises(tmp_path) -> None:
    result = CliRunner().invoke(main, ["demo", "--preset", "fifo-optimal", "--steps", "2", "--layers", "6",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "backend_submit" in result.output and "recv tasks 12" in result.output
    assert "Head-of-line blocking" in result.output  # the analysis package's summary of the same files
    files = list((tmp_path / "traces").glob("kvtrace-demo-fifo-optimal-*.jsonl"))
    assert len(files) == 1
    assert len(_roots(files[0])[1]) == 12


def test_hol_scenario_shows_a_ready_task_behind_the_head_in_duckdb(tmp_path) -> None:
    from otel_kvtrace.load import load_traces

    result = run_demo("hol", steps=3, out=tmp_path)
    [sc] = result.scenarios
    con = load_traces(sc.trace_files).con
    rows = con.sql(
        "SELECT h.step, b.ts_ready, h.ts_complete, b.ts_dequeue, h.ready_precision, b.ready_precision "
        "FROM tasks h JOIN tasks b ON b.step = h.step AND b.layer_id = 4 "
        "WHERE h.layer_id = 3 AND h.path = 'gva' ORDER BY h.step"
    ).fetchall()
    assert len(rows) == 3
    for _step, ready_4, complete_3, dequeue_4, prec_3, prec_4 in rows:
        # T4 (independent, gate G1) was ready while T3 still waited for save(1), and FIFO held it back.
        # Structural, not a timing race: save(1) starts only after G1 was recorded and reached on the device.
        assert ready_4 < complete_3 <= dequeue_4
        assert (prec_3, prec_4) == ("exact", "exact")  # the fake NPU gives exact device times
    waits = con.execute("SELECT count(*) FROM tasks WHERE layer_id = 3 AND save_cpu_wait_ns > 0").fetchall()[0][0]
    assert waits == 3


def test_behaviour_and_path_overrides(tmp_path) -> None:
    [(_, v023)] = scenario_configs("hol", behaviour="v0.23")
    assert v023.label.startswith("v0.23 gva") and not v023.reuse_enabled and v023.resolved_prefetch == 4
    result = run_demo("fifo-optimal", steps=2, path="key", out=tmp_path)
    [sc] = result.scenarios
    resource, roots = _roots(sc.trace_files[0])
    assert resource["kvtrace.cfg.label"].startswith("main key")
    assert {next(a["value"]["stringValue"] for a in r["attributes"] if a["key"] == "kvtrace.path")
            for r in roots} == {"key"}


def test_preset_all_runs_every_scenario(tmp_path) -> None:
    result = run_demo("all", steps=2, out=tmp_path)
    assert [s.name for s in result.scenarios] == ["hol", "fifo-optimal", "buckets", "slow-slot"]
    labels = {s.name: s.config.label for s in result.scenarios}
    assert "buckets=aab" in labels["buckets"] and "slow_slot=3" in labels["slow-slot"]
    assert len(set(labels.values())) == 4  # each scenario is its own group in the report
    assert all(len(s.trace_files) == 1 and s.recv_tasks > 0 for s in result.scenarios)


def test_every_hol_preset_has_a_ready_task_behind_a_waiting_head_on_the_virtual_clock() -> None:
    """The presets are tuned so their HOL source really shows (checked deterministically)."""
    from otel_kvtrace.demo import PRESETS
    from otel_kvtrace.record.model import Stage, stage_triples
    from otel_kvtrace.replica.simulate import ready_time, simulate

    waits = (Stage.SAVE_CPU_WAIT, Stage.SAVE_NPU_SYNC, Stage.SLOT_RELEASE_WAIT)
    for name, expected in (("hol", True), ("buckets", True), ("slow-slot", True), ("fifo-optimal", False)):
        res = simulate(PRESETS[name].with_(steps=2))
        found = False
        for i, head in enumerate(res.recv):
            for stage, a, b in stage_triples(head.stages):
                if stage in waits and b > a:
                    found |= any(ready_time(j) < b for j in res.recv[i + 1:]
                                 if j.step == head.step and not j.final_layer)
        assert found is expected, name
