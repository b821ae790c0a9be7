"""Settings: every ``OTEL_KVTRACE_*`` variable otel-kvtrace reads, plus the standard OTel ones it honours.

Resolution order for each setting: explicit argument, then environment variable, then the default
below. A bad value is logged (naming the variable) and the default is used: a typo in an environment
variable must never take down the host process.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger("otel_kvtrace")

OTEL_KVTRACE_ENABLED = "OTEL_KVTRACE_ENABLED"
"""``1`` (or ``true``/``yes``/``on``) turns tracing on in every vLLM process through the
``vllm.general_plugins`` entry point. Default: off (nothing patched, no thread, nothing allocated)."""

OTEL_KVTRACE_NPU_TIMING = "OTEL_KVTRACE_NPU_TIMING"
"""``1`` records timing-enabled NPU events next to save and gate events so their device completion
times are exact; otherwise they are exported as bounds. Default: off."""

OTEL_KVTRACE_ASYNC = "OTEL_KVTRACE_ASYNC"
"""``0`` keeps the async-scheduling engine-loop spans off while KV tracing is on. Default: on."""

OTEL_KVTRACE_SCHEDULER = "OTEL_KVTRACE_SCHEDULER"
"""Recv-thread scheduling policy: ``fifo`` (upstream as it is, nothing patched), ``ready_queue`` (a task
whose waits are all met may pass a waiting head, docs/whatif.md "Live scheduler"). Honoured whether
tracing is on or off. Unset = ``fifo`` (the rollback); an unknown name logs one warning and runs ``fifo``."""

OTEL_KVTRACE_QUERIES_DIR = "OTEL_KVTRACE_QUERIES_DIR"
"""Directory of the analysis SQL (``*.sql``). Default: the repository's ``queries/`` in a source checkout,
else the copy shipped inside the package (``otel_kvtrace/sql/``)."""

OTEL_KVTRACE_DATA_DIR = "OTEL_KVTRACE_DATA_DIR"
"""Directory of the embedded file sink. Traces go to ``{dir}/traces/kvtrace-{run_id}-{pid}.jsonl``, the
engine-loop (async-scheduling) traces to ``{dir}/async/kvtrace-async-{run_id}-{pid}.jsonl``.
Default: ``./kvtrace-data``."""

OTEL_KVTRACE_RUN_ID = "OTEL_KVTRACE_RUN_ID"
"""Run id shared by every rank of one deployment (part of the correlation id and the file name).
Default: ``{host}-{pid}-{start_epoch_s}`` of the process."""

OTEL_KVTRACE_EXPORT_INTERVAL_MS = "OTEL_KVTRACE_EXPORT_INTERVAL_MS"
"""How often the exporter thread wakes to drain the recorder, in ms. Default: 200."""

OTEL_KVTRACE_EXPORT_BATCH_SIZE = "OTEL_KVTRACE_EXPORT_BATCH_SIZE"
"""Tasks per export request (one JSON line or one OTLP request; ~12 spans per task). Default: 256,
which keeps an OTLP/gRPC request well under the Collector's default 4 MiB receive limit."""

OTEL_KVTRACE_EXPORT_TIMEOUT_MS = "OTEL_KVTRACE_EXPORT_TIMEOUT_MS"
"""Default time ``force_flush`` and ``shutdown`` may take, in ms (the drain at process exit has its own,
shorter deadline: ``OTEL_KVTRACE_EXIT_DRAIN_MS``). Default: 10000."""

OTEL_KVTRACE_EXIT_DRAIN_MS = "OTEL_KVTRACE_EXIT_DRAIN_MS"
"""How long the drain at process exit (interpreter exit, or a multiprocessing child's ``os._exit``) may
take, in ms, all network waits included (exporter thread, agent, sink, sender): a dying serving process
must not wait out the export timeout on a slow endpoint. With an OTLP spool, what the recorder still
holds is first written to it whatever the deadline (local disk, bounded by the spool cap), then
delivered until the deadline; what is not delivered stays in the spool, whose resend command is logged.
With no spool (``OTEL_KVTRACE_SPOOL_MAX_MB=0``) or a stuck file sink, what is left is counted as dropped,
so ``delivered + spooled + dropped == recorded`` still holds. ``0`` delivers nothing at exit (spool
only). Default: 2000."""

