"""Python code under valgrind's callgrind, and its instruction counts (Ir): the one home of the valgrind
command line, the fixed hash seed and the parsing, for ``bench/recording_instructions.py`` (toggled
collection, one dump per client request, per C function) and ``bench/recv_breakdown.py`` (whole-run
totals, differenced between two loop lengths).

- ``total(code, cwd)``: Ir of a whole ``python -c code`` run (callgrind's ``Collected :`` line).
- ``dumps(code, cwd, out)``: with collection off at start (the code toggles it through ``helper``'s C
  functions, built by ``build_helper``): per dump named by ``CALLGRIND_DUMP_STATS_AT(what)``, ``(total,
  self Ir per C function)`` (``callgrind_annotate``).

``PYTHONHASHSEED=0`` always: str hashes (dict probes) otherwise move a count by ~2 % between identical runs.

``cache=True`` (``dumps``) adds callgrind's cache simulation over a small fixed hierarchy (``CACHE``: 32 KB
L1s, a 2 MB last level, so that a few MB of writes and 64 KB of run code evict everything) and
returns the miss counts with each dump: with the caches emptied before each counted call, the last-level
misses of a call are the cache lines it touches cold, its footprint (see ``recording_instructions.py --cold``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HELPER_C = r"""
#include <valgrind/callgrind.h>
void kv_on(void) { CALLGRIND_TOGGLE_COLLECT; }
void kv_off(void) { CALLGRIND_TOGGLE_COLLECT; }
void kv_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void kv_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
/* 64 KB of straight-line code: run, it displaces every line of a 32 KB instruction cache (--cold) */
void kv_flush_code(void) { __asm__ volatile(".rept 65536\n\tnop\n.endr"); }
"""


def build_helper(tmp: Path) -> Path:
    """The client-request helper (``kv_on``/``kv_off``/``kv_start``/``kv_dump``, and ``kv_flush_code``: 64 KB of
    code that, run, empties a 32 KB instruction cache) as a shared library in ``tmp``,
    for ``ctypes.CDLL`` inside the counted code."""
    src = tmp / "kvcg.c"
    src.write_text(HELPER_C)
    lib = tmp / "kvcg.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


CACHE = ("--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64", "--LL=2097152,16,64")
"""The simulated hierarchy of ``cache=True``: fixed, so counts do not depend on the host's caches."""
COLD_EVENTS = ("ILmr", "DLmr", "DLmw")
"""Last-level misses: instruction reads, data reads, data writes (a line touched cold costs one of these)."""


def _run(code: str, cwd: Path, env: dict[str, str] | None, out: str, toggled: bool,
         cache: bool = False) -> subprocess.CompletedProcess:
    cmd = ["valgrind", "--tool=callgrind"]
    if toggled:
        cmd += ["--instr-atstart=no", "--collect-atstart=no"]
    if cache:
        cmd += list(CACHE)
    cmd += [f"--callgrind-out-file={out}", sys.executable, "-c", code]
    full_env = {**os.environ, **(env or {}), "PYTHONHASHSEED": "0"}
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd, env=full_env)


def total(code: str, cwd: Path, env: dict[str, str] | None = None) -> int:
    """Instructions of the whole run of ``python -c code`` in ``cwd`` (``env``: variables added)."""
    done = _run(code, cwd, env, "/dev/null", toggled=False)
    m = re.search(r"Collected : (\d+)", done.stderr)
    if m is None:
        raise RuntimeError(f"no callgrind total in: {done.stderr[-500:]}")
    return int(m.group(1))


def _annotate(path: Path, shown: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """(program total, self count per C function) of one dump, each the sum of the events ``shown``, as
    ``callgrind_annotate`` prints them (``.`` for zero; the inlined interpreter body named as the eval loop)."""
    done = subprocess.run(["callgrind_annotate", "--threshold=100", "--show=" + ",".join(shown), str(path)],
                          capture_output=True, text=True, check=True)
    number = r"\s*([\d,]+|\.)(?: \(\s*[\d.]+%\))?"
    columns = number * len(shown)
    tot = 0
    per: dict[str, int] = {}
    for line in done.stdout.splitlines():
        m = re.match(columns + r"\s+PROGRAM TOTALS", line)
        if m:
            tot = sum(int(v.replace(",", "")) for v in m.groups() if v != ".")
            continue
        m = re.match(columns + r"\s+(\S+):(\S+)", line)
        if m:
            name = m.group(len(shown) + 2).split(" ")[0]
            if name == "_PyObject_MakeTpCall" and m.group(len(shown) + 1).endswith("ceval.c"):
                name = "eval loop (ceval.c, bytecodes)"  # the inlined interpreter body carries this name
            per[name] = per.get(name, 0) + sum(int(v.replace(",", "")) for v in m.groups()[:len(shown)] if v != ".")
    return tot, per


def functions(path: Path) -> tuple[int, dict[str, int]]:
    """(total, self instructions per C function) of one callgrind dump."""
    return _annotate(path, ("Ir",))


def cold_by_function(path: Path) -> dict[str, int]:
    """Last-level misses (``COLD_EVENTS`` summed) per C function of one dump made with ``cache=True``."""
    return _annotate(path, COLD_EVENTS)[1]


def events(path: Path) -> dict[str, int]:
    """Event name -> total of one callgrind dump (its ``events:`` and ``totals:`` lines)."""
    names: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith("totals:"):
            return dict(zip(names, (int(v) for v in line.split()[1:])))
    raise RuntimeError(f"no totals in callgrind dump {path}")


def dumps(code: str, cwd: Path, out: Path, env: dict[str, str] | None = None, cache: bool = False
          ) -> dict[str, tuple[int, dict[str, int], dict[str, Any]]]:
    """Run ``code`` with instrumentation and collection off at start; per dump it triggered by
    ``kv_dump(what)``: ``what -> (total, self Ir per C function, event totals)`` (with ``cache``, the event
    totals carry the simulated cache misses, and ``by_function`` the last-level misses per C function). ``out``: the dump files' prefix (its directory must be private
    to this run)."""
    _run(code, cwd, env, str(out), toggled=True, cache=cache)
    result: dict[str, tuple[int, dict[str, int], dict[str, Any]]] = {}
    for dump in sorted(out.parent.glob(f"{out.name}.*")):
        head = dump.read_text(errors="replace")[:4000]
        m = re.search(r"^desc: Trigger: Client Request: (\w+)", head, re.M)
        if m is not None:
            result[m.group(1)] = (*functions(dump), {**events(dump), **({"by_function": cold_by_function(dump)} if cache else {})})
    return result
