"""Engine-loop instrumentation for vLLM V1 / vLLM-Ascend: one patch table, both directions.

Wrap points (``docs/async_check.md``, research §4.5): ``EngineCore.step`` / ``step_with_batch_queue``
(which loop ran the step), ``Scheduler.schedule`` (``batch_schedule``), ``Executor.execute_model``
(``model_execute``: host dispatch; returns a Future in async mode) and ``Executor.sample_tokens`` (the
sampling launch, part of ``model_execute``), the async output classes' ``__init__`` (hands the
copy-ready event to the ``ready.ReadyWatcher``) and ``get_output`` (``execute_done``; which thread ran
it decides its precision), ``Scheduler.update_from_output`` (``update_output``) and
``ParallelConfig.has_unfinished_dp`` / ``sync_dp_state`` (the DP engines' all-reduce: ``communication``). vLLM-Ascend's scheduler subclasses that override
``schedule()`` are listed too; a re-entrancy flag keeps ``super().schedule()`` chains to one span.

Nothing here imports vLLM or torch at module import; ``install_from_env`` does nothing unless
``OTEL_KVTRACE_ENABLED=1`` and vLLM is importable. Wrappers only stamp ``perf_counter_ns`` into the
bounded ``StampBuffer`` and call the original in ``try/finally``: no OTel objects, no formatting, no
locks, no device synchronisation; the original's return value and exceptions pass through unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from threading import get_ident
from typing import Any

import wrapt

from otel_kvtrace import config
from otel_kvtrace.asynccheck.export import AsyncTracer, async_trace_path, default_resource
from otel_kvtrace.asynccheck.ready import ReadyWatcher
from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind
from otel_kvtrace.export.worker import create_sink
from otel_kvtrace.instrument.patches import InstalledPatch, patch_attr
from otel_kvtrace.instrument.patches import uninstall as uninstall_patches
from otel_kvtrace.instrument.points import PatchPoint

logger = logging.getLogger("otel_kvtrace")

OwnerSpec = str | type
"""``"module:Class"`` (imported lazily, skipped when missing) or the class itself."""

VLLM_OWNERS: Mapping[str, Sequence[OwnerSpec]] = {
    "engine": ("vllm.v1.engine.core:EngineCore",),
    "scheduler": (
        "vllm.v1.core.sched.scheduler:Scheduler",
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
        "vllm_ascend.core.recompute_scheduler:RecomputeScheduler",
        "vllm_ascend.core.dyntra_lb_scheduler:DyntraLBScheduler",
        "vllm_ascend.core.scheduler_profiling_chunk:ProfilingChunkScheduler",
        "vllm_ascend.core.batch_job_aware_scheduler:BatchJobAwareScheduler",
    ),
    "executor": (
        "vllm.v1.executor.abstract:Executor",
        "vllm.v1.executor.uniproc_executor:UniProcExecutor",
        "vllm.v1.executor.multiproc_executor:MultiprocExecutor",
    ),
    "output": (
        "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput",
        "vllm.v1.worker.gpu_model_runner:AsyncGPUPoolingModelRunnerOutput",
        "vllm.v1.worker.gpu.async_utils:AsyncOutput",  # Model Runner V2
        "vllm.v1.worker.gpu.async_utils:AsyncPoolingOutput",
    ),
    # the worker that launches onto the device (in a MultiprocExecutor worker process: a launch that
    # blocks there does not block the engine's own launch)
    "worker": (
        "vllm.v1.worker.gpu_worker:Worker",
        "vllm_ascend.worker.worker:NPUWorker",
        "vllm_ascend.worker.worker_v1:NPUWorker",
    ),
    # DP engines all-reduce "unfinished requests" on the engine loop: ``has_unfinished_dp`` (wave
    # barriers) and ``sync_dp_state`` (0.23: staticmethod every 32 steps; 0.33: method every
    # ``dp_sync_interval`` steps)
    "dp_sync": ("vllm.config.parallel:ParallelConfig", "vllm.config:ParallelConfig"),
}


class LoopState:
    """Per-process flags the wrappers share; written only by the engine thread (no lock needed)."""

    __slots__ = (
        "buffer", "batch_queue", "in_schedule", "in_launch", "in_sample", "in_update", "enabled", "adopt", "adopted", "step",
        "engine_thread", "watcher",
    )

    def __init__(self, buffer: StampBuffer) -> None:
        self.buffer = buffer
        self.engine_thread = 0  # ident of the thread running EngineCore.step*
        self.watcher = ReadyWatcher(buffer)
        self.batch_queue = 0
        self.in_schedule = False
        self.in_launch = False
        self.in_sample = False
        self.in_update = False
        self.enabled = True
        self.adopt: Callable[[Any], None] = lambda engine: None
        self.adopted = False
        self.step = -1  # steps scheduled so far - 1: the step a communication belongs to


Wrapper = Callable[[Any, Any, tuple, dict], Any]


def _step_wrapper(batch_queue: int) -> Callable[[LoopState], Wrapper]:
    """Note which loop runs; on the first step, patch the engine's concrete scheduler/executor classes.

    vLLM loads general plugins inside ``EngineCore.__init__``, so an ``__init__`` hook would miss the
    engine; the first ``step`` is the earliest point where ``engine.scheduler`` is known. vLLM-Ascend
    picks scheduler subclasses by configuration, and one that overrides ``schedule()`` without being in
    the owner table would otherwise go unseen.
    """

    def make(state: LoopState) -> Wrapper:
        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            state.batch_queue = batch_queue
            if not state.adopted:
                state.adopted = True
                state.engine_thread = get_ident()
                try:
                    state.adopt(instance)
                except Exception:  # noqa: BLE001 - instrumentation failures never reach the host
                    logger.exception("otel-kvtrace: could not patch the engine's scheduler/executor classes")
            return wrapped(*args, **kwargs)

        return wrapper

    return make


def _phase_wrapper(flag: str, begin: StampKind, end: StampKind) -> Callable[[LoopState], Wrapper]:
    """Stamp begin/end around the outermost call of a phase (``flag`` guards super() chains)."""

    begin_code, end_code = int(begin), int(end)  # plain ints store faster than IntEnum members

    def make(state: LoopState) -> Wrapper:
        stamp = state.buffer.stamp
        counts_steps = begin == StampKind.SCHED_BEGIN

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if not state.enabled or getattr(state, flag):
                return wrapped(*args, **kwargs)
            setattr(state, flag, True)
            if counts_steps:
                state.step += 1
            stamp(begin_code, state.batch_queue)
            try:
                return wrapped(*args, **kwargs)
            finally:
                stamp(end_code)
                setattr(state, flag, False)

        return wrapper

    return make


def _interval_wrapper(kind: StampKind, tag: Callable[[LoopState], int],
                      poke: bool = False) -> Callable[[LoopState], Wrapper]:
    """One ``kind`` interval per call (``t`` = start, ``a`` = end, ``b`` = ``tag(state)`` at the end);
    ``poke``: the call may have created an async output, query its event once more as it returns
    (``ReadyWatcher.poke``)."""

    def make(state: LoopState) -> Wrapper:
        buffer = state.buffer
        clock = buffer.clock
        code = int(kind)
        watcher = state.watcher

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            start = clock()
            try:
                return wrapped(*args, **kwargs)
            finally:
                if state.enabled:
                    if poke:
                        watcher.poke()
                    buffer.put(code, start, clock(), tag(state))

        return wrapper

    return make


_comm_wrapper = _interval_wrapper(StampKind.COMM, lambda state: max(state.step, 0))
"""A collective on the engine loop (DP step synchronisation): one ``communication`` interval, attributed to
the last scheduled step."""


def _worker_call_wrapper(call: int) -> Callable[[LoopState], Wrapper]:
    """A worker's ``execute_model`` (0) / ``sample_tokens`` (1): one interval, for the worker-side launch."""
    return _interval_wrapper(StampKind.WORKER_CALL, lambda state: call, poke=True)