OTEL_KVTRACE_DROP_LOG_INTERVAL_S = "OTEL_KVTRACE_DROP_LOG_INTERVAL_S"
"""Minimum seconds between two "records dropped" warnings. Default: 10."""

OTEL_KVTRACE_SPOOL_DIR = "OTEL_KVTRACE_SPOOL_DIR"
"""Directory of the OTLP delivery spool: every batch for an OTLP endpoint is written here before it is
sent and removed once the receiver acknowledged it; each process uses ``{dir}/{run_id}-{pid}/``.
Default: ``{OTEL_KVTRACE_DATA_DIR}/spool``."""

OTEL_KVTRACE_SPOOL_MAX_MB = "OTEL_KVTRACE_SPOOL_MAX_MB"
"""Cap of one process's spool in MiB; when full, the oldest batches are dropped (and counted).
``0`` turns the spool off: batches are sent directly and a failed one is dropped. Default: 512."""

OTEL_KVTRACE_EXPORT_MAX_REQUEST_BYTES = "OTEL_KVTRACE_EXPORT_MAX_REQUEST_BYTES"
"""Largest OTLP request sent, in bytes (serialized, before compression); bigger batches are split by
trace. A receiver that still answers "too large" halves it. Default: 4194304 (gRPC's receive limit)."""

OTEL_KVTRACE_EXPORTER = "OTEL_KVTRACE_EXPORTER"
"""Where spans are built: ``agent`` (a separate exporter process per serving process drains a
shared-memory ring; nothing but a fixed-size binary write per task happens in the serving process) or
``thread`` (the in-process background exporter thread). Default: ``agent``, falling back to ``thread``
with one log line when the agent cannot start."""

OTEL_KVTRACE_AGENT_NICE = "OTEL_KVTRACE_AGENT_NICE"
"""Niceness increment of the exporter agent process (``os.nice``): its span building yields the CPU to
the serving process's threads. ``0`` gives it equal priority (delivery first when CPUs are scarce).
Default: 10."""

OTEL_KVTRACE_AGENT_SCHED = "OTEL_KVTRACE_AGENT_SCHED"
"""CPU scheduling policy of the exporter agent process: ``idle`` (Linux ``SCHED_IDLE``: it runs on a CPU
no other thread wants, a serving thread woken on its CPU preempts it at once, and a CPU running only the
agent counts as idle when the kernel places a woken thread; while its ring is more than half full it runs
as ``normal`` until the backlog is down to an eighth, so a saturated host cannot starve it into dropping
records; falls back to ``normal`` where the policy is unavailable) or ``normal`` (``SCHED_OTHER`` at
``OTEL_KVTRACE_AGENT_NICE``, the behaviour before 2026-12-02). Default: ``idle`` (docs/export.md,
"Priority")."""

OTEL_KVTRACE_AGENT_CPUS = "OTEL_KVTRACE_AGENT_CPUS"
"""CPUs the exporter agent may run on, as a Linux CPU list (``2``, ``0-3,8``; ``sched_setaffinity``),
intersected with the CPUs the serving process may use. For hosts where some CPUs are reserved for
housekeeping; the serving threads are never pinned. Default: unset (the serving process's CPUs)."""

OTEL_KVTRACE_PROBES = "OTEL_KVTRACE_PROBES"
"""How the GVA recv thread's ``_handle_request`` is instrumented: ``compiled`` (upstream's own source
recompiled with the stamps inline, proved equal to upstream's minus the stamps; falls back to the wrappers
with one log line when the source differs) or ``wrappers`` (one wrapper or proxy per stage). Default:
``compiled`` (docs/instrumentation.md, "Compiled probes")."""

OTEL_KVTRACE_RING_COMMIT = "OTEL_KVTRACE_RING_COMMIT"
"""How a ring slot is proved complete (docs/export.md, "Commit modes"): ``crc`` (a crc32 over the slot,
safe whatever order the CPU makes stores visible in), ``order`` (no crc: the commit word, stored last,
publishes the slot; right only under total store order, i.e. native x86-64) or ``auto`` (``order`` when
``platform.machine()`` is x86-64, else ``crc``). Set ``crc`` under x86 emulation on a weakly ordered host.
The producer chooses; the agent (same host) obeys what the ring header says. Default: ``auto``."""

