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

``--packers`` compares the two task packers of this tree instead (``OTEL_KVTRACE_RING_PACK=python``
against the native ``_ringpack``), side by side in one run: the rows above, then, on the REAL
vLLM-Ascend recv thread (``bench/upstream_overhead.py``'s harness and method: synchronous
``_handle_request``, GC off, chunks of 100 tasks with the records shipped between them), the added CPU per
``_handle_request`` and per ``add_request`` of ``traced`` (recording only), ``traced+agent`` with the
Python packer and ``traced+agent`` with the native packer, interleaved in rounds (the order reversed
every other round, so neither packer always runs first), medians over rounds of the per-round difference
to ``untraced``; ``--instructions`` adds the instructions per ship of each packer (callgrind,
``recv_breakdown.ship_instructions``, deterministic). This is the one python-against-native A/B of the
benches::

    .venv/bin/python bench/ship_ab.py --packers [--rounds 5] [--tasks 1000] [--instructions]
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


def upstream_cpu(rounds: int, tasks: int, layers: int = 8, blocks: int = 16) -> dict[str, list[tuple[float, float]]]:
    """Per mode, per round: CPU ns per ``add_request`` and per ``_handle_request`` of the real recv thread
    (``upstream_overhead.measure_cpu``'s loop; the packer is chosen when the session's ring is made)."""
    import os
    import tempfile

    sys.path.insert(0, str(REPO / "bench"))
    import upstream_overhead as uo

    h = uo._load_harness()
    modes = {"untraced": ("untraced", None), "traced": ("traced", None),
             "agent, python packer": ("traced+agent", "python"), "agent, native packer": ("traced+agent", "native")}
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    saved = os.environ.get("OTEL_KVTRACE_RING_PACK")
    try:
        with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-ab-") as tmp:
            targets = up.binding.to_targets()
            order = list(modes.items())
            for i in range(rounds):
                for name, (mode, pack) in order if i % 2 == 0 else order[::-1]:  # neither side always first
                    os.environ["OTEL_KVTRACE_RING_PACK"] = pack or "auto"
                    session = uo._start(targets, mode, tmp, "bench-ab")
                    if pack is not None:
                        want = "python" if pack == "python" else "native"
                        used = "python" if session.recorder.ring._packer is None else "native"
                        assert used == want, f"{name}: the ring uses the {used} packer (not built?)"
                    env = up.gva_thread(layers, h.FakeBackend(), start=False)
                    uo._cpu_per_call(up, env, 50, layers, blocks)  # warm-up
                    chunks = []
                    for _ in range(max(1, tasks // uo.CHUNK)):
                        uo._settle(session)
                        chunks.append(uo._cpu_per_call(up, env, uo.CHUNK, layers, blocks))
                    out[name].append((statistics.fmean(c[0] for c in chunks), statistics.fmean(c[1] for c in chunks)))
                    if session is not None:
                        stats = session.shutdown()
                        if stats.disabled_reason:
                            raise RuntimeError(f"tracing disabled itself: {stats.disabled_reason}")
                print(f"  round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        if saved is None:
            os.environ.pop("OTEL_KVTRACE_RING_PACK", None)
        else:
            os.environ["OTEL_KVTRACE_RING_PACK"] = saved
    return out


def _run_packer(pack: str) -> dict[str, float]:
    import os

    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'bench')!r}); " \
           "import json, ship_ab; print(json.dumps(ship_ab.measure()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "OTEL_KVTRACE_RING_PACK": pack})
    return json.loads(done.stdout.strip().splitlines()[-1])


