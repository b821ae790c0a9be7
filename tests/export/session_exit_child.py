"""A traced replica serving process for the session exit tests (run as a script, never imported by pytest).

    python session_exit_child.py drain ENDPOINT   # steps, then returns from main (interpreter exit)
    python session_exit_child.py mp OUT_DIR       # tracing on, then a forked multiprocessing child
                                                  # records held loads and leaves through os._exit

``drain`` prints ``exiting <monotonic>`` right before the interpreter's exit and ``exited <monotonic>``
from the last atexit hook (registered before tracing started, so it runs after the session's and the
exporter's): the drain's own duration, whatever the parent's scheduling. ``mp`` prints the child's
``step 0 <submitted>``. The exporter's summary is logged to stderr.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import sys
import time

from agent_child import _no_wait_step

from otel_kvtrace.api import start_tracing
from otel_kvtrace.demo import scenario_configs
from otel_kvtrace.replica.threaded import replica_targets, run_threaded


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def drain(endpoint: str) -> None:
    atexit.register(lambda: _say(f"exited {time.monotonic()}"))
    ((_, cfg),) = scenario_configs("hol", steps=3)
    start_tracing(replica_targets(cfg.behaviour), resource=cfg.resource_attributes(), endpoint=endpoint,
                  protocol="http/protobuf", run_id="session-exit")
    run_threaded(cfg)
    time.sleep(0.3)  # the exporter (or its sender) is now inside a request the endpoint never answers
    _say(f"exiting {time.monotonic()}")


def held_then_exit(cfg, session) -> None:  # noqa: ANN001 - the forked child's body
    _no_wait_step(cfg, session)  # returns: Process._bootstrap runs the finalizers, then os._exit


def main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    if sys.argv[1] == "drain":
        drain(sys.argv[2])
        return
    ((_, cfg),) = scenario_configs("hol", steps=1)
    session = start_tracing(replica_targets(cfg.behaviour), resource=cfg.resource_attributes(), out_dir=sys.argv[2],
                            run_id="session-mp")
    child = mp.get_context("fork").Process(target=held_then_exit, args=(cfg, session))
    child.start()
    child.join()
    session.shutdown()


if __name__ == "__main__":
    main()
