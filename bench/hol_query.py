"""Benchmark: load + HOL query at 250k / 500k / 1M tasks, from OTLP/JSON lines and from the Parquet cache,
next to the same HOL computation as a straightforward Python scan, all in one run.

Inputs are synthetic (bench/synthetic_traces.py, schema.md-exact, ~9.6 spans per task), 4 queues per size,
one file per queue, generated once and cached under bench/out/ (gitignored; ~3.7 GB per million tasks).

Per size it prints: JSON load, HOL SQL on the loaded tables, their sum (json_s), Parquet load (cache hit)
+ HOL SQL (parquet_s), the Python scan (python_scan_s: the HOL intervals computed in plain Python from
columns already fetched out of DuckDB; the fetch is shown apart), and checks that the Python scan and
the SQL agree on the number of intervals and their total duration. JSON figures are the median of
``--json-repeats`` runs, Parquet and Python figures medians of ``--repeats`` runs; CPU seconds are shown
beside wall seconds because the 2-core box is shared (CPU / 2 is the wall time on two idle cores).

    python bench/hol_query.py                      # 250k, 500k, 1M
    python bench/hol_query.py --sizes 20000 50000  # quick look

The last line is ``tasks=<largest> json_s=<x> parquet_s=<y> python_scan_s=<z>``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import duckdb

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json  # noqa: E402

from otel_kvtrace.analyse.queries import get_query  # noqa: E402
from otel_kvtrace.load import load_traces  # noqa: E402

QUEUES = 4
OUT = HERE / "out"
WAIT_STAGES = ("save_cpu_wait", "save_npu_sync", "gate_cond_wait", "gate_npu_sync", "slot_release_wait")
INF = 2**63 - 1


def _write_queue(args: tuple[int, int, int, str]) -> str:
    size, queue, n_tasks, path = args
    spec = QueueSpec(run_id=f"bench{size}", pid=1000 + queue, thread_name=f"kv-recv-{queue}", tp=queue,
                     cfg_label=f"bench gva N=8 q{queue % 2}")
    tasks = simulate_queue(spec, n_tasks, seed=size + queue, hol_probability=0.05, bounded_probability=0.1)
    write_otlp_json(path + ".tmp", [(spec, tasks)], tasks_per_line=64)
    os.replace(path + ".tmp", path)
    return path


def inputs_for(size: int) -> list[Path]:
    """The cached input files for ``size`` tasks (generated on first use, 2 processes)."""
    directory = OUT / f"tasks{size}"
    directory.mkdir(parents=True, exist_ok=True)
    per_queue = [size // QUEUES + (1 if q < size % QUEUES else 0) for q in range(QUEUES)]
    paths = [directory / f"queue{q}.jsonl" for q in range(QUEUES)]
    missing = [(size, q, per_queue[q], str(p)) for q, p in enumerate(paths) if not p.exists()]
    if missing:
        print(f"generating {size} tasks into {directory} (once) ...", flush=True)
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=2) as pool:
            list(pool.map(_write_queue, missing))
        print(f"  generated in {time.perf_counter() - t0:.0f} s", flush=True)
    return paths


def python_scan(tasks: list[tuple], waits: list[tuple]) -> tuple[int, int]:
    """HOL intervals by a plain Python scan; returns (intervals, total ns) for comparison with the SQL.

    ``tasks``: (trace_id, queue, step, seq, final, enqueue, ready, ready_lo); ``waits``: (trace_id, start, end).
    Per queue and step (HOL is within a step), walk tasks from the last seq to the first keeping the
    earliest bypass-ready time behind
    (upper and lower bound); merge each head's wait windows; clip them as hol_intervals.sql does.
    """
    by_trace: dict[str, list[tuple[int, int]]] = {}
    for trace_id, start, end in waits:
        if end > start:
            by_trace.setdefault(trace_id, []).append((start, end))
    queues: dict[tuple, list[tuple]] = {}
    for row in tasks:
        queues.setdefault((row[1], row[2]), []).append(row)
    count = total = 0
    for rows in queues.values():
        rows.sort(key=lambda r: r[3], reverse=True)
        best_hi = best_lo = INF
        for trace_id, _queue, _step, _seq, final, enqueue, ready, ready_lo in rows:
            ready = enqueue if ready is None else ready  # as SQL greatest(), which skips NULLs
            ready_lo = ready if ready_lo is None else ready_lo
            windows = by_trace.get(trace_id)
            if windows and best_lo < INF:
                own_hi = max(enqueue, ready)
                own_lo = max(enqueue, ready_lo)
                windows.sort()
                merged: list[list[int]] = []
                for start, end in windows:
                    if merged and start <= merged[-1][1]:
                        merged[-1][1] = max(merged[-1][1], end)
                    else:
                        merged.append([start, end])
                for ws, we in merged:
                    p1, p2 = max(ws, best_hi), min(we, own_lo)
                    a1, a2 = max(ws, best_lo), min(we, own_hi)
                    if p1 < p2:
                        count += 1
                        total += p2 - p1
                        if a1 < p1:
                            count += 1
                            total += p1 - a1
                        if p2 < a2:
                            count += 1
                            total += a2 - p2
                    elif a1 < a2:
                        count += 1
                        total += a2 - a1
            if not final:
                best_hi = min(best_hi, max(enqueue, ready))
                best_lo = min(best_lo, max(enqueue, ready_lo))
    return count, total


def cpu_s() -> float:
    """CPU seconds of this process (all DuckDB threads): shows contention from other work on the box."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def hol_sql(con: duckdb.DuckDBPyConnection) -> tuple[float, int, int]:
    sql = get_query("hol_intervals").sql
    t0 = time.perf_counter()
    count, total = con.execute(f"SELECT count(*), coalesce(sum(dur_ns), 0) FROM ({sql})").fetchall()[0]
    return time.perf_counter() - t0, count, int(total)


