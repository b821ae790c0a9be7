"""ReplayTask construction from ``tasks`` rows: work segments, dependency times, bounds, dispatch gaps."""

from __future__ import annotations

import duckdb
import pytest

from otel_kvtrace.whatif.task import (
    ReplayInputError,
    task_from_row,
    tasks_from_duckdb,
    tasks_from_rows,
)


def row(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"queue": "q", "seq": 0, "step": 0, "layer_id": 3, "ts_enqueue": 1000}
    base.update(kw)
    return base


def test_main_gva_order_save_build_gate_copy_becomes_four_segments() -> None:
    # dequeue 1010; save wait 1010-1100; meta_build 1100-1120; gate wait 1120-1300; copy 1300-1400; set 1410
    t = task_from_row(row(
        ts_dequeue=1010, ts_complete=1410,
        ts_dep_save_cpu=1090, ts_dep_save_npu=1100, save_cpu_wait_start=1010, save_cpu_wait_end=1090,
        save_npu_sync_start=1090, save_npu_sync_end=1100,
        meta_build_start=1100, meta_build_end=1120,
        ts_dep_gate_record=1200, ts_dep_gate_npu=1300, gate_cond_wait_start=1120, gate_cond_wait_end=1200,
        gate_npu_sync_start=1200, gate_npu_sync_end=1300,
        backend_submit_start=1300, backend_submit_end=1400, completion_start=1400, completion_end=1410,
        wait_for_save_layer=1, gate_id=2,
    ))
    assert t.work_ns == (0, 20, 110, 0)
    assert (t.ready_save_ns, t.ready_gate_ns, t.ready_slot_ns) == (1100, 1300, None)
    assert t.service_ns == 130
    assert t.completion_ns == 10 and t.backend_submit_ns == 100
    assert t.ready_ns == 1300


def test_v023_order_build_before_save_wait() -> None:
    t = task_from_row(row(
        ts_dequeue=1000, ts_complete=1200, meta_build_start=1000, meta_build_end=1030,
        ts_dep_save_cpu=1100, save_cpu_wait_start=1030, save_cpu_wait_end=1100, wait_for_save_layer=0,
    ))
    assert t.work_ns == (30, 100, 0, 0)


def test_dependency_time_is_capped_by_the_observed_wait_end() -> None:
    # the producer's set() stamp is later than the waiter's return (clock skew): use the return
    t = task_from_row(row(ts_dequeue=1000, ts_complete=1100, ts_dep_save_cpu=1080,
                          save_cpu_wait_start=1000, save_cpu_wait_end=1050, wait_for_save_layer=0))
    assert t.ready_save_ns == 1050


def test_an_exact_slot_release_is_kept_even_when_the_recorded_wait_did_not_block() -> None:
    # released at 1030, after the arrival (1000); the recorded wait (1040) found it free. A policy that
    # starts this task earlier than FIFO did must still not copy before 1030.
    t = task_from_row(row(ts_dequeue=1000, ts_complete=1100, ts_dep_slot_release=1030,
                          slot_release_wait_start=1040, slot_release_wait_end=1040))
    assert t.ready_slot_ns == 1030
    assert t.recorded_slot_release_ns == 1030
    t = task_from_row(row(ts_dequeue=1000, ts_complete=1100, ts_dep_slot_release=1060,
                          slot_release_wait_start=1040, slot_release_wait_end=1060))
    assert t.ready_slot_ns == 1060


def test_a_bounded_slot_release_behind_a_wait_that_did_not_block() -> None:
    # release somewhere in [1010, 1060]; the wait at 1040 found the slot free, so it was free by 1040
    r = row(ts_dequeue=1000, ts_complete=1100, ts_dep_slot_release_lo=1010, ts_dep_slot_release_hi=1060,
            slot_release_wait_start=1040, slot_release_wait_end=1040)
    assert task_from_row(r).ready_slot_ns == 1040  # hi: min(hi, the recorded wait start)
    assert task_from_row(r, bound="lo").ready_slot_ns is None  # lo (possible HOL) may drop it
    assert task_from_row(r).recorded_slot_release_ns is None  # no exact time recorded


def test_bounded_npu_times_use_the_requested_bound() -> None:
    r = row(ts_dequeue=1000, ts_complete=1500, ts_dep_gate_record=1100, ts_dep_gate_npu_lo=1100,
            ts_dep_gate_npu_hi=1400, gate_npu_sync_start=1010, gate_npu_sync_end=1400, gate_id=0)
    assert task_from_row(r).ready_gate_ns == 1400
    assert task_from_row(r, bound="lo").ready_gate_ns == 1100
    with pytest.raises(ReplayInputError, match="bound"):
        task_from_row(r, bound="middle")


def test_dispatch_gap_is_service_time_and_missing_columns_are_named() -> None:
    tasks = tasks_from_rows([
        row(seq=0, ts_enqueue=0, ts_dequeue=5, ts_complete=50),
        row(seq=1, ts_enqueue=10, ts_dequeue=57, ts_complete=100),  # 7 ns after the previous completion
    ])
    assert [t.work_ns[0] for t in tasks] == [50, 50]
    with pytest.raises(ReplayInputError, match="tasks.ts_enqueue"):
        tasks_from_rows([{"queue": "q", "seq": 0, "step": 0, "layer_id": 0, "ts_complete": 5}])
    # no dequeue stamp: the service is what lies between readiness and completion
    assert tasks_from_rows([row(seq=0, ts_enqueue=0, ts_complete=7)])[0].work_ns == (0, 0, 0, 7)
    # never served (no completion): left out, not replayed as free work
    assert [t.seq for t in tasks_from_rows([row(seq=0, ts_complete=5), row(seq=1)])] == [0]


def test_tasks_from_duckdb_reads_the_tasks_table() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE tasks (queue VARCHAR, seq BIGINT, step BIGINT, layer_id BIGINT, final_layer BOOLEAN, "
                "ts_enqueue BIGINT, ts_dequeue BIGINT, ts_complete BIGINT, path VARCHAR)")
    con.execute("INSERT INTO tasks VALUES ('q', 1, 0, 7, true, 10, 20, 30, 'gva'), ('q', 0, 0, 0, false, 0, 0, 10, 'gva'),"
                " ('k', 0, 0, 0, false, 0, 0, 5, 'key')")
    tasks = tasks_from_duckdb(con, where="path = 'gva'")
    # seq 1: 10 ns of work after dequeue plus 10 ns dispatch gap (dequeued at 20, free since 10)
    assert [(t.seq, t.final_layer, t.service_ns) for t in tasks] == [(0, False, 10), (1, True, 20)]
    with pytest.raises(ReplayInputError, match="no rows"):
        tasks_from_duckdb(con, where="path = 'none'")


def test_gva_and_key_queues_of_one_label_are_separate_configurations() -> None:
    from otel_kvtrace.whatif.replay import config_key, group_runs

    tasks = tasks_from_rows([
        row(queue="g", path="gva", cfg_label="upstream", run_id="r1", ts_enqueue=0, ts_complete=9),
        row(queue="k", path="key", cfg_label="upstream", run_id="r1", ts_enqueue=0, ts_complete=9),
        row(queue="m", path="gva", cfg_label="main gva N=8", run_id="r1", ts_enqueue=0, ts_complete=9),
    ])
    assert set(group_runs(tasks)) == {"upstream [gva]", "upstream [key]", "main gva N=8"}
    assert config_key(None, None) == "(unlabelled)"
