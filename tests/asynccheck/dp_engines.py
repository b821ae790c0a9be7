"""``python -m tests.asynccheck.dp_engines VERSION OUT``: two DP engine-core processes of one run.

The parent installs as the vLLM plugin does in the front-end process, then forks one engine-core
process per DP rank, as vLLM does. Each child runs the real ``DPEngineCoreProc`` step loop of the
released vLLM (``step_with_batch_queue``, then its real ``_has_global_unfinished_reqs``, whose
``ParallelConfig.sync_dp_state`` all-reduce runs on a 1-rank stand-in group) with UniProcExecutor on
its own fake device: rank 0 with a non-blocking launch, rank 1 with a launch that synchronizes the
device. Each child writes its device truth to ``OUT/truth-<pid>.json``; the parent prints the pids.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from otel_kvtrace.asynccheck.instrument import install_from_env

from . import vllm_engine as ve
from .vllm_src import vllm_modules

STEPS = 40
RANK_TIMING = (ve.Timing(), ve.Timing(blocking_launch=True))
MODS: Any = None


def engine_core(rank: int, out: str) -> None:
    import os

    timing = RANK_TIMING[rank]
    ve.DEVICE.intervals.clear()
    ve.DEVICE.wake_lags.clear()
    ex = ve.make_executor(MODS, "uniproc", timing, True)
    engine = ve.make_engine(MODS, async_loop=True, executor=ex, scheduler=ve.FakeScheduler(STEPS, timing),
                            cls=MODS.core.DPEngineCoreProc)
    pc = MODS.parallel.ParallelConfig
    config = pc.__new__(pc)
    config.cpu_distributed_timeout_seconds = None  # 0.33's sync_dp_state reads it
    config.data_parallel_index = rank  # what vLLM's run_engine_core sets in each engine-core process
    engine.vllm_config.parallel_config = config
    engine.step_counter, engine.pending_pause, engine.ignore_start_dp_wave = 0, False, False
    engine.dp_group = SimpleNamespace(size=lambda: 1)
    engine.dp_sync_interval = 16
    engine.prefill_schedule_interval = 1  # 0.33: no prefill throttling (its default)
    for _ in range(10 * STEPS):  # DPEngineCoreProc.run_busy_loop: a step, then the DP all-reduce
        if not engine.scheduler.has_requests() and not engine.batch_queue:
            break
        engine.step_fn()
        engine._has_global_unfinished_reqs(engine.scheduler.has_unfinished_requests())
    Path(out, f"truth-{os.getpid()}.json").write_text(json.dumps(
        {"rank": rank, "device": ex.truth(), "wake_lags": list(ve.DEVICE.wake_lags)}))


if __name__ == "__main__":
    version, out = sys.argv[1], sys.argv[2]
    Path(out).mkdir(parents=True, exist_ok=True)
    with vllm_modules(version, ve.setup_torch) as mods:
        MODS = mods
        assert install_from_env(Path(out)) is not None  # the plugin in the front-end process
        procs = [mp.get_context("fork").Process(target=engine_core, args=(rank, out)) for rank in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        print(" ".join(f"{p.pid}:{p.exitcode}" for p in procs))