def _done_wrapper(state: LoopState) -> Wrapper:
    """``get_output`` return; ``a`` = 1 on an output thread (its return is the device-ready time),
    0 on the engine thread (UniProc's lazy ``AsyncOutputFuture.result()``: max(ready, engine asks))."""
    stamp = state.buffer.stamp
    done_code = int(StampKind.DONE)

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if state.enabled:
            stamp(done_code, get_ident() != state.engine_thread)
        return result

    return wrapper


def _output_init_wrapper(state: LoopState) -> Wrapper:
    """After an async output's ``__init__`` recorded its copy-ready event: hand it to the watcher."""
    register = state.watcher.register

    watcher = state.watcher

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if state.enabled and not watcher.failed:
            try:
                register(instance)
            except Exception:  # noqa: BLE001 - a failure turns the watcher off, never the output
                watcher.failed = True
                logger.exception("otel-kvtrace: output-ready watcher disabled")
        return result

    return wrapper


class _Wrapper(wrapt.FunctionWrapper):
    """A wrapt wrapper carrying the package's one idempotence mark (``patches.is_wrapped``).

    wrapt forwards attribute reads to the wrapped function, so the mark is a property of this class:
    under wrapt 2.x a ``FunctionWrapper`` is no ``wrapt.ObjectProxy`` instance, and a check on that let
    the first-step adoption wrap a second time.
    """

    @property
    def __kvtrace_wrapped__(self) -> Any:
        return self.__wrapped__


