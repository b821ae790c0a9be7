"""``python -m tests.asynccheck.wrapt_layers``: wrapper layers per patched method on the real vLLM 0.33
classes under whatever wrapt is importable (the test runs it with wrapt 1.x and 2.x). Prints JSON."""

from __future__ import annotations

import contextlib
import json

import wrapt

from otel_kvtrace.asynccheck.instrument import EngineLoopInstrumentation
from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind

from . import vllm_engine as ve
from .test_vllm_conformance import owners
from .vllm_src import vllm_modules


def layers(obj: object) -> int:
    n = 0
    while isinstance(obj, wrapt.FunctionWrapper):
        n += 1
        obj = obj.__wrapped__
    return n


with vllm_modules("0.33.0", ve.setup_torch) as mods:
    buffer = StampBuffer(capacity=4096)
    inst = EngineLoopInstrumentation(buffer, owners(mods))
    inst.install()
    timing = ve.Timing(forward_s=0.001)
    for kind in ("uniproc", "multiproc"):
        ex = ve.make_executor(mods, kind, timing, True)
        engine = ve.make_engine(mods, async_loop=True, executor=ex, scheduler=ve.FakeScheduler(3, timing))
        ve.run_engine(engine)  # the first step adopts the engine's classes (and bases) again
        ex.stop()
    buffer.drain(settle_s=0)
    pc = mods.parallel.ParallelConfig
    with contextlib.suppress(Exception):
        pc.has_unfinished_dp(object(), True)
    comm = sum(s.kind == StampKind.COMM for s in buffer.drain(settle_s=0))
    print(json.dumps({"wrapt": wrapt.__version__, "comm_per_call": comm,
                      "layers": {f"{c.__name__}.{a}": layers(vars(c)[a]) for c, a in inst.installed}}))
    inst.uninstall()
