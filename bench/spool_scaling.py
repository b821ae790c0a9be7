"""Cost of ``Spool.put`` and ``Spool.tasks`` as the spool grows during a long outage (review finding 27).

Before, every ``put`` copied the list of all spooled batch keys and ``tasks`` summed every entry under
the lock (``flush`` and the metric callbacks read it): both O(batches), so an outage cost O(n^2). The
script fills a spool in a temporary directory with ``--small`` and then ``--large`` batches of one
tiny line each, and times ``--puts`` more puts and ``--reads`` reads of ``tasks`` at both sizes. With
``--old FILE`` it also times another ``spool.py`` (e.g. ``git show cd97672:otel_kvtrace/export/spool.py
> /tmp/old_spool.py``), the two variants alternating per repeat.

Usage::

    .venv/bin/python bench/spool_scaling.py --old /tmp/old_spool.py

The last line: ``<variant> put_us@small=... put_us@large=... tasks_us@small=... tasks_us@large=...``
per variant, medians over ``--repeats``. Timing includes the file write of each put (tmpfs or disk).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measure(module: ModuleType, size: int, puts: int, reads: int) -> tuple[float, float]:
    """(us per put, us per tasks read) on a spool already holding ``size`` batches."""
    with tempfile.TemporaryDirectory() as tmp:
        spool: Any = module.Spool(Path(tmp) / "s", max_bytes=sys.maxsize)
        line = b'{"resourceSpans":[]}\n'
        for _ in range(size):
            spool.put(line, 1)
        t0 = time.perf_counter()
        for _ in range(puts):
            spool.put(line, 1)
        put_us = (time.perf_counter() - t0) / puts * 1e6
        t0 = time.perf_counter()
        for _ in range(reads):
            spool.tasks  # noqa: B018 - the property is what is measured
        tasks_us = (time.perf_counter() - t0) / reads * 1e6
        assert spool.tasks == size + puts
    return put_us, tasks_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="another spool.py to compare with")
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=20000)
    parser.add_argument("--puts", type=int, default=500)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    variants = {"new": load(Path(__file__).resolve().parents[1] / "otel_kvtrace/export/spool.py", "spool_new")}
    if args.old is not None:
        variants["old"] = load(args.old, "spool_old")
    results: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            for label, size in (("small", args.small), ("large", args.large)):
                put_us, tasks_us = measure(variants[name], size, args.puts, args.reads)
                results[name].setdefault(f"put_us@{label}", []).append(put_us)
                results[name].setdefault(f"tasks_us@{label}", []).append(tasks_us)
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    for name, series in results.items():
        print(name, " ".join(f"{key}={statistics.median(vals):.2f}" for key, vals in sorted(series.items())))


if __name__ == "__main__":
    main()
