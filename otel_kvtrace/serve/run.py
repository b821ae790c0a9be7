"""Process lifecycle of ``kvtrace serve-replica``: tracing on, engine up, HTTP up, clean stop on a signal.

SIGTERM and SIGINT stop the HTTP site, then the engine (after its current step) and its transfer threads,
then drain the tracing session, so every recorded task is exported before the process exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_kvtrace.export.sinks import safe_run_id
from otel_kvtrace.config import DEFAULT_DATA_DIR
from otel_kvtrace.replica.config import ReplicaConfig


@dataclass(slots=True)
class ServeOptions:
    """What ``serve_replica`` serves and where it writes."""

    config: ReplicaConfig = field(default_factory=ReplicaConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "kvtrace-replica"
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    max_num_seqs: int = 8
    block_tokens: int = 128
    trace: bool = True
    run_id: str | None = None
    resources: bool = True
    """Per-step resource series (``otel_kvtrace.resources``) to DATA_DIR/metrics and OTel metrics."""


def serve_replica(options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (0 = clean stop)."""
    return asyncio.run(_serve(options))


async def _serve(o: ServeOptions) -> int:
    from aiohttp import web

    from otel_kvtrace.serve.engine import ReplicaEngine
    from otel_kvtrace.serve.server import RequestLog, build_app

    # the pid too: two servers started in the same second (one per card, or a test) must not share a run id
    run_id = o.run_id or f"serve-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
    session = _start_tracing(o, run_id) if o.trace else None
    engine = ReplicaEngine(o.config, max_num_seqs=o.max_num_seqs, block_tokens=o.block_tokens)
    log = RequestLog(o.data_dir / "requests" / f"requests-{safe_run_id(run_id)}.jsonl")
    sampler = None
    if o.resources:
        from otel_kvtrace.resources.sampler import ResourceSampler

        sampler = ResourceSampler(engine.worker, o.data_dir, run_id, attributes=o.config.resource_attributes())
        engine.on_step = sampler.notify_step
    runner = None
    try:
        engine.start()
        if sampler is not None:
            sampler.start()
        runner = web.AppRunner(build_app(engine, o.model, log), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, o.host, o.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"kvtrace serve-replica: {o.config.label}; listening on http://{o.host}:{port} (run {run_id})",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        clean = engine.stop()
        if sampler is not None:
            sampler.stop()
        log.close()
        if session is not None:
            stats = session.shutdown()
            print(f"kvtrace serve-replica: stopped (engine clean={clean}, {engine.stats.steps} steps, "
                  f"{stats.submitted} tasks exported, {stats.dropped} dropped)", file=sys.stderr, flush=True)


def _start_tracing(o: ServeOptions, run_id: str) -> Any:
    """The server's one call into ``otel_kvtrace.api`` (timing events on: the fake NPU supports them)."""
    from otel_kvtrace.api import start_tracing
    from otel_kvtrace.replica.threaded import replica_targets

    resource = {**o.config.resource_attributes(), "kvtrace.serve.model": o.model,
                "kvtrace.serve.max_num_seqs": o.max_num_seqs}
    return start_tracing(replica_targets(o.config.behaviour), resource=resource, out_dir=o.data_dir,
                         run_id=run_id, npu_timing=True)
