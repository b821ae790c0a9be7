"""Added latency per task on the REAL vLLM-Ascend recv thread: untraced vs traced, same run.

The released sdist (or ``KVTRACE_UPSTREAM_SRC``) is obtained and imported like the conformance tests do
(``tests/upstream/harness.py``). One producer loop plays the forward: per task it records a fresh
attention gate, sets the source layer's save event, enqueues a ``LayerLoadTask`` through
``add_request`` and waits for the layer's load event, so every patched stage runs (queue, save wait,
main's NPU sync, gate wait, address build, stagger, batch_copy, completion). The latency is enqueue ->
``layer_load_finished_events[layer].set()`` seen by the producer, in ns.

Modes, interleaved in rounds so that drift hits all of them alike:
  untraced        the upstream classes as they are
  traced          start_tracing(..., exporter=None): wrappers + recorder, records drained between rounds
  traced+agent    start_tracing(..., exporter="agent"): records go through the shared-memory ring to the
                  exporter agent process, which writes OTLP/JSON lines (the default)
  traced+thread   start_tracing(..., exporter="thread"): the in-process background exporter thread

``--commit-modes``: instead, ``untraced`` and ``traced+agent`` under ``OTEL_KVTRACE_RING_COMMIT=order`` and
``=crc`` (``traced+agent:order``, ``traced+agent:crc``; the ring's commit word alone, or a crc32 of each
slot's body as well, record/ring.py), side by side in the same rounds, in the latency and the CPU tables;
the last line is then ``commit_crc_minus_order_cpu_us=<recv> latency_crc_minus_order_us=<latency>``.

Usage::

    .venv/bin/python bench/upstream_overhead.py                 # 0.23.0.post1 sdist
    KVTRACE_UPSTREAM_SRC=/tmp/vllm-ascend-main .venv/bin/python bench/upstream_overhead.py
    .venv/bin/python bench/upstream_overhead.py --breakdown     # per-component recv-thread CPU
    .venv/bin/python bench/upstream_overhead.py --commit-modes  # crc vs store-order ring commit
    .venv/bin/python bench/upstream_overhead.py --settle-ab     # CPU table, procedure between chunks same vs sleep
    .venv/bin/python bench/upstream_overhead.py --cold-mb 0 2 32  # CPU table, caches emptied before each call

``--cold-mb``: the CPU table only, each call after that many MB were written (one byte per 64-byte line:
the caches emptied as far as they hold), side by side with 0 (warm, the default table's procedure). A recv
thread woken after the forward's Python work, or a forward after the recv thread's, runs on caches that the
other thread filled; what the recording adds then follows the cache lines it touches more than its
instructions (``bench/recording_instructions.py --cold`` counts those lines; docs/export.md, "The cold
footprint").
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("untraced", "traced", "traced+agent", "traced+thread", "wrappers+agent")
CPU_MODES = ("untraced", "traced", "traced+agent", "wrappers", "wrappers+agent")
"""``wrappers*``: the same with ``OTEL_KVTRACE_PROBES=wrappers`` (one wrapper/proxy per stage) instead of
the compiled probes (the default), side by side in the same rounds."""


COMMIT_MODES = ("untraced", "traced+agent:order", "traced+agent:crc")
"""``--commit-modes``: ``traced+agent`` with the ring's commit mode forced (``OTEL_KVTRACE_RING_COMMIT``)."""


def _start(targets: Any, mode: str, out: str, run_id: str) -> Any:
    """The session of ``mode`` (None for untraced); ``wrappers*`` modes install the wrapper path; a
    ``:crc`` / ``:order`` suffix sets ``OTEL_KVTRACE_RING_COMMIT`` for the session's ring."""
    import os

    from otel_kvtrace.api import start_tracing

    if mode == "untraced":
        return None
    mode, _, commit = mode.partition(":")
    env = {"OTEL_KVTRACE_PROBES": "wrappers" if mode.startswith("wrappers") else "compiled"}
    if commit:
        env["OTEL_KVTRACE_RING_COMMIT"] = commit
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        exporter = mode.split("+")[1] if "+" in mode else None
        session = start_tracing(targets, exporter=exporter, out_dir=out, run_id=run_id)
    finally:  # the user's own settings back, not dropped
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if commit:
        from otel_kvtrace.record import ring

        want = ring.COMMIT_CRC if commit == "crc" else ring.COMMIT_STORE_ORDER
        got = session.exporter.writer.hdr[ring.H_COMMIT_MODE]
        if got != want:
            session.shutdown()
            raise RuntimeError(f"{mode}:{commit}: the ring's commit mode is {got}, not {want}")
    return session


