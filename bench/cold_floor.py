"""The floor of a raw-stamp recording: cache lines touched cold per call, on the REAL vLLM-Ascend recv thread.

``bench/recording_instructions.py --cold`` counts the lines the recording touches cold per call (+1,754 per
layer with the ring: docs/export.md, "The cold footprint"). This bench counts, the same way (callgrind's cache
simulation, ``_callgrind.CACHE``, caches emptied before every counted call), what the design named there
would touch: per stamp one C call that appends ``(id, clock)`` as two int64 to a preallocated per-thread
buffer, and per task one copy of the used buffer into a preallocated region (a ring slot's stand-in). The
C type is built here with ``gcc`` (``TAPE_C``; a measuring device, not a recorder: no record, no rules, no
agent). Variants, each against upstream untouched:

- ``frame``: a wrapper around ``add_request`` and ``_handle_request`` that records nothing (what one Python
  frame costs; compiled probes have none);
- ``tape``: the wrapper with ``--stamps`` stamps around ``_handle_request`` (half before, half after
  upstream's call) and the copy, and one stamp in ``add_request``.

So ``tape`` minus ``frame`` is what raw stamps cost, and ``tape`` is a floor for a recording built that way
(the rules' reads of upstream objects, the gate's state and the events' set times, come on top).

Usage::

    .venv/bin/python bench/cold_floor.py              # 100 calls per side, 24 stamps per recv task
    .venv/bin/python bench/cold_floor.py --stamps 32
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _callgrind  # noqa: E402

TAPE_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
typedef struct { PyObject_HEAD vectorcallfunc vectorcall; int n; size_t at; char *region; int64_t buf[256]; } Tape;
static PyObject *Tape_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kw) {
    Tape *t = (Tape *)self;
    struct timespec ts;
    long id = PyLong_AsLong(args[0]);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (t->n < 254) { t->buf[t->n++] = id; t->buf[t->n++] = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec; }
    Py_RETURN_NONE;
}
static PyObject *Tape_ship(Tape *t, PyObject *unused) {
    size_t len = (size_t)t->n * 8;
    if (t->at + len > (1u << 20)) t->at = 0;
    memcpy(t->region + t->at, t->buf, len);
    t->at += (len + 63) & ~(size_t)63;
    t->n = 0;
    Py_RETURN_NONE;
}
static PyObject *Tape_new(PyTypeObject *type, PyObject *a, PyObject *k) {
    Tape *t = (Tape *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->vectorcall = Tape_call;
    if ((t->region = PyMem_RawCalloc(1, 1u << 20)) == NULL) { Py_DECREF(t); return PyErr_NoMemory(); }
    return (PyObject *)t;
}
static PyMethodDef Tape_methods[] = {{"ship", (PyCFunction)Tape_ship, METH_NOARGS, NULL}, {NULL}};
static PyTypeObject TapeType = {PyVarObject_HEAD_INIT(NULL, 0) .tp_name = "kvtape.Tape",
    .tp_basicsize = sizeof(Tape), .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = Tape_new, .tp_call = PyVectorcall_Call, .tp_vectorcall_offset = offsetof(Tape, vectorcall),
    .tp_methods = Tape_methods};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kvtape", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_kvtape(void) {
    if (PyType_Ready(&TapeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (m == NULL) return NULL;
    Py_INCREF(&TapeType);
    PyModule_AddObject(m, "Tape", (PyObject *)&TapeType);
    return m;
}
"""
VARIANTS = ("untraced", "frame", "tape")


def build_tape(tmp: Path) -> Path:
    """``TAPE_C`` built as the module ``kvtape`` in ``tmp`` (the directory to put on ``sys.path``)."""
    src = tmp / "kvtape.c"
    src.write_text(TAPE_C)
    out = tmp / ("kvtape" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"], "-o", str(out),
                    str(src)], check=True)
    return tmp