OTEL_KVTRACE_RING_PACK = "OTEL_KVTRACE_RING_PACK"
"""Who packs a task into its ring slot (docs/export.md, "Native task packer"): ``auto`` (the C extension
``otel_kvtrace.record._ringpack`` when it was built, else Python), ``python`` (the pure-Python reference
path, forced) or ``native`` (as ``auto``). Same bytes either way. Default: ``auto``."""

DEFAULT_AGENT_NICE = 10
AGENT_SCHED_IDLE = "idle"
AGENT_SCHED_NORMAL = "normal"
DEFAULT_AGENT_SCHED = AGENT_SCHED_IDLE
EXPORTER_AGENT = "agent"
EXPORTER_THREAD = "thread"

DEFAULT_DATA_DIR = "./kvtrace-data"
DEFAULT_EXPORT_INTERVAL_MS = 200
DEFAULT_EXPORT_BATCH_SIZE = 256
DEFAULT_EXPORT_TIMEOUT_MS = 10_000
DEFAULT_EXIT_DRAIN_MS = 2_000
DEFAULT_DROP_LOG_INTERVAL_S = 10.0
DEFAULT_SPOOL_SUBDIR = "spool"
DEFAULT_SPOOL_MAX_MB = 512
DEFAULT_EXPORT_MAX_REQUEST_BYTES = 4 * 2**20

# Default output folders of the commands (fixed paths under DEFAULT_DATA_DIR, not read from the env).
DEFAULT_TRACES_DIR = Path(DEFAULT_DATA_DIR) / "traces"
"""``kvtrace collect --out``: where the receiver writes (the embedded sink writes ``{data dir}/traces``)."""
DEFAULT_ASYNC_DIR = Path(DEFAULT_DATA_DIR) / "async"
"""``kvtrace async replica --out`` and the async tracer's default folder."""
DEFAULT_SWEEP_DIR = Path(DEFAULT_DATA_DIR) / "sweep"
"""``kvtrace sweep --out``: finished cells and the report."""
DEFAULT_CACHE_DIR = Path(".kvtrace-cache")
"""``kvtrace report/export --cache-dir``: Parquet cache of parsed traces."""

# Standard OpenTelemetry variables the exporter honours.
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP_PROTOBUF = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP_PROTOBUF)
DEFAULT_PROTOCOL = PROTOCOL_HTTP_PROTOBUF
"""The OTel spec default; also the safer choice for forking servers (gRPC channels are not fork-safe)."""

_PROCESS_START_S = int(time.time())


def env_int(name: str, default: int, *, minimum: int = 1, environ: Mapping[str, str] | None = None) -> int:
    """Integer setting from the environment; logs and returns ``default`` when unset-invalid."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        logger.warning("otel-kvtrace: %s=%r is not an integer; using %d", name, raw, default)
        return default
    if value < minimum:
        logger.warning("otel-kvtrace: %s=%d must be >= %d; using %d", name, value, minimum, default)
        return default
    return value


def env_float(name: str, default: float, *, environ: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        logger.warning("otel-kvtrace: %s=%r is not a number; using %s", name, raw, default)
        return default
    if value < 0:
        logger.warning("otel-kvtrace: %s=%s must be >= 0; using %s", name, value, default)
        return default
    return value


def exit_drain_s(environ: Mapping[str, str] | None = None) -> float:
    """``OTEL_KVTRACE_EXIT_DRAIN_MS`` in seconds: the deadline of the drain at process exit."""
    return env_int(OTEL_KVTRACE_EXIT_DRAIN_MS, DEFAULT_EXIT_DRAIN_MS, minimum=0, environ=environ) / 1000


def sdk_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SDK_DISABLED=true`` (case-insensitive), as the SDK reads it."""
    raw = (os.environ if environ is None else environ).get(OTEL_SDK_DISABLED, "").strip().lower()
    if raw and raw not in ("true", "false"):
        logger.warning("otel-kvtrace: %s=%r is not 'true' or 'false'; using false", OTEL_SDK_DISABLED, raw)
    return raw == "true"