def run_size(size: int, repeats: int, json_repeats: int, cache_root: Path) -> dict[str, float]:
    files = inputs_for(size)
    gb = sum(f.stat().st_size for f in files) / 1e9
    # JSON -> tables, then HOL (single run: this is the expensive path).
    runs = []  # (load_s, hol_s, cpu_s) per JSON run; the last run's tables serve the Python scan
    for index in range(json_repeats):
        if index:
            loaded.con.close()
        t0, c0 = time.perf_counter(), cpu_s()
        loaded = load_traces(files)
        load_s = time.perf_counter() - t0
        hol_s, count, total = hol_sql(loaded.con)
        runs.append((load_s, hol_s, cpu_s() - c0))
    best = sorted(runs, key=lambda r: r[0] + r[1])[len(runs) // 2]  # the median run by total time
    load_s, hol_s, json_cpu = best
    spans = loaded.stats.spans
    # Python scan over the same data.
    t0 = time.perf_counter()
    tasks = loaded.con.execute(
        "SELECT trace_id, queue, step, seq, coalesce(final_layer, false), ts_enqueue, ts_ready, ts_ready_lo FROM tasks"
    ).fetchall()
    waits = loaded.con.execute(
        "SELECT trace_id, start_ns, end_ns FROM spans WHERE name IN "
        f"({', '.join(repr(s) for s in WAIT_STAGES)})").fetchall()
    fetch_s = time.perf_counter() - t0
    scan_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        py_count, py_total = python_scan(tasks, waits)
        scan_times.append(time.perf_counter() - t0)
    del tasks, waits
    assert (py_count, py_total) == (count, total), f"python scan {py_count, py_total} != SQL {count, total}"
    loaded.con.close()
    # Parquet cache: write once (untimed), then load + HOL from it.
    cache_dir = cache_root / f"tasks{size}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    t0 = time.perf_counter()
    load_traces(files, cache_dir=cache_dir).con.close()
    cache_write_s = time.perf_counter() - t0
    parquet_times = []
    c0 = cpu_s()
    for _ in range(repeats):
        con = duckdb.connect()
        t0 = time.perf_counter()
        hit = load_traces(files, cache_dir=cache_dir, con=con)
        assert hit.stats.cache == "hit"
        _, p_count, p_total = hol_sql(con)
        parquet_times.append(time.perf_counter() - t0)
        assert (p_count, p_total) == (count, total)
        con.close()
    parquet_cpu = (cpu_s() - c0) / repeats
    row = {
        "tasks": size, "spans": spans, "json_gb": gb, "load_json_s": load_s, "hol_sql_s": hol_s,
        "json_s": load_s + hol_s, "cache_write_s": cache_write_s, "parquet_s": statistics.median(parquet_times),
        "fetch_s": fetch_s, "python_scan_s": statistics.median(scan_times), "intervals": count,
        "json_cpu_s": json_cpu, "parquet_cpu_s": parquet_cpu,
    }
    print(f"tasks={size:>8} spans={spans:>9} json={gb:.2f} GB | load_json={load_s:6.2f} s "
          f"hol_sql={hol_s:5.2f} s json_total={row['json_s']:6.2f} s (cpu {json_cpu:6.2f} s, "
          f"{spans / load_s / 1e3:.0f}k spans/s) | parquet load+hol={row['parquet_s']:5.2f} s "
          f"(cpu {parquet_cpu:5.2f} s) "
          f"| python_scan={row['python_scan_s']:5.2f} s (+fetch {fetch_s:.2f} s) "
          f"| intervals={count} | sql/python hol ratio={hol_s / row['python_scan_s']:.2f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3, help="runs per Parquet/Python figure (median)")
    parser.add_argument("--json-repeats", type=int, default=3,
                        help="JSON load + HOL runs per size (the median run is shown; the box is shared)")
    parser.add_argument("--cache-root", type=Path, default=OUT / "parquet-cache")
    args = parser.parse_args()
    print(f"duckdb {duckdb.__version__}, {os.cpu_count()} CPUs, threads="
          f"{duckdb.connect().execute('SELECT current_setting(' + repr('threads') + ')').fetchall()[0][0]}")
    rows = [run_size(size, args.repeats, args.json_repeats, args.cache_root) for size in sorted(args.sizes)]
    by_size = {r["tasks"]: r for r in rows}
    if 500_000 in by_size and 1_000_000 in by_size:
        a, b = by_size[1_000_000], by_size[500_000]
        print(f"scaling 1M/500k: json {a['json_s'] / b['json_s']:.2f}x, parquet {a['parquet_s'] / b['parquet_s']:.2f}x, "
              f"python {a['python_scan_s'] / b['python_scan_s']:.2f}x (target <= 2.2x)")
    last = rows[-1]
    print(f"tasks={last['tasks']} json_s={last['json_s']:.2f} parquet_s={last['parquet_s']:.2f} "
          f"python_scan_s={last['python_scan_s']:.2f}")


if __name__ == "__main__":
    main()
