"""The live scheduler's own cost on the ``hol`` replica preset: FIFO vs ``ready_queue``, same run,
alternated (the order rotated per seed, one untimed warm-up run per variant first); ``--baseline REV`` adds
``ready_queue`` with the ``SchedulingQueue`` of git revision REV (before/after in one run).

Printed side by side, medians over every recv-thread dequeue / every waited layer of every run:

- ``get cpu us``: recv-thread CPU time spent inside ``request_queue.get()`` (``thread_time_ns``: the
  decision, the locks, the allocations), p50 and p90, apart for calls that returned without waiting and
  calls that waited on the queue's condition (their CPU includes the wake-up's own system time);
- ``wake lag us`` per layer: the forward's ``consumer_wait`` end minus the task's ``completion`` end,
  for layers the forward was already waiting on (the woken forward's wait for the GIL is in it);
- ``cpu ms/step``: process CPU per forward step;
- ``busy dispatch us``: the recv thread's gap from one task's completion to the next dequeue, median over
  in-order dequeues that found it busy (``whatif.measured.busy_dispatch_ns``, per run, then the median
  over runs): the policy's own cost per dequeue as the what-if sees it, which its prediction (from FIFO
  runs) does not contain.

Usage::

    .venv/bin/python bench/scheduler_cost.py              # 6 seeds x 40 steps (~1 min)
    .venv/bin/python bench/scheduler_cost.py --seeds 10 --steps 60 --baseline 97b7c75   # + the old queue
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

_blocked = threading.local()


def _timed_get(original: Any, sink: list[tuple[int, bool]]) -> Any:
    """``get`` recording ``(recv-thread CPU ns, blocked)``: blocked = it waited on its condition."""
    def get(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "Recving" not in threading.current_thread().name:
            return original(self, *args, **kwargs)
        _blocked.flag = False
        t0 = time.thread_time_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            sink.append((time.thread_time_ns() - t0, _blocked.flag))
    return get


def _flagging_wait(original: Any) -> Any:
    def wait(self: Any, timeout: float | None = None) -> bool:
        _blocked.flag = True
        return original(self, timeout)
    return wait


def _attr(span: dict[str, Any], key: str) -> Any:
    for a in span.get("attributes", ()):
        if a["key"] == key:
            v = a["value"]
            return int(v["intValue"]) if "intValue" in v else next(iter(v.values()))
    return None


def wake_lags(files: list[Path]) -> dict[int, list[float]]:
    """Per layer, the forward's wake-up lag (us) after the load event of a layer it waited on."""
    by_trace: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                for rs in orjson.loads(line).get("resourceSpans", ()):
                    for ss in rs.get("scopeSpans", ()):
                        for sp in ss.get("spans", ()):
                            by_trace[sp["traceId"]][sp["name"]] = sp
    out: dict[int, list[float]] = defaultdict(list)
    for spans in by_trace.values():
        root, done, cw = spans.get("kvtrace.recv.task"), spans.get("completion"), spans.get("consumer_wait")
        if root is None or done is None or cw is None:
            continue
        t_set = int(done["endTimeUnixNano"])
        if int(cw["startTimeUnixNano"]) < t_set <= int(cw["endTimeUnixNano"]):
            out[_attr(root, "kvtrace.layer_id")].append((int(cw["endTimeUnixNano"]) - t_set) / 1e3)
    return out