def packers(rounds: int, tasks: int, instructions: bool = False) -> None:
    import os

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if instructions:  # deterministic: first, so a failing valgrind stops the run before the timed part
        sys.path.insert(0, str(REPO / "bench"))
        import recv_breakdown

        counts = {pack: recv_breakdown.ship_instructions(REPO, pack) for pack in ("python", "native")}
        used = {pack: recv_breakdown.packer_in_use(REPO, pack) for pack in counts}
        assert used == {"python": "python", "native": "native"}, f"packers in use: {used} (not built?)"
        print(f"{'':36} {'python':>9} {'native':>9} {'native/py':>10}")
        print(f"{'instructions per ship (Recorder._ship, callgrind)':36} {counts['python']:9.0f} "
              f"{counts['native']:9.0f} {counts['native'] / counts['python']:10.2f}")
    runs: dict[str, list[dict[str, float]]] = {"python": [], "native": []}
    for i in range(rounds):
        for pack in ("python", "native") if i % 2 == 0 else ("native", "python"):  # neither always first
            runs[pack].append(_run_packer(pack))
        print(f"  round {i + 1}/{rounds} done", file=sys.stderr)
    print(f"{'ns per call (median over rounds of the best of 5)':36} {'python':>9} {'native':>9} {'native/py':>10}")
    for name in ("write_task",):
        a = statistics.median(r[name] for r in runs["python"])
        b = statistics.median(r[name] for r in runs["native"])
        print(f"{name:36} {a:9.0f} {b:9.0f} {b / a:10.2f}")
    cpu = upstream_cpu(rounds, tasks)
    base = cpu["untraced"]
    print(f"\nreal recv thread, CPU per call on the calling thread, {rounds} rounds x {tasks} tasks; added = median over "
          f"rounds of (mode - untraced); untraced _handle_request {statistics.median(u[1] for u in base) / 1e3:.1f} us")
    def spread(diffs: list[float]) -> str:
        return f"{statistics.median(diffs) / 1e3:+5.1f} us ({min(diffs) / 1e3:+.1f}..{max(diffs) / 1e3:+.1f})"

    for name in list(cpu)[1:]:
        enq = statistics.median(t[0] - u[0] for t, u in zip(cpu[name], base, strict=True))
        handle = [t[1] - u[1] for t, u in zip(cpu[name], base, strict=True)]
        print(f"  {name:22} _handle_request {spread(handle)}   add_request {enq / 1e3:+4.1f} us")
    for pack in ("python", "native"):
        ship = [a[1] - t[1] for a, t in zip(cpu[f"agent, {pack} packer"], cpu["traced"], strict=True)]
        print(f"  the ship in context ({pack:6}: agent - traced)  _handle_request {spread(ship)}")
    gain = [p[1] - n[1] for p, n in zip(cpu["agent, python packer"], cpu["agent, native packer"], strict=True)]
    print(f"  python packer - native packer, same round:   _handle_request {spread(gain)}")
    print("  (median over rounds; in brackets the range over rounds)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="the other checkout (e.g. a git archive)")
    parser.add_argument("--packers", action="store_true", help="this tree's Python task packer against the native one")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument("--tasks", type=int, default=1000, help="--packers: recv tasks per mode per round (default 1000)")
    parser.add_argument("--instructions", action="store_true",
                        help="--packers: also instructions per ship of each packer (valgrind's callgrind)")
    args = parser.parse_args(argv)
    if args.packers:
        if args.against is not None:
            parser.error("--packers compares this tree with itself: not with --against")
        packers(args.rounds, args.tasks, args.instructions)
        return
    if args.against is None:
        parser.error("--against DIR or --packers")
    if not (args.against / "otel_kvtrace").is_dir():
        parser.error(f"{args.against}: no otel_kvtrace package there")
    runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    for i in range(args.rounds):
        for name in ("other", "this") if i % 2 == 0 else ("this", "other"):  # neither tree always first
            runs[name].append(_run(args.against.resolve() if name == "other" else REPO))
        print(f"  round {i + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{'ns per call (median over rounds of the best of 5)':36} {'other':>9} {'this':>9} {'this/other':>10}")
    for name in runs["this"][0]:
        a = statistics.median(r[name] for r in runs["other"])
        b = statistics.median(r[name] for r in runs["this"])
        print(f"{name:36} {a:9.0f} {b:9.0f} {b / a:10.2f}")


if __name__ == "__main__":
    main()
