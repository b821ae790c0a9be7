"""A serving-like process for the exit-drain tests: records tasks for an OTLP endpoint, then dies.

``python exit_drain_child.py ENDPOINT PROTOCOL TASKS HOW``; ``HOW`` is ``exit`` (this process returns
from main: interpreter exit, atexit), ``exit-now`` (the same, with every task still in the recorder: the
exporter never ran before the exit) or ``mp`` (the recording runs in a forked multiprocessing child,
which leaves through ``os._exit``; this process waits for it). ``exiting <monotonic>`` is printed when
the dying starts, ``exited <monotonic>`` by an exit hook that runs after the exporter's drain; the
exporter's summary and the spool's resend command are logged to stderr. Settings come from the
``OTEL_KVTRACE_*`` environment the test sets.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import sys
import time
from multiprocessing import util as mp_util

from export_records import fill_record

from otel_kvtrace.export import create_exporter
from otel_kvtrace.record.recorder import Recorder

RESOURCE = {"kvtrace.source": "replica", "kvtrace.run_id": "exit-drain"}


def _exited() -> None:
    print(f"exited {time.monotonic()}", flush=True)


def record_and_die(endpoint: str, protocol: str, tasks: int, how: str) -> None:
    if how == "mp":  # after the exporter's finalizer (priority 10)
        mp_util.Finalize(None, _exited, exitpriority=1)
    else:  # registered before the exporter's hook: runs after it
        atexit.register(_exited)
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE, endpoint=endpoint, protocol=protocol)
    exporter.interval_s = 0.05 if how != "exit-now" else 3600.0
    for i in range(tasks):
        rec = recorder.new_record()
        fill_record(rec, seq=i, step=i // 8, layer_id=i % 8, t0=recorder.clock())
        recorder.submit(rec)
    if how != "exit-now":
        time.sleep(0.3)  # the exporter (or its sender) is now inside a request the endpoint never answers
    print(f"exiting {time.monotonic()}", flush=True)


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    endpoint, protocol, tasks, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if how != "mp":
        record_and_die(endpoint, protocol, tasks, how)
        return 0
    child = mp.get_context("fork").Process(target=record_and_die, args=(endpoint, protocol, tasks, how))
    child.start()
    child.join()
    return child.exitcode or 0


if __name__ == "__main__":
    sys.exit(main())
