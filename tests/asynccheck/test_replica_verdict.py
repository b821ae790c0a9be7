"""The replica's engine loop, traced by the real patch table, judged by the real analysis (virtual clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_kvtrace.asynccheck.analysis import CANNOT_TELL, EFFECTIVE, NOT_EFFECTIVE, check
from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica


def _check(tmp_path: Path, **cfg: object):
    path = run_replica(ReplicaConfig(**cfg), out_dir=tmp_path)
    return check([path], run=str(cfg.get("mode")))


def test_sync_loop_is_not_effective_because_async_is_off(tmp_path: Path) -> None:
    result = _check(tmp_path, mode="sync")
    assert result.verdict == NOT_EFFECTIVE
    assert result.metrics.overlap_ratio == 0.0
    assert any("no async markers" in r for r in result.reasons)
    # host work between device executions = update (1 ms) + schedule (2 ms) + launch (1 ms)
    assert result.metrics.gap_p50_ms == pytest.approx(4.0)
    assert result.metrics.max_queue_depth == 1


def test_async_batch_queue_overlaps_and_is_effective(tmp_path: Path) -> None:
    result = _check(tmp_path, mode="async")
    assert result.verdict == EFFECTIVE
    assert result.metrics.overlap_ratio == pytest.approx(1.0)
    assert result.metrics.gap_p50_ms == pytest.approx(0.0)
    assert result.metrics.max_queue_depth == 2
    assert result.markers == {"vllm_batch_queue_step": 24}


def test_async_flag_with_blocking_sync_is_not_effective_with_the_right_reason(tmp_path: Path) -> None:
    result = _check(tmp_path, mode="serialised")
    assert result.verdict == NOT_EFFECTIVE
    assert result.metrics.overlap_ratio == 0.0
    assert result.metrics.blocking_launch_share == pytest.approx(1.0)
    assert result.markers["vllm_batch_queue_step"] == 24
    assert any("blocking synchronize in the launch path" in r for r in result.reasons)
    assert not any("no async markers" in r for r in result.reasons)


def test_host_bound_async_loop_is_not_effective_host_bottleneck(tmp_path: Path) -> None:
    # Device 2.5 ms per step against 4 ms of host work. Steady state: execute(n) = [launch start,
    # done] = [5, 8.5] and schedule(n+1) = [7, 9] overlap 1.5 of 2 ms; the first pair overlaps fully
    # (schedule(1) = [3, 5] inside execute(0) = [2, 5.5]). 23 pairs: (2 + 22 * 1.5) / (23 * 2).
    result = _check(tmp_path, mode="async", layers=1, compute_ns=2_000_000, comm_ns=500_000)
    assert result.metrics.overlap_ratio == pytest.approx(35 / 46)
    # ... but the device idles 1.5 ms of every 4 ms: async cannot hide 4 ms of host work behind 2.5 ms
    assert result.metrics.gap_p50_ms == pytest.approx(1.5)
    assert result.verdict == NOT_EFFECTIVE
    assert any("host is the bottleneck" in r for r in result.reasons), result.reasons


@pytest.mark.parametrize(("overlap", "share"), [(False, 1.0), (True, 0.25)])
def test_exposed_communication_share(tmp_path: Path, overlap: bool, share: float) -> None:
    # 4 layers: serial comm is all exposed; overlapped comm hides under the next layer's compute,
    # only the last layer's all-reduce stays exposed.
    result = _check(tmp_path, mode="async", comm_overlap=overlap)
    assert result.metrics.comm_total_ms == pytest.approx(24 * 4 * 0.5)
    assert result.metrics.comm_exposed_share == pytest.approx(share)


def test_replica_runs_are_deterministic(tmp_path: Path) -> None:
    a = run_replica(ReplicaConfig(mode="async"), out_dir=tmp_path / "a").read_bytes()
    b = run_replica(ReplicaConfig(mode="async"), out_dir=tmp_path / "b").read_bytes()
    assert a == b


def test_too_few_steps_cannot_tell(tmp_path: Path) -> None:
    result = _check(tmp_path, mode="async", num_steps=2)
    assert result.verdict == CANNOT_TELL


def test_bad_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        ReplicaConfig(mode="fast")


@pytest.mark.parametrize(("mode", "exposed"), [("sync", 1.0), ("async", 0.0)])
def test_dp_step_all_reduce_is_traced_as_communication(tmp_path: Path, mode: str, exposed: float) -> None:
    # The DP engines' all-reduce runs on the engine loop every 4 steps (1 ms). Sync: the device idles
    # meanwhile, all of it is exposed; async: the device is executing the queued step, all hidden.
    result = _check(tmp_path, mode=mode, comm_ns=0, dp_sync_ns=1_000_000, dp_sync_every=4)
    assert result.metrics.comm_total_ms == pytest.approx(24 / 4 * 1.0)
    assert result.metrics.comm_exposed_share == pytest.approx(exposed)