def _load_harness() -> Any:
    path = REPO / "tests" / "upstream" / "harness.py"
    spec = importlib.util.spec_from_file_location("kvtrace_upstream_harness", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_STEP_SHARED: dict[int, Any] = {}  # id(request) -> (request, the current step's SharedBlockData)


def _ready_task(up: Any, env: Any, request: Any, i: int, num_layers: int) -> tuple[Any, int]:
    """Task ``i`` with its dependencies already met: gate recorded, source layer's save done.

    As upstream does (``pool_worker._build_shared_load_data``), every layer's transfer task of one step
    carries the same ``SharedBlockData`` object; a new step (layer 1 again) gets a new one."""
    layer = 1 + i % (num_layers - 1)  # layer 0 is the save source of layer 1
    entry = _STEP_SHARED.get(id(request))
    if layer == 1 or entry is None or entry[0] is not request:
        entry = _STEP_SHARED[id(request)] = (request, up.shared_data([request]))
    gate = up.gate_class()
    gate.record()  # the forward already passed attention: the gate is open
    env.save_done[layer - 1].set()
    return up.gva_task(layer, [request], wait_for_save_layer=layer - 1, gate=gate, shared=entry[1]), layer


def _run_tasks(h: Any, up: Any, env: Any, count: int, num_layers: int, blocks: int) -> list[int]:
    """``count`` tasks through the real thread, one at a time; per-task latency in ns."""
    latencies = []
    request = up.request("r-bench", blocks)
    for i in range(count):
        task, layer = _ready_task(up, env, request, i, num_layers)
        t0 = time.perf_counter_ns()
        env.thread.add_request(task)
        env.load_done[layer].wait()
        latencies.append(time.perf_counter_ns() - t0)
        env.load_done[layer].clear()  # what the forward does after its wait
        env.save_done[layer - 1].clear()  # in case the version left it set
    return latencies


PROCESS_CPU: dict[str, list[float]] = {}
"""Per mode, per round: CPU ns of the whole serving process (all its threads, not the agent process)
per task, from the first enqueue until the round's tasks were exported (``session.flush()``)."""


def measure(tasks_per_round: int, rounds: int, num_layers: int, blocks: int,
            modes: tuple[str, ...] = MODES) -> dict[str, list[list[int]]]:
    """Per mode, one list of per-task latencies (ns) per round (process CPU per task into ``PROCESS_CPU``)."""

    h = _load_harness()
    root = h.upstream_source_dir()
    results: dict[str, list[list[int]]] = {mode: [] for mode in modes}
    with h.upstream_session(root) as up, tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as out:
        version = f"{up.binding.version} ({up.binding.layout})"
        print(f"vllm-ascend {version} from {root}", file=sys.stderr)
        targets = up.binding.to_targets()
        for round_no in range(rounds):
            for mode in modes:
                session = _start(targets, mode, out, "bench")
                env = up.gva_thread(num_layers, h.FakeBackend())
                _run_tasks(h, up, env, 50, num_layers, blocks)  # warm-up: attach, pools, caches
                if session is not None:
                    session.recorder.drain(1 << 20) if session.exporter is None else session.flush()
                cpu0 = time.process_time_ns()
                results[mode].append(_run_tasks(h, up, env, tasks_per_round, num_layers, blocks))
                if session is not None and session.exporter is not None:
                    session.flush(60.0)  # in-process exporter: its span building counts; agent: it waits
                PROCESS_CPU.setdefault(mode, []).append((time.process_time_ns() - cpu0) / tasks_per_round)
                if session is not None:
                    stats = session.shutdown()
                    if stats.disabled_reason:
                        raise RuntimeError(f"tracing disabled itself during the bench: {stats.disabled_reason}")
            print(f"  round {round_no + 1}/{rounds} done", file=sys.stderr, flush=True)
    return results


def evictor(cold_mb: float) -> Any:
    """A function that writes ``cold_mb`` MB (one byte per 64-byte line), emptying the caches that far; None for 0."""
    if cold_mb <= 0:
        return None
    import numpy as np

    buf = np.zeros(int(cold_mb * (1 << 20)), dtype=np.uint8)

    def evict() -> None:
        buf[::64] += 1

    return evict


def _cpu_per_call(up: Any, env: Any, count: int, num_layers: int, blocks: int,
                  evict: Any = None) -> tuple[float, float]:
    """The same tasks driven synchronously on this thread (no thread hand-offs, GC off): CPU ns per
    ``add_request`` (the forward's side) and per ``_handle_request`` (the recv thread's side); ``evict``
    (:func:`evictor`) runs before each timed call, untimed (it writes data only: on real hardware the
    instruction cache keeps what the writing loop did not displace)."""
    import gc

    request = up.request("r-bench", blocks)
    thread = env.thread
    enqueue_ns = handle_ns = 0
    gc.collect()
    gc.disable()
    try:
        for i in range(count):
            task, layer = _ready_task(up, env, request, i, num_layers)
            if evict is not None:
                evict()
            t0 = time.thread_time_ns()
            thread.add_request(task)
            t1 = time.thread_time_ns()
            item = thread.request_queue.get()
            if evict is not None:
                evict()
            t2 = time.thread_time_ns()
            thread._handle_request(item)
            t3 = time.thread_time_ns()
            enqueue_ns += t1 - t0
            handle_ns += t3 - t2
            env.load_done[layer].clear()
            env.save_done[layer - 1].clear()
    finally:
        gc.enable()
    return enqueue_ns / count, handle_ns / count


def frames_per_task(tasks: int, num_layers: int, blocks: int, exporter: str | None = None,
                    probes: str = "compiled") -> tuple[float, float]:
    """Python frames of otel_kvtrace entered per task (deterministic): (add_request side, _handle_request side).

    ``exporter=None`` counts the recording alone; ``"agent"`` includes shipping each task into the ring."""

    h = _load_harness()
    counts = [0, 0]
    phase = [0]

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and "otel_kvtrace" in frame.f_code.co_filename:
            counts[phase[0]] += 1

    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-f-") as tmp:
        mode = ("wrappers" if probes == "wrappers" else "traced") + (f"+{exporter}" if exporter else "")
        session = _start(up.binding.to_targets(), mode, tmp, "bench-frames")
        env = up.gva_thread(num_layers, h.FakeBackend(), start=False)
        _cpu_per_call(up, env, 20, num_layers, blocks)  # warm-up: attach
        request = up.request("r-bench", blocks)
        for i in range(tasks):
            task, layer = _ready_task(up, env, request, i, num_layers)
            phase[0] = 0
            sys.setprofile(profiler)
            env.thread.add_request(task)
            sys.setprofile(None)
            item = env.thread.request_queue.get()
            phase[0] = 1
            sys.setprofile(profiler)
            env.thread._handle_request(item)
            sys.setprofile(None)
            env.load_done[layer].clear()
            env.save_done[layer - 1].clear()
        if exporter is None:
            session.recorder.drain(1 << 20)
        session.shutdown()
    return counts[0] / tasks, counts[1] / tasks


CHUNK = 100
"""Tasks per measured chunk: between chunks (not measured) the records are shipped and recycled, as in a
serving process, so every chunk runs in the steady state (no pool exhaustion, no full ring)."""

GAP_S = 0.25
"""``same``: how long the procedure between chunks lasts in every mode, on the CPU: more than the agent's
200 ms poll, so the agent's drain fits in it."""

SETTLES = ("same", "sleep")
"""The untimed procedure between CPU chunks (not before ``measure``'s latency rounds). ``same`` (default): the mode's drain, the agent's waited for on the
CPU, then on the CPU until ``GAP_S`` has passed, in every mode: no chunk starts after a sleep. ``sleep``
(the procedure up to 2026-12-06, a diagnostic): the drain only, the agent's waited for asleep
(``session.flush``: 5 ms sleeps until the agent's next poll, ~150 ms), every other mode's at once; so only
the agent's chunks started after the thread had left the CPU, which costs CPU per task in every mode
(docs/export.md, "The agent's extra recv CPU in upstream_overhead: the bench's sleep")."""

DRAIN_SLACK_S = 1.0
"""``same``: how much longer than ``GAP_S`` the agent's drain is waited for on the CPU before it is waited for
asleep (an idle-policy agent gets little CPU while another process keeps the other core busy)."""

LATE_DRAINS: dict[str, int] = {}
"""``same``: per mode, chunks before which the agent had not drained within ``GAP_S + DRAIN_SLACK_S`` on the
CPU (then waited for asleep, as ``sleep`` does: such a chunk starts after a sleep)."""


def measure_cpu(tasks: int, rounds: int, num_layers: int, blocks: int,
                modes: tuple[str, ...] = CPU_MODES, settles: tuple[str, ...] = ("same",),
                gap_s: float = GAP_S, cold_mb: float = 0) -> dict[str, list[tuple[float, float]]]:
    """Per mode, per round: CPU ns per add_request and per _handle_request. With several ``settles`` (the
    procedure between chunks, ``SETTLES``), each mode runs under each of them in the same rounds, keyed
    ``mode@settle``; with one, keyed by mode; the order of the modes is reversed every other round. Chunks
    that followed a late drain: ``LATE_DRAINS``."""

    h = _load_harness()
    keys = [(mode, settle) for settle in settles for mode in modes]
    out: dict[str, list[tuple[float, float]]] = {_key(m, s, settles): [] for m, s in keys}
    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-cpu-") as tmp:
        targets = up.binding.to_targets()
        for rnd in range(rounds):
            for mode, settle in (keys if rnd % 2 == 0 else keys[::-1]):  # no mode always after the same one
                key = _key(mode, settle, settles)
                session = _start(targets, mode, tmp, "bench-cpu")
                env = up.gva_thread(num_layers, h.FakeBackend(), start=False)
                _cpu_per_call(up, env, 50, num_layers, blocks)  # warm-up
                evict = evictor(cold_mb)
                chunks = []
                for _ in range(max(1, tasks // CHUNK)):
                    if not _settle(session, settle, gap_s):
                        LATE_DRAINS[key] = LATE_DRAINS.get(key, 0) + 1
                    chunks.append(_cpu_per_call(up, env, CHUNK, num_layers, blocks, evict))
                out[key].append((statistics.fmean(c[0] for c in chunks), statistics.fmean(c[1] for c in chunks)))
                if session is not None:
                    session.shutdown()
    return out


def _key(mode: str, settle: str, settles: tuple[str, ...]) -> str:
    return mode if len(settles) == 1 else f"{mode}@{settle}"


def _settle(session: Any, settle: str = "same", gap_s: float = GAP_S) -> bool:
    """Ship what was recorded (agent: until the agent exported it; in-process: drained and recycled) by the
    procedure ``settle`` (``SETTLES``). False when ``same`` had to wait for the agent asleep (a late drain)."""
    if settle not in SETTLES:
        raise ValueError(f"settle {settle!r} is not one of {SETTLES}")
    t0 = time.perf_counter()
    on_time = True
    if session is not None and session.exporter is None:
        session.recorder.recycle(session.recorder.drain(1 << 20))
    elif session is not None:
        # ``same`` waits for the agent's drain on the CPU, asleep only when it is late; the thread exporter
        # (no ring) exports on this thread in its own flush
        on_cpu = settle == "same" and getattr(session.exporter, "writer", None) is not None
        drained = on_cpu and session.exporter.force_flush(gap_s + DRAIN_SLACK_S, poll_s=0)
        on_time = drained or not on_cpu
        if not drained and not session.flush(30.0):
            raise RuntimeError("the exporter did not export the chunk's records in 30 s")
    if settle == "same":
        while time.perf_counter() - t0 < gap_s:  # on the CPU: this thread does not leave it between chunks
            pass
    return on_time


def _pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def commit_modes(args: Any) -> None:
    """``--commit-modes``: latency and CPU of ``traced+agent`` under both ring commit modes, same rounds."""
    import os

    modes = COMMIT_MODES
    print(f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    results = measure(args.tasks, args.rounds, args.layers, args.blocks, modes)
    round_medians = {mode: [statistics.median(r) for r in results[mode]] for mode in modes}
    print(f"\nper-task latency, enqueue -> load event set; {args.rounds} rounds x {args.tasks} tasks per mode")
    print(f"{'mode':20} {'median us':>10} {'added us':>9} {'added us range':>16}")
    for mode in modes:
        added = [m - b for m, b in zip(round_medians[mode], round_medians["untraced"], strict=True)]
        pooled = [x for r in results[mode] for x in r]
        print(f"{mode:20} {statistics.median(pooled) / 1e3:10.1f} {statistics.median(added) / 1e3:9.1f} "
              f"{min(added) / 1e3:7.1f}..{max(added) / 1e3:<7.1f}")
    latency_diff = [c - o for c, o in zip(round_medians["traced+agent:crc"], round_medians["traced+agent:order"],
                                          strict=True)]
    cpu = measure_cpu(max(args.tasks, 1000), max(5, args.rounds // 2), args.layers, args.blocks, modes,
                      (args.settle,), args.gap_ms / 1000)
    print(f"\nCPU per task on the calling thread (synchronous, GC off, chunks of {CHUNK}, settle {args.settle}), "
          "median over rounds of the added CPU:")
    for mode in modes[1:]:
        enq = statistics.median(t[0] - u[0] for t, u in zip(cpu[mode], cpu["untraced"], strict=True))
        handle = statistics.median(t[1] - u[1] for t, u in zip(cpu[mode], cpu["untraced"], strict=True))
        print(f"  {mode:20} add_request +{enq / 1e3:.2f} us, _handle_request +{handle / 1e3:.2f} us (probes + ring write)")
    diff = [c[1] - o[1] for c, o in zip(cpu["traced+agent:crc"], cpu["traced+agent:order"], strict=True)]
    print(f"crc - order, per round (recv CPU us): {' '.join(f'{d / 1e3:+.2f}' for d in diff)}")
    _print_late_drains()
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print(f"commit_crc_minus_order_cpu_us={statistics.median(diff) / 1e3:.2f} "
          f"latency_crc_minus_order_us={statistics.median(latency_diff) / 1e3:.1f}")


def _print_late_drains() -> None:
    if LATE_DRAINS:
        print("late drains (chunks that started after waiting for the agent asleep): "
              + ", ".join(f"{key} {n}" for key, n in sorted(LATE_DRAINS.items())))


def settle_ab(args: Any) -> None:
    """``--settle-ab``: the CPU table under both procedures between chunks (``SETTLES``), in the same rounds."""
    import os

    modes = ("untraced", "traced", "traced+agent")
    rounds = max(5, args.rounds // 2)
    print(f"load average {os.getloadavg()[0]:.2f} at start, {time.strftime('%H:%M:%S', time.gmtime())} UTC",
          flush=True)
    cpu = measure_cpu(max(args.tasks, 1000), rounds, args.layers, args.blocks, modes, SETTLES, args.gap_ms / 1000)
    print(f"\nCPU per task on the calling thread (synchronous, GC off, chunks of {CHUNK}); {rounds} rounds, each "
          f"mode under each procedure in every round; median over rounds of the added CPU against untraced under "
          f"the same procedure (same: {args.gap_ms:.0f} ms on the CPU between chunks):")
    print(f"{'procedure':10} {'untraced us':>12} " + " ".join(f"{m + ' +us':>18}" for m in modes[1:])
          + f" {'agent - traced':>15}")
    for settle in SETTLES:
        base = cpu[f"untraced@{settle}"]
        added = {m: [t[1] - u[1] for t, u in zip(cpu[f"{m}@{settle}"], base, strict=True)] for m in modes[1:]}
        gap = statistics.median(a - t for a, t in zip(added["traced+agent"], added["traced"], strict=True))
        print(f"{settle:10} {statistics.median(u[1] for u in base) / 1e3:12.1f} "
              + " ".join(f"{statistics.median(added[m]) / 1e3:+18.1f}" for m in modes[1:]) + f" {gap / 1e3:+15.1f}")
    for settle in SETTLES:
        for m in modes[1:]:
            enq = statistics.median(t[0] - u[0] for t, u in zip(cpu[f"{m}@{settle}"], cpu[f"untraced@{settle}"],
                                                                 strict=True))
            per_round = " ".join(f"{(t[1] - u[1]) / 1e3:+.1f}" for t, u in zip(cpu[f"{m}@{settle}"],
                                                                              cpu[f"untraced@{settle}"], strict=True))
            print(f"  {settle:6} {m:13} add_request +{enq / 1e3:.2f} us; _handle_request per round: {per_round}")
    _print_late_drains()
    print(f"load average {os.getloadavg()[0]:.2f} at end, {time.strftime('%H:%M:%S', time.gmtime())} UTC")


def cold_table(args: Any) -> None:
    """``--cold-mb``: the CPU table with the caches emptied before each call, per size, in the same rounds."""
    import os

    modes = ("untraced", "traced", "traced+agent")
    rounds = max(3, args.rounds // 3)
    print(f"load average {os.getloadavg()[0]:.2f} at start, {time.strftime('%H:%M:%S', time.gmtime())} UTC",
          flush=True)
    cpu: dict[float, dict[str, list[tuple[float, float]]]] = {mb: {m: [] for m in modes} for mb in args.cold_mb}
    for rnd in range(rounds):  # sizes and modes each in reversed order every other round
        order = modes if rnd % 2 == 0 else modes[::-1]
        for mb in (args.cold_mb if rnd % 2 == 0 else args.cold_mb[::-1]):
            got = measure_cpu(args.tasks, 1, args.layers, args.blocks, order, (args.settle,), args.gap_ms / 1000, mb)
            for m in modes:
                cpu[mb][m] += got[m]
    print(f"\nCPU per call on the calling thread (synchronous, GC off, chunks of {CHUNK}), caches emptied before "
          f"each call by writing MB (0: warm); {rounds} rounds; median over rounds, added = against untraced:")
    print(f"{'MB':>6} {'add_request us':>15} " + " ".join(f"{m + ' +us':>17}" for m in modes[1:])
          + f" {'_handle_request us':>19} " + " ".join(f"{m + ' +us':>17}" for m in modes[1:]))
    for mb in args.cold_mb:
        base = cpu[mb]["untraced"]
        cells = []
        for side in (0, 1):
            cells.append(f"{statistics.median(u[side] for u in base) / 1e3:15.2f}" if side == 0 else
                         f"{statistics.median(u[side] for u in base) / 1e3:19.2f}")
            cells += [f"{statistics.median(t[side] - u[side] for t, u in zip(cpu[mb][m], base, strict=True)) / 1e3:+17.2f}"
                      for m in modes[1:]]
        print(f"{mb:6g} " + " ".join(cells))
    _print_late_drains()
    print(f"load average {os.getloadavg()[0]:.2f} at end, {time.strftime('%H:%M:%S', time.gmtime())} UTC")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=200, help="tasks per mode per round (default 200)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the recv thread (default 8)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per task (default 16)")
    parser.add_argument("--commit-modes", action="store_true",
                        help="traced+agent under OTEL_KVTRACE_RING_COMMIT=order and =crc, side by side (see above)")
    parser.add_argument("--settle", choices=SETTLES, default="same",
                        help="the untimed procedure between CPU chunks (default same: the drain, then on the CPU "
                             "until --gap-ms in every mode; sleep: the old one, the agent's drain asleep)")
    parser.add_argument("--gap-ms", type=float, default=GAP_S * 1000,
                        help="--settle same: the procedure's length in every mode (default 250 ms)")
    parser.add_argument("--settle-ab", action="store_true",
                        help="only the CPU table, under both --settle procedures side by side in the same rounds")
    parser.add_argument("--cold-mb", type=float, nargs="+", default=None, metavar="MB",
                        help="only the CPU table, each call after MB of writes (caches emptied; 0 = warm), per MB "
                             "given, side by side (see above)")
    parser.add_argument("--breakdown", action="store_true",
                        help="print the recv thread's added CPU per component instead (bench/recv_breakdown.py)")
    args = parser.parse_args()
    if args.breakdown and args.cold_mb is not None:
        parser.error("--cold-mb is a table of its own: not with --breakdown")
    if args.breakdown:
        import recv_breakdown

        recv_breakdown.main(["--layers", str(args.layers), "--blocks", str(args.blocks)])
        return
    for name in ("tasks", "rounds", "blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.layers < 2:
        parser.error("--layers must be >= 2 (layer l waits for the save of layer l-1)")
    if args.cold_mb is not None:
        if args.commit_modes or args.settle_ab:
            parser.error("--cold-mb is a table of its own: not with --commit-modes or --settle-ab")
        if not all(math.isfinite(mb) and mb >= 0 for mb in args.cold_mb):
            parser.error("--cold-mb takes finite sizes >= 0")
        cold_table(args)
        return
    if args.commit_modes:
        commit_modes(args)
        return
    if args.settle_ab:
        settle_ab(args)
        return
    results = measure(args.tasks, args.rounds, args.layers, args.blocks)
    # The machine is shared: compare modes within each round (they ran back to back), then take the
    # median over rounds of those per-round figures.
    round_medians = {mode: [statistics.median(r) for r in results[mode]] for mode in MODES}
    pooled = {mode: [x for r in results[mode] for x in r] for mode in MODES}
    print(f"\nper-task latency, enqueue -> load event set; {args.rounds} rounds x {args.tasks} tasks per mode")
    print(f"{'mode':15} {'median us':>10} {'p90 us':>9} {'added us':>9} {'ratio':>6} {'ratio range':>14}")
    for mode in MODES:
        added = [m - b for m, b in zip(round_medians[mode], round_medians["untraced"], strict=True)]
        ratios = [m / b for m, b in zip(round_medians[mode], round_medians["untraced"], strict=True)]
        print(f"{mode:15} {statistics.median(pooled[mode]) / 1e3:10.1f} {_pct(pooled[mode], 0.9) / 1e3:9.1f} "
              f"{statistics.median(added) / 1e3:9.1f} {statistics.median(ratios):6.2f} "
              f"{min(ratios):6.2f}-{max(ratios):<6.2f}")
    print("(added us and ratio: median over rounds of the per-round difference / ratio to untraced)")
    base_cpu = PROCESS_CPU["untraced"]
    print("serving-process CPU per task, all its threads, until exported (the GIL budget tracing takes):")
    for mode in MODES[1:]:
        added_cpu = statistics.median(m - b for m, b in zip(PROCESS_CPU[mode], base_cpu, strict=True))
        print(f"  {mode:15} +{added_cpu / 1e3:.1f} us on {statistics.median(base_cpu) / 1e3:.1f} us")
    cpu = measure_cpu(max(args.tasks, 1000), max(5, args.rounds // 2), args.layers, args.blocks, CPU_MODES,
                      (args.settle,), args.gap_ms / 1000)
    base_handle = statistics.median(u[1] for u in cpu["untraced"])
    print(f"\nCPU per task on the calling thread (synchronous, GC off, chunks of {CHUNK} with the records shipped "
          f"between them, settle {args.settle}), median over rounds of the added CPU:")
    added: dict[str, tuple[float, float]] = {}
    for mode in CPU_MODES[1:]:
        enq = statistics.median(t[0] - u[0] for t, u in zip(cpu[mode], cpu["untraced"], strict=True))
        handle = statistics.median(t[1] - u[1] for t, u in zip(cpu[mode], cpu["untraced"], strict=True))
        added[mode] = (enq, handle)
        print(f"  {mode:13} add_request +{enq / 1e3:.1f} us (forward), _handle_request +{handle / 1e3:.1f} us "
              f"on {base_handle / 1e3:.1f} us (recv)")
    added_enqueue, added_handle = added["traced+agent"]
    for probes in ("compiled", "wrappers"):
        for exporter in (None, "agent"):
            enq_frames, handle_frames = frames_per_task(200, args.layers, args.blocks, exporter, probes)
            print(f"otel_kvtrace Python frames per task, {probes} probes "
                  f"({'recording only' if exporter is None else 'with the ring write'}):"
                  f" add_request {enq_frames:.1f}, _handle_request {handle_frames:.1f}")
    latency_added = statistics.median(
        m - b for m, b in zip(round_medians["traced+agent"], round_medians["untraced"], strict=True))
    _print_late_drains()
    print(f"added_latency_us={latency_added / 1e3:.1f} added_forward_cpu_us={added_enqueue / 1e3:.1f} "
          f"added_recv_cpu_us={added_handle / 1e3:.1f}")


if __name__ == "__main__":
    main()
