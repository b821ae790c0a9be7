"""A traced replica serving process for the agent process tests (run as a script, never imported by pytest).

    python agent_child.py OUT_DIR MODE

Prints ``ready <agent_pid>`` once tracing is on, then per finished step ``step <n> <submitted>`` where
``submitted`` is how many task records had been handed to the ring by then. Modes:

- ``run``     steps until killed (the parent sends SIGKILL or SIGTERM mid-run).
- ``nowait``  one step whose loads are submitted without ``wait_for_layer_load`` (records stay held for
              a consumer wait that never comes), then ``os._exit(0)`` (argv[3] == "exit") or a normal exit.
- ``fork``    starts tracing, forks; the child runs 3 steps and exits normally (or ``os._exit``, argv[3]
              == "exit"); the parent waits.
"""

from __future__ import annotations

import os
import sys
import time

from otel_kvtrace.api import start_tracing
from otel_kvtrace.demo import scenario_configs
from otel_kvtrace.record import ring as R
from otel_kvtrace.replica.threaded import replica_targets, run_threaded


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    ((_, cfg),) = scenario_configs("hol", steps=100_000 if mode == "run" else 3)
    session = start_tracing(replica_targets(cfg.behaviour), resource=cfg.resource_attributes(), out_dir=out,
                            run_id=f"agent-{mode}")
    writer = getattr(session.exporter, "writer", None)
    _say(f"ready {writer.hdr[R.H_AGENT_PID] if writer is not None else -1}")
    if mode == "run":
        run_threaded(cfg, on_step=lambda step: _say(f"step {step} {session.recorder.submitted}"))
    elif mode == "nowait":
        _no_wait_step(cfg, session)
        if sys.argv[3] == "exit":
            os._exit(0)
    elif mode == "fork":
        pid = os.fork()
        if pid == 0:
            run_threaded(cfg)
            _say(f"child {os.getpid()} {session.recorder.submitted} "
                 f"{session.exporter._proc.pid}")  # its agent (may not have mapped the ring yet)
            if len(sys.argv) > 3 and sys.argv[3] == "exit":
                os._exit(0)  # no atexit: the child's agent notices its producer is gone and drains
            sys.exit(0)  # normal exit: atexit flushes the child's own agent
        _, status = os.waitpid(pid, 0)
        _say(f"parent {os.getpid()} {session.recorder.submitted} {status}")


def _no_wait_step(cfg, session) -> None:
    from otel_kvtrace.replica.fake_npu import FakeNPU, RealClock, set_default_device
    from otel_kvtrace.replica.plan import build_plan
    from otel_kvtrace.replica.pool_worker import KVPoolWorker

    plan = build_plan(cfg)
    npu = FakeNPU(RealClock())
    set_default_device(npu)
    worker = KVPoolWorker(cfg, plan, npu, wait_timeout_s=5.0)
    worker.register_kv_caches()
    worker.start_load_kv(plan.requests[0])
    from otel_kvtrace.replica import gate as gate_module

    for _ in range(4):  # the forward of 4 layers, enqueueing loads without the instrumented wait
        worker._submit_ready_layer_loads()
        gate_module.record_attention_compute_start()
        worker.save_kv_layer(None)  # advances current_layer
    deadline = time.monotonic() + 10
    while worker.kv_recv_thread.request_queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    _say(f"step 0 {session.recorder.submitted}")


if __name__ == "__main__":
    main()
