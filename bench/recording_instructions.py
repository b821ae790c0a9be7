"""Instructions the recording adds per task on the REAL vLLM-Ascend GVA recv thread (callgrind, deterministic).

Counts, under ``valgrind --tool=callgrind``, the instructions of the ``add_request`` calls (forward side) and
of the ``_handle_request`` calls (recv side) only: instrumentation starts after the warm-up
(``--instr-atstart=no``) and collection is toggled on around each call and off around everything else
(task set-up, queue get, the drain and recycling between chunks), with valgrind's own client requests
from a tiny C helper built with ``gcc`` (``callgrind.h``; ``bench/_callgrind.py`` runs valgrind and parses
the dumps for this bench and ``recv_breakdown.py --instructions``). Same workload as
``bench/upstream_overhead.py`` (``_ready_task``: save wait, gate, build, stagger, copy), synchronous on
one thread, GC off, ``PYTHONHASHSEED=0``, ``start_tracing(exporter=None)`` (recording only: no ring write).

Also (not with ``--ablate``) the forward's per-layer release path on a REAL ``KVPoolWorker`` with its real
threads (``release_path``): the ``wait_for_layer_load`` calls of layers 1.. of each step, each after the recv
thread shipped that layer's task, so what tracing adds there is the wrapper, the consumer-wait stamps and the
release (with the ring, ``traced+agent``: the ``MSG_CWAIT`` write and the recycle). ``--opcodes`` does not
count it.

Printed per mode: instructions per call, and the added instructions (traced - untraced) per C function
(callgrind self cost), so where the recording's instructions go is visible without timing noise.
``--ablate`` (compiled probes only) additionally compiles ``_handle_request`` with one group of stamps
emptied at a time (template replaced by ``pass``; the proof still runs) and prints what each group costs.

``--cold`` counts, besides the instructions, the cache lines each call touches *cold*: callgrind's cache
simulation (``_callgrind.CACHE``: 32 KB L1s, 2 MB last level) with ``COLD_MB`` of writes and 64 KB of run
code before every counted call (not counted), so each call starts with empty caches, as a recv thread woken
after the forward's Python work, or a forward after the recv thread's, does on a busy host. Its last-level
misses (instruction reads + data reads + data writes) are the lines it needed from memory: its footprint
(the ``ctypes`` calls that switch the counting on and off are in it too, alike in every mode). On this VM
a cold line costs ~18-37 ns against ~0.15 ns per instruction (``bench/upstream_overhead.py --cold-mb``:
the same calls timed cold), so what the recording adds in situ follows its added lines more than its
instructions (docs/export.md, "The cold footprint").

Usage::

    .venv/bin/python bench/recording_instructions.py                 # untraced, compiled, wrappers
    .venv/bin/python bench/recording_instructions.py --ablate        # + per-stamp cost of the compiled path
    .venv/bin/python bench/recording_instructions.py --against DIR   # another checkout too, side by side
    .venv/bin/python bench/recording_instructions.py --modes untraced,traced,traced+agent  # with the ring
    .venv/bin/python bench/recording_instructions.py --cold --modes untraced,traced,traced+agent  # lines cold
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _callgrind  # noqa: E402

STAMP_GROUPS: dict[str, tuple[str, ...]] = {
    # group -> rewrite.py template names emptied together (a group's stamps share local names)
    "save wait": ("_SAVE_BEFORE", "_SAVE_TIMED_OUT", "_SAVE_RESTART", "_SAVE_AFTER"),
    "gate wait": ("_GATE_BEFORE", "_GATE_TIMED_OUT", "_GATE_RESTART", "_GATE_AFTER"),
    "build": ("_BUILD_AFTER",),  # _SPAN_BEFORE also opens main's NPU sync: kept
    "stagger": ("_STAGGER_AFTER",),
    "batch copy": ("_COPY_AFTER", "_BYTES_AFTER"),
    "bytes sum": ("_BYTES_AFTER",),
    "load set": ("_LOAD_SET_BEFORE",),
}


COLD_MB = 4
"""``--cold``: MB written (one byte per 64-byte line) before each counted call: twice the simulated last level."""


def evictor(bench: Any, cg: Any, cold: bool) -> Any:
    """A function that empties the simulated caches: ``COLD_MB`` written by ``bench.evictor`` (upstream_overhead's,
    the data caches and the last level), then the helper's ``kv_flush_code`` run (the 32 KB instruction cache);
    one that does nothing if not ``cold``."""
    if not cold:
        return lambda: None
    write, flush_code = bench.evictor(COLD_MB), cg.kv_flush_code

    def evict() -> None:
        write()
        flush_code()

    return evict


def load_upstream_overhead() -> Any:
    """``bench/upstream_overhead.py`` as a module (its harness loader, tasks and session start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvtrace_upstream_overhead", HERE / "upstream_overhead.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return bench


def child(mode: str, tasks: int, lib: str, ablate: list[str], cold: bool = False) -> None:
    """Runs under valgrind: warm up, then count ``tasks`` add_request and ``tasks`` _handle_request calls
    (``cold``: each after the caches were emptied, see ``--cold``)."""
    import ctypes
    import gc

    cg = ctypes.CDLL(lib)
    bench = load_upstream_overhead()
    evict = evictor(bench, cg, cold)
    if ablate:
        from otel_kvtrace.instrument import rewrite

        for group in ablate:
            for name in STAMP_GROUPS[group]:
                setattr(rewrite, name, "pass")
    h = bench._load_harness()
    num_layers, blocks = 8, 16
    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-ir-") as tmp:
        session = bench._start(up.binding.to_targets(), mode, tmp, "bench-ir")
        if session is not None and ablate:
            from otel_kvtrace.instrument import rewrite

            assert rewrite.is_compiled(up.binding.classes["recv_gva"]._handle_request), "ablated build fell back"
        env = up.gva_thread(num_layers, h.FakeBackend(), start=False)
        gc.collect()
        gc.disable()
        count_calls(bench, up, env, num_layers, blocks, cg, evict, tasks, 300, lambda: bench._settle(session))
        if not ablate:
            release_path(h, up, bench, session, cg, tasks, evict)
        if session is not None:
            reason = session.recorder.disabled_reason
            session.shutdown()
            if reason:
                raise RuntimeError(f"tracing disabled itself: {reason}")


def count_calls(bench: Any, up: Any, env: Any, num_layers: int, blocks: int, cg: Any, evict: Any, tasks: int,
                warm: int, settle: Any = None) -> None:
    """``warm`` uncounted calls of both paths (attach, pools, caches, with the toggles in place), then dump
    ``forward``: ``tasks`` counted ``add_request`` calls, and dump ``recv``: ``tasks`` counted
    ``_handle_request`` calls; ``evict()`` before each counted call, ``settle()`` every 100 tasks (both
    uncounted). The tasks are ``upstream_overhead._ready_task``'s, on ``env``'s thread, synchronous."""
    import ctypes

    thread = env.thread
    request = up.request("r-bench", blocks)
    on, off = cg.kv_on, cg.kv_off  # bound once: a ``CDLL`` attribute lookup inside the window would count

    def run(n: int, which: int, i0: int) -> None:
        for i in range(i0, i0 + n):
            if settle is not None and i % 100 == 0:
                settle()
            task, layer = bench._ready_task(up, env, request, i, num_layers)
            if which == 0:
                evict()
                on()
                thread.add_request(task)
                off()
                thread._handle_request(thread.request_queue.get())
            else:
                thread.add_request(task)
                item = thread.request_queue.get()
                evict()
                on()
                thread._handle_request(item)
                off()
            env.load_done[layer].clear()
            env.save_done[layer - 1].clear()

    cg.kv_dump.argtypes = [ctypes.c_char_p]
    for which in (0, 1):
        run(warm, which, 0)
    cg.kv_start()
    run(tasks, 0, warm)
    cg.kv_dump(b"forward")
    cg.kv_start()
    run(tasks, 1, warm + tasks)
    cg.kv_dump(b"recv")


RELEASE_LAYERS = 8
SIDES = ("forward", "recv", "release")
"""Dumps per run: ``add_request`` (forward), ``_handle_request`` (recv), ``wait_for_layer_load`` (release)."""


def release_path(h: Any, up: Any, bench: Any, session: Any, cg: Any, tasks: int, evict: Any) -> None:
    """The forward's per-layer ``wait_for_layer_load`` on a REAL ``KVPoolWorker`` (``harness.pool_worker``: its
    own ``_start_kv_transfer_threads``, real recv and send threads running), counted for ``tasks`` calls, dump
    ``release``: with tracing, the wrapper, the consumer-wait stamps of ``layer_load_finished_events[i].wait``
    and the release (``Recorder.submit_consumer``: with the ring, the ``MSG_CWAIT`` write and the recycle).

    Per step (``start_load_kv``; the transfer tasks of every layer share one ``SharedBlockData``, as in
    ``upstream_overhead._ready_task``): layer 0's call (not counted) submits every layer's load (prefetch =
    layers) and waits for it; the forward then opens the attention gate and the recv thread completes every
    load; once it is back in its queue ``get`` (queue joined, each held record down to the forward's hold)
    the calls of layers 1.. are counted, each followed (not counted) by the gate record and ``save_kv_layer``
    (no save tasks). So no other thread runs while a call is counted, and every counted call is the one
    common case: the load is done and the recv thread has shipped the task (``submit_first``), the forward
    waits (an already set event) and is the last holder. Upstream's GVA recv thread clears the task's
    transfer-task list, which is the worker's ``layer_load_tasks[layer]``; the forward only waits while that
    list is not empty, so it is refilled before each counted call (the same in every mode): what upstream
    runs when the forward reaches the layer before its load completes, minus the blocking."""
    import time
    from types import SimpleNamespace

    from otel_kvtrace.instrument.attach import WORKER_ATTR

    num_layers = RELEASE_LAYERS
    worker = h.pool_worker(up, num_layers, num_layers, h.FakeBackend())
    thread = worker.kv_recv_thread
    request = up.request("r-bench", 16)
    counted = 0
    warm = 300

    def step(count: bool) -> None:
        nonlocal counted, warm
        worker.start_load_kv(SimpleNamespace(requests=[]))
        shared = up.shared_data([request])
        lists = [up.gva_task(layer, [request], shared=shared).transfer_tasks for layer in range(num_layers)]
        for layer in range(num_layers):
            worker.layer_load_tasks[layer][:] = lists[layer]
        worker.wait_for_layer_load()  # submits every layer's load, waits for layer 0's
        up.gate_module.record_attention_compute_start()
        worker.save_kv_layer(None)
        thread.request_queue.join()
        ws = worker.__dict__.get(WORKER_ATTR)
        if session is not None:
            deadline = time.monotonic() + 60
            while len(ws.step_records) != num_layers - 1 or any(len(r.holds) != 1 for r in ws.step_records.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the recv thread did not finish the step's loads")
                time.sleep(0.001)
        time.sleep(0.02)  # the recv thread back in its queue get
        for layer in range(1, num_layers):
            worker.layer_load_tasks[layer][:] = lists[layer]  # refilled: the recv thread cleared it
            on = count and counted < tasks
            if on:
                evict()
                cg.kv_on()
            worker.wait_for_layer_load()
            if on:
                cg.kv_off()
                counted += 1
            else:
                warm -= 1
            up.gate_module.record_attention_compute_start()
            worker.save_kv_layer(None)

    steps = 0
    while warm > 0 or counted < tasks:
        if steps % 14 == 0:  # ~100 tasks, as ``run`` settles
            bench._settle(session)
        if warm <= 0 and not counted:
            cg.kv_start()
        step(warm <= 0)
        steps += 1
    cg.kv_dump(b"release")


def opcodes(mode: str, tasks: int) -> dict[str, dict[str, float]]:
    """Bytecodes executed per call (``sys.settrace`` opcode events, deterministic, layout-independent), per
    side: in upstream's function by source line (a stamp carries the line of the statement it stamps, so
    traced - untraced per line is that stamp's bytecodes) and in otel_kvtrace's own functions by name."""
    import gc
    import linecache

    bench = load_upstream_overhead()
    h = bench._load_harness()
    num_layers, blocks = 8, 16
    counts: list[dict[str, int]] = [{}, {}]
    side = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            if "otel_kvtrace" in code.co_filename:
                key = f"otel_kvtrace {code.co_name}"
            else:
                line = frame.f_lineno
                key = f"L{line} {linecache.getline(code.co_filename, line).strip()[:60]}" if line else "no line"
            c = counts[side[0]]
            c[key] = c.get(key, 0) + 1
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_code.co_name
        if "otel_kvtrace" in frame.f_code.co_filename or name in ("_handle_request", "add_request"):
            frame.f_trace_opcodes = True
            return local
        return None

    with h.upstream_session(h.upstream_source_dir()) as up, tempfile.TemporaryDirectory(prefix="kvtrace-op-") as tmp:
        session = bench._start(up.binding.to_targets(), mode, tmp, "bench-op")
        env = up.gva_thread(num_layers, h.FakeBackend(), start=False)
        thread = env.thread
        request = up.request("r-bench", blocks)
        gc.disable()
        for i in range(300 + tasks):
            if i % 100 == 0:
                bench._settle(session)
            task, layer = bench._ready_task(up, env, request, i, num_layers)
            on = i >= 300
            side[0] = 0
            if on:
                sys.settrace(tracer)
            thread.add_request(task)
            sys.settrace(None)
            item = thread.request_queue.get()
            side[0] = 1
            if on:
                sys.settrace(tracer)
            thread._handle_request(item)
            sys.settrace(None)
            env.load_done[layer].clear()
            env.save_done[layer - 1].clear()
        if session is not None:
            session.shutdown()
    return {name: {k: v / tasks for k, v in c.items()} for name, c in zip(("forward", "recv"), counts)}


def measure(tree: Path, mode: str, tasks: int, lib: Path, ablate: list[str], tmp: Path,
            cold: bool = False) -> dict[str, Any]:
    """One valgrind run of ``child`` in ``tree``; per side: instructions per call and per C function (``cold``:
    also the cache lines touched cold per call, in all and per C function)."""
    tag = f"{mode}-{'-'.join(a.replace(' ', '_') for a in ablate) or 'all'}-{abs(hash(str(tree)))}"
    code = (f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(HERE)!r}); "
            f"import recording_instructions as r; r.child({mode!r}, {tasks}, {str(lib)!r}, {ablate!r}, {cold!r})")
    result: dict[str, Any] = {}
    for what, (total, per, ev) in _callgrind.dumps(code, tree, tmp / f"cg.{tag}", cache=cold).items():
        if what in SIDES:
            result[what] = {"per_call": total / tasks, "functions": {k: v / tasks for k, v in per.items()}}
            if cold:
                result[what]["cold_lines"] = sum(ev[k] for k in _callgrind.COLD_EVENTS) / tasks
                result[what]["cold_functions"] = {k: v / tasks for k, v in ev["by_function"].items()}
    return result