def wrappers(variant: str, stamps: int, original_handle: Any, original_add: Any, tape: Any) -> tuple[Any, Any]:
    """``(_handle_request, add_request)`` of ``variant``, generated (no loop: each stamp is its own call)."""
    body = "".join(f"        tape({i})\n" for i in range(stamps // 2))
    after = "".join(f"        tape({i})\n" for i in range(stamps // 2, stamps))
    if variant == "frame":
        body = after = ""
    ship = "        tape.ship()\n" if variant == "tape" else ""
    add_stamp = "        tape(255)\n" if variant == "tape" else ""
    src = (f"def make(original_handle, original_add, tape):\n"
           f"    def _handle_request(self, item):\n{body}        result = original_handle(self, item)\n"
           f"{after}{ship}        return result\n"
           f"    def add_request(self, item):\n{add_stamp}        return original_add(self, item)\n"
           f"    return _handle_request, add_request\n")
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<cold_floor {variant}>", "exec"), namespace)  # noqa: S102 - text generated above
    return namespace["make"](original_handle, original_add, tape)


def child(variant: str, tasks: int, lib: str, tape_dir: str, stamps: int) -> None:
    """Runs under valgrind: ``tasks`` counted ``add_request`` and ``_handle_request`` calls, each cold."""
    import ctypes
    import gc

    import recording_instructions

    cg = ctypes.CDLL(lib)
    bench = recording_instructions.load_upstream_overhead()
    evict = recording_instructions.evictor(bench, cg, True)
    h = bench._load_harness()
    num_layers = 8
    with h.upstream_session(h.upstream_source_dir()) as up:
        env = up.gva_thread(num_layers, h.FakeBackend(), start=False)
        thread = env.thread
        if variant != "untraced":
            sys.path.insert(0, tape_dir)
            import kvtape  # type: ignore[import-not-found]

            cls = type(thread)
            cls._handle_request, cls.add_request = wrappers(variant, stamps, cls._handle_request, cls.add_request,
                                                             kvtape.Tape())
        gc.collect()
        gc.disable()
        recording_instructions.count_calls(bench, up, env, num_layers, 16, cg, evict, tasks, 100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=100, help="counted calls per side (default 100)")
    parser.add_argument("--stamps", type=int, default=24, help="stamps per recv task (default 24)")
    args = parser.parse_args()
    if args.tasks < 1 or not 0 <= args.stamps <= 120:
        parser.error("--tasks must be >= 1 and --stamps within 0..120 (the tape holds 127 stamps)")
    rows: dict[str, dict[str, tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtrace-floor-") as tmp_name:
        tmp = Path(tmp_name)
        lib = _callgrind.build_helper(tmp)
        tape_dir = build_tape(tmp)
        for variant in VARIANTS:
            code = (f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); sys.path.insert(0, {str(HERE)!r}); "
                    f"import cold_floor as c; c.child({variant!r}, {args.tasks}, {str(lib)!r}, {str(tape_dir)!r}, "
                    f"{args.stamps})")
            dumps = _callgrind.dumps(code, HERE.parent, tmp / f"cg.{variant}", cache=True)
            rows[variant] = {side: (total / args.tasks,
                                    sum(ev[k] for k in _callgrind.COLD_EVENTS) / args.tasks)
                             for side, (total, _per, ev) in dumps.items()}
            print(f"  counted {variant}", file=sys.stderr, flush=True)
    print(f"raw-stamp floor, per call: instructions and cache lines touched cold (simulated "
          f"{'/'.join(_callgrind.CACHE[1:])}, caches emptied before each call); {args.stamps} stamps per recv task")
    print(f"{'variant':10} {'add_request Ir':>15} {'lines':>7} {'added':>7} {'_handle_request Ir':>19} {'lines':>7} "
          f"{'added':>7} {'lines per layer':>16}")
    base = rows["untraced"]
    for variant in VARIANTS:
        r = rows[variant]
        added = {side: r[side][1] - base[side][1] for side in ("forward", "recv")}
        print(f"{variant:10} {r['forward'][0]:15.0f} {r['forward'][1]:7.0f} {added['forward']:+7.1f} "
              f"{r['recv'][0]:19.0f} {r['recv'][1]:7.0f} {added['recv']:+7.1f} {sum(added.values()):+16.1f}")


if __name__ == "__main__":
    main()
