"""``python -m tests.asynccheck.engine_process fork|spawn OUT [blocking]``: vLLM's engine-core process layout.

The parent does what the vLLM plugin does in the front-end process (``install_from_env``), then starts
the engine core as a multiprocessing child with the given start method, as vLLM does (``fork`` unless
CUDA is initialised or spawn is forced). A spawned child re-imports everything, so it installs again,
as ``load_general_plugins()`` at the start of ``EngineCore.__init__`` does. The child runs the real
vLLM engine loop (``vllm_engine``; ``blocking``: a launch that synchronizes the device) and leaves through
multiprocessing's ``os._exit``. Prints the child's pid.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

from otel_kvtrace.asynccheck.instrument import install_from_env

from . import vllm_engine as ve
from .vllm_src import vllm_modules

VERSION = "0.33.0"
STEPS = 40


def engine_core(out: str, spawned: bool, blocking: bool) -> None:
    if spawned:
        with vllm_modules(VERSION, ve.setup_torch) as mods:
            assert install_from_env(Path(out)) is not None
            _run(mods, out, blocking)
    else:
        _run(PARENT_MODS, out, blocking)


def _run(mods: object, out: str, blocking: bool) -> None:
    """The engine loop; its device truth (forward intervals, synchronize wake-up lags) to ``OUT/truth.json``."""
    import json

    timing = ve.Timing(blocking_launch=blocking)
    ve.DEVICE.intervals.clear()
    ve.DEVICE.wake_lags.clear()
    ex = ve.make_executor(mods, "uniproc", timing, True)
    ve.run_engine(ve.make_engine(mods, async_loop=True, executor=ex, scheduler=ve.FakeScheduler(STEPS, timing)))
    Path(out, "truth.json").write_text(json.dumps({"device": ex.truth(), "wake_lags": list(ve.DEVICE.wake_lags)}))


PARENT_MODS: object = None

if __name__ == "__main__":
    method, out = sys.argv[1], sys.argv[2]
    blocking = sys.argv[3:] == ["blocking"]
    Path(out).mkdir(parents=True, exist_ok=True)
    with vllm_modules(VERSION, ve.setup_torch) as mods:
        PARENT_MODS = mods
        assert install_from_env(Path(out)) is not None  # the plugin in the front-end process
        proc = mp.get_context(method).Process(target=engine_core, args=(out, method == "spawn", blocking))
        proc.start()
        proc.join(60)
        print(proc.pid, proc.exitcode)