def _row(id_: str, owner: str, attr: str, what: str, make: Callable[[LoopState], Wrapper]) -> PatchPoint:
    """An engine-loop row of the shared ``points.PatchPoint`` shape: ``role`` is the owner-table key and
    ``wrapper`` the factory taking the ``LoopState``."""
    return PatchPoint(id_, owner, attr, (), False, what, make)


PATCH_POINTS: tuple[PatchPoint, ...] = (
    _row("E1", "engine", "step", "sync engine loop; first step adopts the engine's classes", _step_wrapper(0)),
    _row("E2", "engine", "step_with_batch_queue", "async engine loop (batch queue)", _step_wrapper(1)),
    _row("E3", "scheduler", "schedule", "batch_schedule",
         _phase_wrapper("in_schedule", StampKind.SCHED_BEGIN, StampKind.SCHED_END)),
    _row("E4", "executor", "execute_model", "model_execute: host dispatch",
         _phase_wrapper("in_launch", StampKind.LAUNCH_BEGIN, StampKind.LAUNCH_END)),
    # since vLLM 0.23 execute_model's future resolves to None and sampling is launched by sample_tokens
    _row("E5", "executor", "sample_tokens", "sampling launch (part of model_execute)",
         _phase_wrapper("in_sample", StampKind.SAMPLE_BEGIN, StampKind.SAMPLE_END)),
    _row("E6", "output", "__init__", "copy-ready event to the output-ready watcher", _output_init_wrapper),
    _row("E7", "output", "get_output", "execute_done (its thread decides the precision)", _done_wrapper),
    _row("E8", "scheduler", "update_from_output", "update_output",
         _phase_wrapper("in_update", StampKind.UPDATE_BEGIN, StampKind.UPDATE_END)),
    _row("E9", "dp_sync", "has_unfinished_dp", "DP all-reduce: communication", _comm_wrapper),
    _row("E10", "dp_sync", "sync_dp_state", "DP all-reduce: communication", _comm_wrapper),
    _row("E11", "worker", "execute_model", "worker_launch: the worker process's forward launch",
         _worker_call_wrapper(0)),
    _row("E12", "worker", "sample_tokens", "worker_launch: the worker process's sampling launch",
         _worker_call_wrapper(1)),
)


def _resolve(spec: OwnerSpec) -> type | None:
    if isinstance(spec, type):
        return spec
    module_name, _, qualname = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - a missing optional class just is not patched
        return None
    return obj if isinstance(obj, type) else None


ATTR_DP_RANK = "vllm.dp_rank"
"""Resource attribute: the engine-core process's data-parallel rank (``runs.split_processes`` labels by it)."""


def dp_rank(engine: Any) -> int | None:
    """The DP rank of an engine-core process, or None where vLLM gives none.

    ``ParallelConfig.data_parallel_index``: ``run_engine_core`` sets it to the process's ``dp_rank`` in
    0.23 and 0.33, also for dense models, whose ``data_parallel_rank`` it resets to 0
    (``vllm/v1/engine/core.py``); then ``DPEngineCoreProc.dp_rank``; then ``VLLM_DP_RANK`` when set
    (offline DP launches, ``vllm/envs.py``)."""
    config = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    for value in (getattr(config, "data_parallel_index", None), getattr(engine, "dp_rank", None),
                  os.environ.get("VLLM_DP_RANK")):
        try:
            if value is not None and not isinstance(value, bool) and int(value) >= 0:
                return int(value)
        except (TypeError, ValueError):
            continue
    return None


