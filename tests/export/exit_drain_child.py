"""A serving-like process for the exit-drain tests: records tasks for an OTLP endpoint, then dies.

``python exit_drain_child.py ENDPOINT PROTOCOL TASKS HOW``; ``HOW`` is ``exit`` (this process returns
from main: interpreter exit, atexit) or ``mp`` (the recording runs in a forked multiprocessing child,
which leaves through ``os._exit``; this process waits for it). ``exiting`` is printed when the dying
starts; the exporter's summary and the spool's resend command are logged to stderr. Settings come from
the ``OTEL_KVTRACE_*`` environment the test sets.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import time

from export_records import fill_record

from otel_kvtrace.export import create_exporter
from otel_kvtrace.record.recorder import Recorder

RESOURCE = {"kvtrace.source": "replica", "kvtrace.run_id": "exit-drain"}


def record_and_die(endpoint: str, protocol: str, tasks: int) -> None:
    recorder = Recorder()
    exporter = create_exporter(recorder, RESOURCE, endpoint=endpoint, protocol=protocol)
    exporter.interval_s = 0.05
    for i in range(tasks):
        rec = recorder.new_record()
        fill_record(rec, seq=i, step=i // 8, layer_id=i % 8, t0=recorder.clock())
        recorder.submit(rec)
    time.sleep(0.3)  # the exporter (or its sender) is now inside a request the endpoint never answers
    print("exiting", flush=True)


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    endpoint, protocol, tasks, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if how == "exit":
        record_and_die(endpoint, protocol, tasks)
        return 0
    child = mp.get_context("fork").Process(target=record_and_die, args=(endpoint, protocol, tasks))
    child.start()
    child.join()
    return child.exitcode or 0


if __name__ == "__main__":
    sys.exit(main())
