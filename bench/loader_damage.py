"""Benchmark: what damage costs the loader, and what the SQL screen costs, side by side in one run.

Variants over the same synthetic inputs (bench/synthetic_traces.py), alternated, medians of ``--repeats``:

- ``clean``: ``--files`` files of ``--tasks`` tasks each, nothing wrong;
- ``one_garbage_line``: the same, with one line of garbage appended to one file (DuckDB fails the scan;
  the loader isolates the file by halving the list and cleans only that file);
- ``one_empty_file``: the same plus one empty file (listed in ``stats.empty_files``, not an error);
- ``screen_off``: the fast-path INSERT alone without the SQL screen vs ``screen_on`` with it, on the
  clean set (what the one-validation screen costs).

    python bench/loader_damage.py                 # 3000 files x 3 tasks (the issue's case)
    python bench/loader_damage.py --files 200 --tasks 500
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json  # noqa: E402

from otel_kvtrace.load import load_traces  # noqa: E402
from otel_kvtrace.load.otlp_sql import create_raw_spans_sql, insert_spans_sql  # noqa: E402


def _make(root: Path, files: int, tasks: int) -> list[Path]:
    spec = QueueSpec(run_id="bench", pid=4000)
    queue = simulate_queue(spec, tasks * files, seed=1)
    out = []
    for i in range(files):
        out.append(write_otlp_json(root / f"f{i:05d}.jsonl", [(spec, queue[i * tasks:(i + 1) * tasks])]))
    return out


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _insert(files: list[Path], screen: bool) -> None:
    con = duckdb.connect()
    con.execute(create_raw_spans_sql("t"))
    con.execute(insert_spans_sql("t", screen=screen), {"files": [str(f) for f in files]}).fetchall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    try:
        clean = tmp / "clean"
        files = _make(clean, args.files, args.tasks)
        garbage = tmp / "garbage"
        shutil.copytree(clean, garbage)
        with open(garbage / files[len(files) // 2].name, "ab") as f:
            f.write(b"this is not json\n")
        empty = tmp / "empty"
        shutil.copytree(clean, empty)
        (empty / "zz-empty.jsonl").write_bytes(b"")
        variants = {
            "clean": lambda: load_traces(clean),
            "one_garbage_line": lambda: load_traces(garbage),
            "one_empty_file": lambda: load_traces(empty),
            "screen_on": lambda: _insert(files, True),
            "screen_off": lambda: _insert(files, False),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, fn in variants.items():  # alternate the variants
                times[name].append(_time(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{args.files} files x {args.tasks} tasks, median of {args.repeats}:")
        for k, v in med.items():
            print(f"  {k:18s} {v:7.2f} s")
        print(f"  garbage/clean ratio {med['one_garbage_line'] / med['clean']:.2f}, "
              f"empty/clean {med['one_empty_file'] / med['clean']:.2f}, "
              f"screen on/off {med['screen_on'] / med['screen_off']:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