class EngineLoopInstrumentation:
    """Installs and removes every ``PATCH_POINTS`` wrapper on the classes of an owner table, through the
    package's one patch helper (``instrument.patches.patch_attr`` / ``uninstall``)."""

    def __init__(self, buffer: StampBuffer, owners: Mapping[str, Sequence[OwnerSpec]] = VLLM_OWNERS) -> None:
        self.state = LoopState(buffer)
        self.state.adopt = self._adopt
        self.owners = owners
        self._patches: list[InstalledPatch] = []
        self.on_engine: Callable[[dict[str, Any]], None] | None = None
        """Receives the engine's resource attributes (its DP rank) at the first step: the trace resource."""

    def install(self) -> list[str]:
        """Wrap every patch point whose class defines the attribute; return ``Class.attr`` names."""
        if self._patches:
            return self.names
        for point in PATCH_POINTS:
            for spec in self.owners.get(point.role, ()):
                cls = _resolve(spec)
                if cls is not None:
                    self._wrap(cls, point)
        return self.names

    def _wrap(self, cls: type, point: PatchPoint) -> None:
        if point.member not in vars(cls):
            return  # not defined here: the class that defines it is wrapped (one layer per method)
        wrapper = point.wrapper(self.state)  # type: ignore[operator]
        patch = patch_attr(cls, point.member, lambda current: _Wrapper(current, wrapper))
        if patch is not None:  # None: already wrapped (by this or another instance)
            self._patches.append(patch)

    def _adopt(self, engine: Any) -> None:
        """Patch the classes (and bases) of the scheduler and executor an engine actually uses; hand its DP
        rank, when known, to ``on_engine`` (once, on the first step)."""
        for owner, obj in (("scheduler", getattr(engine, "scheduler", None)),
                           ("executor", getattr(engine, "model_executor", None))):
            if obj is None:
                continue
            for cls in type(obj).__mro__:
                if cls is object:
                    continue
                for point in PATCH_POINTS:
                    if point.role == owner:
                        self._wrap(cls, point)
        rank = dp_rank(engine)
        if rank is not None and self.on_engine is not None:
            self.on_engine({ATTR_DP_RANK: rank})

    def uninstall(self) -> None:
        """Restore every wrapped attribute (the class's own: a staticmethod stays one). Idempotent."""
        self.state.enabled = False
        self.state.watcher.stop()
        uninstall_patches(self._patches)

    @property
    def installed(self) -> list[tuple[type, str]]:
        """``(class, attribute)`` of every wrapper in place, in install order."""
        return [(p.owner, p.attr) for p in self._patches]

    @property
    def names(self) -> list[str]:
        return [f"{cls.__module__}.{cls.__qualname__}.{attr}" for cls, attr in self.installed]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for dist, key in (("vllm", "vllm.version"), ("vllm-ascend", "vllm_ascend.version")):
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            pass
    return out


_ACTIVE: tuple[EngineLoopInstrumentation, AsyncTracer] | None = None


def active() -> bool:
    """True while ``install_from_env`` has engine-loop tracing on in this process."""
    return _ACTIVE is not None


def default_out_dir() -> Path:
    """``{OTEL_KVTRACE_DATA_DIR or ./kvtrace-data}/async``."""
    return Path(config.data_dir()) / "async"


def install_from_env(out_dir: Path | None = None) -> EngineLoopInstrumentation | None:
    """Turn engine-loop tracing on when ``OTEL_KVTRACE_ENABLED=1`` and vLLM is importable.

    Called from the vLLM plugin entry point. Writes ``{out_dir}/kvtrace-async-{run_id}-{pid}.jsonl``
    (``out_dir`` defaults to ``default_out_dir()``; the run id is made file-name safe); a forked child
    writes its own file. ``OTEL_KVTRACE_ASYNC=0`` turns just this part off. Any failure logs and leaves
    vLLM untouched; what is on is logged once.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE[0]
    if not config.tracing_enabled() or os.environ.get(config.OTEL_KVTRACE_ASYNC, "1").strip() == "0":
        return None
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        directory = Path(out_dir) if out_dir is not None else default_out_dir()
        run_id = config.run_id()
        resource = default_resource(run_id=run_id, source="upstream", label="engine-loop", extra=_versions())
        # with an OTLP endpoint configured, the spans go where the KV spans go (the shared sinks)
        sink = create_sink(dict(resource.attributes)) if config.otlp_endpoint() and not config.sdk_disabled() else None
        tracer = AsyncTracer(path=async_trace_path(directory, run_id, os.getpid()), resource=resource,
                             path_for_pid=lambda pid: async_trace_path(directory, run_id, pid), sink=sink)
        inst = EngineLoopInstrumentation(tracer.buffer)
        update = getattr(tracer.sink, "update_resource", None)
        inst.on_engine = update  # the DP rank on the trace resource (lines written after the first step)
        names = inst.install()
        if not names:
            logger.info("otel-kvtrace: engine-loop tracing off: no vLLM engine-loop class found to patch")
            return None
        tracer.start()  # the shared exporter flushes at exit (atexit, and multiprocessing's os._exit)
        _ACTIVE = (inst, tracer)
        where = getattr(sink, "endpoint", None) or "OTLP" if sink is not None else tracer.path.parent
        logger.info("otel-kvtrace: engine-loop tracing on (pid %d): %d methods patched, traces in %s",
                    os.getpid(), len(names), where)
        return inst
    except Exception:  # noqa: BLE001 - instrumentation failures disable tracing, never the host
        logger.exception("otel-kvtrace: engine-loop instrumentation disabled")
        return None


def uninstall_active() -> None:
    """Undo ``install_from_env`` (flush, restore); the next ``install_from_env`` starts afresh."""
    global _ACTIVE
    active, _ACTIVE = _ACTIVE, None
    if active is not None:
        inst, tracer = active
        inst.uninstall()
        tracer.shutdown()
