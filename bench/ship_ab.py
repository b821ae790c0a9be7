"""Per-task recv-thread pieces in a tight loop, this tree against another checkout, side by side in one run.

The in-context cost (``bench/recv_breakdown.py``) is too noisy on a shared machine to separate changes
of a few hundred ns; this bench times the pieces themselves (min over repeats, GC off), alternating
the two trees in fresh subprocesses:

- ``write_task``: one ``RingWriter.write_task`` of a recv task with 6 stages, 1 group, 2 request ids;
- ``resolve 8L`` / ``resolve 32L``: ``Runtime.resolve`` of a task's save and gate marks at layer 2 of a
  step log of 8 / 32 layers (2 events per layer) observed in order up to the gate;
- ``pass-through``: the ``add_request`` wrapper minus the original, with tracing disabled (the frame).

Usage::

    git archive <rev> | tar -x -C /tmp/base
    .venv/bin/python bench/ship_ab.py --against /tmp/base [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]


def _best(fn: Callable[[], Any], n: int = 20000, repeats: int = 5) -> float:
    gc.disable()
    try:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter_ns() - t) / n)
        return best
    finally:
        gc.enable()


def measure() -> dict[str, float]:
    """Run inside the tree under test (its ``otel_kvtrace`` first on ``sys.path``)."""
    from otel_kvtrace.export.spans import TransferSummary
    from otel_kvtrace.instrument import wrappers
    from otel_kvtrace.instrument.runtime import Runtime
    from otel_kvtrace.instrument.stream_order import StreamLog, StreamPosition
    from otel_kvtrace.record import ring as R
    from otel_kvtrace.record.model import QueueInfo, TaskRecord
    from otel_kvtrace.record.recorder import Recorder

    out: dict[str, float] = {}
    _, mem = R.create_memfd(R.DEFAULT_SLOTS)
    writer = R.RingWriter(mem)
    rec = TaskRecord(queue=QueueInfo("run", "gva", "t", 1, num_layers=8), seq=5, step=3, layer_id=2,
                     wait_for_save_layer=1, gate_id=2, t_enqueue=1, t_dequeue=2, t_backend_return=3, t_complete=4)
    for s in range(6):
        rec.stages.extend((s, 100 + s, 200 + s))
    summary = TransferSummary([0], ["req-a", "req-b"], 16)

    def write() -> None:
        writer.hdr[R.H_READ] = writer._head  # keep the ring empty
        writer.write_task(rec, False, summary)

    out["write_task"] = _best(write)
    rt = Runtime(recorder=Recorder(), run_id="ab")
    for layers in (8, 32):
        log = StreamLog()
        for _ in range(2 * layers):
            log.append()
        for q in range(5):  # save and gate of layer 2 seen complete, nothing later yet
            log.observe(q, 1000 + q)
        task = TaskRecord()
        marks = [(1, StreamPosition(log, 3)), (3, StreamPosition(log, 4))]

        def resolve() -> None:
            task.deps[3] = task.deps[7] = 5000
            task.npu_marks[:] = marks
            rt.resolve(task)

        out[f"resolve {layers}L"] = _best(resolve)

    class Thread:
        def add_request(self, item: Any) -> None:
            return None

    off = Runtime(recorder=Recorder(), run_id="ab")
    off.recorder.enabled = False
    wrapped = wrappers.wrap_add_request(Thread.add_request, off)
    thread = Thread()
    out["pass-through"] = _best(lambda: wrapped(thread, 1), 100000) - _best(lambda: Thread.add_request(thread, 1), 100000)
    return out


def _run(tree: Path) -> dict[str, float]:
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(REPO / 'bench')!r}); " \
           "import json, ship_ab; print(json.dumps(ship_ab.measure()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="the other checkout (e.g. a git archive)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    args = parser.parse_args(argv)
    if not (args.against / "otel_kvtrace").is_dir():
        parser.error(f"{args.against}: no otel_kvtrace package there")
    runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    for i in range(args.rounds):
        runs["other"].append(_run(args.against.resolve()))
        runs["this"].append(_run(REPO))
        print(f"  round {i + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{'ns per call (median over rounds of the best of 5)':36} {'other':>9} {'this':>9} {'this/other':>10}")
    for name in runs["this"][0]:
        a = statistics.median(r[name] for r in runs["other"])
        b = statistics.median(r[name] for r in runs["this"])
        print(f"{name:36} {a:9.0f} {b:9.0f} {b / a:10.2f}")


if __name__ == "__main__":
    main()
