"""The live scheduler's own cost on the ``hol`` replica preset: FIFO vs ``ready_queue``, same run,
alternated (ABBA per seed, one untimed warm-up run per policy first).

Printed side by side, medians over every recv-thread dequeue / every waited layer of every run:

- ``get cpu us``: recv-thread CPU time spent inside ``request_queue.get()`` (``thread_time_ns``: the
  decision, the locks, the allocations), p50 and p90, apart for calls that returned without waiting and
  calls that waited on the queue's condition (their CPU includes the wake-up's own system time);
- ``wake lag us`` per layer: the forward's ``consumer_wait`` end minus the task's ``completion`` end,
  for layers the forward was already waiting on (the woken forward's wait for the GIL is in it);
- ``cpu ms/step``: process CPU per forward step.

Usage::

    .venv/bin/python bench/scheduler_cost.py              # 6 seeds x 40 steps (~1 min)
    .venv/bin/python bench/scheduler_cost.py --seeds 10 --steps 60
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

POLICIES = ("fifo", "ready_queue")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--preset", default="hol")
    args = ap.parse_args()

    from otel_kvtrace.demo import run_demo
    from otel_kvtrace.schedule.queue import SchedulingQueue

    gets: dict[str, list[tuple[int, bool]]] = {p: [] for p in POLICIES}
    lags: dict[str, dict[int, list[float]]] = {p: defaultdict(list) for p in POLICIES}
    cpu: dict[str, list[float]] = {p: [] for p in POLICIES}
    plain, sched, cond_wait = queue.Queue.get, SchedulingQueue.get, threading.Condition.wait
    with tempfile.TemporaryDirectory(prefix="kvtrace-schedcost-") as tmp:
        out = Path(tmp)
        for p in POLICIES:
            run_demo(args.preset, seed=0, steps=10, scheduler=p, out=out / "warmup")
        for seed in range(1, args.seeds + 1):
            for p in (POLICIES if seed % 2 else POLICIES[::-1]):
                sink = gets[p]
                queue.Queue.get = _timed_get(plain, sink)  # type: ignore[method-assign]
                SchedulingQueue.get = _timed_get(sched, sink)  # type: ignore[method-assign]
                threading.Condition.wait = _flagging_wait(cond_wait)  # type: ignore[method-assign]
                c0 = time.process_time()
                try:
                    res = run_demo(args.preset, seed=seed, steps=args.steps, scheduler=p, out=out / p / str(seed))
                finally:
                    queue.Queue.get, SchedulingQueue.get = plain, sched  # type: ignore[method-assign]
                    threading.Condition.wait = cond_wait  # type: ignore[method-assign]
                cpu[p].append((time.process_time() - c0) * 1e3 / args.steps)
                for layer, v in wake_lags(res.scenarios[0].trace_files).items():
                    lags[p][layer].extend(v)
            print(f"seed {seed}/{args.seeds} done", flush=True)
    _print(gets, lags, cpu, args)


def _q(v: list[float], q: float) -> float:
    return statistics.quantiles(v, n=100)[int(q * 100) - 1] if len(v) > 1 else (v[0] if v else float("nan"))


def _print(gets: dict[str, list[tuple[int, bool]]], lags: dict[str, dict[int, list[float]]],
           cpu: dict[str, list[float]], args: Any) -> None:
    a, b = POLICIES
    print(f"\n{args.preset}: {args.seeds} seeds x {args.steps} steps per policy, ABBA")
    print(f"{'':24}{a:>12}{b:>14}{'ratio':>8}")
    for label, blocked in (("get cpu us, no wait", False), ("get cpu us, waited", True)):
        xa = [c / 1e3 for c, w in gets[a] if w is blocked]
        xb = [c / 1e3 for c, w in gets[b] if w is blocked]
        for q in (0.5, 0.9):
            x, y = _q(xa, q), _q(xb, q)
            print(f"{f'{label} p{int(q * 100)}':24}{x:12.2f}{y:14.2f}{y / x:8.2f}")
        print(f"{f'{label} n/run':24}{len(xa) / args.seeds:12.0f}{len(xb) / args.seeds:14.0f}")
    x, y = statistics.median(cpu[a]), statistics.median(cpu[b])
    print(f"{'cpu ms/step':24}{x:12.3f}{y:14.3f}{y / x:8.2f}")
    for layer in sorted(set(lags[a]) | set(lags[b])):
        la, lb = lags[a].get(layer, []), lags[b].get(layer, [])
        if len(la) < 5 or len(lb) < 5:
            continue
        x, y = statistics.median(la), statistics.median(lb)
        print(f"{f'wake lag us L{layer} (n)':24}{x:7.0f}({len(la):3}){y:9.0f}({len(lb):3}){y / x:8.2f}")


if __name__ == "__main__":
    main()