def _baseline_queue(rev: str) -> Any:
    """``SchedulingQueue`` as it was at git revision ``rev`` (loaded from ``git show``, not kept)."""
    import subprocess
    import sys
    import types

    name = f"{rev}:otel_kvtrace/schedule/queue.py"
    src = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "show", name],
                         check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("kvtrace_baseline_queue")
    sys.modules[module.__name__] = module
    exec(compile(src, name, "exec"), module.__dict__)  # noqa: S102 - the project's own source at REV
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--preset", default="hol")
    ap.add_argument("--baseline", metavar="REV", help="also run ready_queue with the queue of git revision REV")
    args = ap.parse_args()

    from otel_kvtrace.demo import run_demo
    from otel_kvtrace.schedule import install
    from otel_kvtrace.schedule import queue as live

    impl = {"fifo": live, "ready_queue": live}
    if args.baseline:
        impl[f"ready_queue@{args.baseline}"] = _baseline_queue(args.baseline)
    variants = list(impl)
    gets: dict[str, list[tuple[int, bool]]] = {v: [] for v in variants}
    lags: dict[str, dict[int, list[float]]] = {v: defaultdict(list) for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    dispatch: dict[str, list[float]] = {v: [] for v in variants}
    plain, cond_wait = queue.Queue.get, threading.Condition.wait
    with tempfile.TemporaryDirectory(prefix="kvtrace-schedcost-") as tmp:
        out = Path(tmp)
        for seed in range(0, args.seeds + 1):  # seed 0: warm-up, not kept
            for v in variants[seed % len(variants):] + variants[:seed % len(variants)]:  # each position in turn
                mod, policy = impl[v], v.split("@")[0]
                sched = mod.SchedulingQueue.get
                install.SchedulingQueue, install.hook_save_signals = mod.SchedulingQueue, mod.hook_save_signals
                queue.Queue.get = _timed_get(plain, gets[v])  # type: ignore[method-assign]
                mod.SchedulingQueue.get = _timed_get(sched, gets[v])
                threading.Condition.wait = _flagging_wait(cond_wait)  # type: ignore[method-assign]
                c0 = time.process_time()
                try:
                    res = run_demo(args.preset, seed=seed, steps=args.steps if seed else 10, scheduler=policy,
                                   out=out / v / str(seed))
                finally:
                    queue.Queue.get, mod.SchedulingQueue.get = plain, sched  # type: ignore[method-assign]
                    threading.Condition.wait = cond_wait  # type: ignore[method-assign]
                    install.SchedulingQueue = live.SchedulingQueue
                    install.hook_save_signals = live.hook_save_signals
                if not seed:
                    gets[v].clear()
                    continue
                cpu[v].append((time.process_time() - c0) * 1e3 / args.steps)
                for layer, x in wake_lags(res.scenarios[0].trace_files).items():
                    lags[v][layer].extend(x)
                dispatch[v].append(_busy_dispatch_us(res.scenarios[0].trace_files))
            print(f"seed {seed}/{args.seeds} done", flush=True)
    _print(variants, gets, lags, cpu, args)
    row = _row(variants)
    row("busy dispatch us", [statistics.median(dispatch[v]) for v in variants], ".2f")


def _busy_dispatch_us(files: list[Path]) -> float:
    """One run's median busy in-order dispatch gap (us), as ``kvtrace whatif --measured`` reads it."""
    from otel_kvtrace.load import load_traces
    from otel_kvtrace.whatif.measured import busy_dispatch_ns
    from otel_kvtrace.whatif.task import tasks_from_duckdb

    return busy_dispatch_ns(tasks_from_duckdb(load_traces(files).con)) / 1e3


def _row(variants: list[str]) -> Any:
    def row(label: str, values: list[float], fmt: str) -> None:
        base = values[0]
        print(f"{label:24}" + "".join(f"{format(x, fmt):>18} ({x / base if base else float('nan'):5.2f})"
                                      for x in values))
    return row


def _q(v: list[float], q: float) -> float:
    return statistics.quantiles(v, n=100)[int(q * 100) - 1] if len(v) > 1 else (v[0] if v else float("nan"))


def _print(variants: list[str], gets: dict[str, list[tuple[int, bool]]], lags: dict[str, dict[int, list[float]]],
           cpu: dict[str, list[float]], args: Any) -> None:
    print(f"\n{args.preset}: {args.seeds} seeds x {args.steps} steps per variant, order rotated per seed; "
          "(ratio) = / fifo")
    print(f"{'':24}" + "".join(f"{v:>26}" for v in variants))
    row = _row(variants)

    for label, blocked in (("get cpu us, no wait", False), ("get cpu us, waited", True)):
        xs = [[c / 1e3 for c, w in gets[v] if w is blocked] for v in variants]
        for q in (0.5, 0.9):
            row(f"{label} p{int(q * 100)}", [_q(x, q) for x in xs], ".2f")
        row(f"{label} n/run", [len(x) / args.seeds for x in xs], ".0f")
    row("cpu ms/step", [statistics.median(cpu[v]) for v in variants], ".3f")
    for layer in sorted(set().union(*(lags[v] for v in variants))):
        per = [lags[v].get(layer, []) for v in variants]
        if min(len(x) for x in per) >= 5:
            row(f"wake lag us L{layer}", [statistics.median(x) for x in per], ".0f")


if __name__ == "__main__":
    main()