def _delta(a: dict[str, float], b: dict[str, float], top: int) -> list[tuple[str, float]]:
    names = set(a) | set(b)
    rows = [(n, a.get(n, 0.0) - b.get(n, 0.0)) for n in names]
    rows.sort(key=lambda r: -abs(r[1]))
    return [r for r in rows[:top] if abs(r[1]) >= 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=400, help="counted calls per side (default 400)")
    parser.add_argument("--against", type=Path, default=None, help="another checkout, counted the same way")
    parser.add_argument("--ablate", action="store_true", help="per stamp group of the compiled _handle_request")
    parser.add_argument("--top", type=int, default=14, help="C functions listed per side (default 14)")
    parser.add_argument("--modes", default="untraced,traced,wrappers")
    parser.add_argument("--opcodes", action="store_true",
                        help="bytecodes per call instead (no valgrind): per upstream line and per otel_kvtrace function")
    parser.add_argument("--json", type=Path, default=None, help="write every count here too")
    parser.add_argument("--cold", action="store_true",
                        help="also count the cache lines each call touches with the caches emptied before it "
                             "(simulated; slower: use --tasks 100)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.opcodes and args.cold:
        parser.error("--opcodes counts bytecodes without valgrind: --cold does not apply")
    if args.opcodes:
        base = opcodes("untraced", args.tasks)
        for mode in modes[1:]:
            got = opcodes(mode, args.tasks)
            for side in ("forward", "recv"):
                total = sum(got[side].values()) - sum(base[side].values())
                print(f"-- {mode} {side}: added bytecodes per call {total:+.1f}, by upstream line / own function")
                for key, d in _delta(got[side], base[side], args.top):
                    print(f"   {d:+7.1f}  {key}")
        return
    trees = [("this", HERE.parent)] + ([("other", args.against.resolve())] if args.against else [])
    with tempfile.TemporaryDirectory(prefix="kvtrace-cg-") as tmp_name:
        tmp = Path(tmp_name)
        lib = _callgrind.build_helper(tmp)
        res: dict[str, dict[str, Any]] = {}
        for name, tree in trees:
            for mode in modes:
                res[f"{name}/{mode}"] = measure(tree, mode, args.tasks, lib, [], tmp, args.cold)
                print(f"  counted {name}/{mode}", file=sys.stderr, flush=True)
        abl: dict[str, dict[str, Any]] = {}
        if args.ablate:
            for group in STAMP_GROUPS:
                abl[group] = measure(HERE.parent, "traced", args.tasks, lib, [group], tmp, args.cold)
                print(f"  counted ablation {group}", file=sys.stderr, flush=True)
    print(f"instructions per call (callgrind, {args.tasks} calls per side, PYTHONHASHSEED=0, GC off, exporter=None "
          "but for +agent modes; wait_for_layer_load: the forward's per-layer release on a real KVPoolWorker)")
    _print_table(trees, modes, res, "per_call", ".0f")
    _print_by_function(trees, modes, res, "functions", "instructions per call by C function (self cost)", ".0f",
                       args.top)
    if args.cold:
        _print_cold(trees, modes, res, abl, args.top)
    if abl:
        full = res["this/traced"]["recv"]["per_call"]
        print("-- compiled _handle_request, instructions per call of each stamp group (all stamps - that group emptied)")
        for group, r in abl.items():
            print(f"   {full - r['recv']['per_call']:+9.0f}  {group} ({', '.join(STAMP_GROUPS[group])})")
        base = res["this/untraced"]["recv"]["per_call"]
        print(f"   {full - base:+9.0f}  all stamps (prelude, try/finally, exit and submit included)")
    if args.json:
        args.json.write_text(json.dumps({"modes": res, "ablate": abl}, indent=1))


def _print_table(trees: list[tuple[str, Path]], modes: list[str], res: dict[str, Any], key: str, added: str) -> None:
    """Per tree and mode, ``key`` per call of each side, and added against the tree's untraced run."""
    print(f"{'tree/mode':24} {'add_request':>12} {'added':>9} {'_handle_request':>16} {'added':>9} "
          f"{'wait_for_layer_load':>20} {'added':>9}")
    for name, _tree in trees:
        base = res[f"{name}/untraced"]
        for mode in modes:
            r = res[f"{name}/{mode}"]
            print(f"{name + '/' + mode:24}" + "".join(
                f" {r[side][key]:{width}.0f} {r[side][key] - base[side][key]:+9{added}}"
                for side, width in (("forward", 12), ("recv", 16), ("release", 20))))


def _print_by_function(trees: list[tuple[str, Path]], modes: list[str], res: dict[str, Any], key: str, what: str,
                       fmt: str, top: int) -> None:
    """Per tree, traced mode and side: the ``top`` C functions by ``key`` (per-function counts) added over untraced."""
    for name, _tree in trees:
        base = res[f"{name}/untraced"]
        for mode in modes[1:]:
            for side in SIDES:
                print(f"-- {name}/{mode} {side}: added {what}")
                for fn, d in _delta(res[f"{name}/{mode}"][side][key], base[side][key], top):
                    print(f"   {d:+9{fmt}}  {fn}")


def _print_cold(trees: list[tuple[str, Path]], modes: list[str], res: dict[str, Any], abl: dict[str, Any],
                top: int) -> None:
    """``--cold``: cache lines touched cold per call (last-level misses, caches emptied before each call)."""
    print(f"cache lines touched cold per call (simulated {'/'.join(_callgrind.CACHE[1:])}, {COLD_MB} MB written "
          "and 64 KB of code run before each counted call; instruction + data-read + data-write last-level misses)")
    _print_table(trees, modes, res, "cold_lines", ".1f")
    _print_by_function(trees, modes, res, "cold_functions", "cache lines touched cold per call by C function", ".1f",
                       top)
    if abl:
        full = res["this/traced"]["recv"]["cold_lines"]
        print("-- compiled _handle_request, cache lines touched cold per call by each stamp group")
        for group, r in abl.items():
            print(f"   {full - r['recv']['cold_lines']:+9.1f}  {group}")


if __name__ == "__main__":
    main()