def otlp_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """The traces endpoint from ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
    env = os.environ if environ is None else environ
    for name in (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT):
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def otlp_protocol(environ: Mapping[str, str] | None = None) -> str:
    """``grpc`` or ``http/protobuf`` from the OTLP protocol variables (traces-specific first)."""
    env = os.environ if environ is None else environ
    for name in (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL):
        value = env.get(name, "").strip().lower()
        if not value:
            continue
        if value in PROTOCOLS:
            return value
        supported = " or ".join(PROTOCOLS)
        logger.warning(
            "otel-kvtrace: %s=%r is not supported (use %s); using %s", name, value, supported, DEFAULT_PROTOCOL
        )
        return DEFAULT_PROTOCOL
    return DEFAULT_PROTOCOL


def data_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(OTEL_KVTRACE_DATA_DIR, "").strip() or DEFAULT_DATA_DIR


def tracing_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``OTEL_KVTRACE_ENABLED`` is a true value (``1``, ``true``, ``yes``, ``on``)."""
    env = os.environ if environ is None else environ
    return env.get(OTEL_KVTRACE_ENABLED, "").strip().lower() in ("1", "true", "yes", "on")


def run_id(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_KVTRACE_RUN_ID`` or ``{host}-{pid}-{start_epoch_s}`` (see docs/schema.md)."""
    env = os.environ if environ is None else environ
    return env.get(OTEL_KVTRACE_RUN_ID, "").strip() or f"{socket.gethostname()}-{os.getpid()}-{_PROCESS_START_S}"


def spool_dir(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_KVTRACE_SPOOL_DIR`` or ``{data_dir}/spool``: the root of every process's delivery spool."""
    env = os.environ if environ is None else environ
    return env.get(OTEL_KVTRACE_SPOOL_DIR, "").strip() or os.path.join(data_dir(env), DEFAULT_SPOOL_SUBDIR)


def probes_mode(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_KVTRACE_PROBES``: ``compiled`` (default) or ``wrappers``; anything else warns, ``compiled``."""
    env = os.environ if environ is None else environ
    value = env.get(OTEL_KVTRACE_PROBES, "").strip().lower() or "compiled"
    if value not in ("compiled", "wrappers"):
        logger.warning("otel-kvtrace: %s=%r is not supported (use compiled or wrappers); using compiled",
                       OTEL_KVTRACE_PROBES, value)
        return "compiled"
    return value


def ring_commit(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_KVTRACE_RING_COMMIT``: ``auto`` (default), ``crc`` or ``order``; anything else warns, ``auto``."""
    env = os.environ if environ is None else environ
    value = env.get(OTEL_KVTRACE_RING_COMMIT, "").strip().lower() or "auto"
    if value not in ("auto", "crc", "order"):
        logger.warning("otel-kvtrace: %s=%r is not supported (use auto, crc or order); using auto",
                       OTEL_KVTRACE_RING_COMMIT, value)
        return "auto"
    return value


def exporter_mode() -> str:
    """``OTEL_KVTRACE_EXPORTER``: ``agent`` (default) or ``thread``; anything else warns and uses ``agent``."""
    value = os.environ.get(OTEL_KVTRACE_EXPORTER, "").strip().lower() or EXPORTER_AGENT
    if value not in (EXPORTER_AGENT, EXPORTER_THREAD):
        logger.warning("otel-kvtrace: %s=%r is not supported (use agent or thread); using agent",
                       OTEL_KVTRACE_EXPORTER, value)
        return EXPORTER_AGENT
    return value


def agent_sched(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_KVTRACE_AGENT_SCHED``: ``idle`` (default) or ``normal``; anything else warns, ``idle``."""
    env = os.environ if environ is None else environ
    value = env.get(OTEL_KVTRACE_AGENT_SCHED, "").strip().lower() or DEFAULT_AGENT_SCHED
    if value not in (AGENT_SCHED_IDLE, AGENT_SCHED_NORMAL):
        logger.warning("otel-kvtrace: %s=%r is not supported (use idle or normal); using %s",
                       OTEL_KVTRACE_AGENT_SCHED, value, DEFAULT_AGENT_SCHED)
        return DEFAULT_AGENT_SCHED
    return value


def agent_cpus(environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """``OTEL_KVTRACE_AGENT_CPUS`` as sorted CPU numbers; ``None`` when unset or not a CPU list (one warning)."""
    env = os.environ if environ is None else environ
    raw = env.get(OTEL_KVTRACE_AGENT_CPUS, "").strip()
    if not raw:
        return None
    cpus: set[int] = set()
    try:
        for part in raw.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        logger.warning("otel-kvtrace: %s=%r is not a CPU list (e.g. 2 or 0-3,8); the agent runs on every CPU "
                       "the serving process may use", OTEL_KVTRACE_AGENT_CPUS, raw)
        return None
    return tuple(sorted(cpus))
