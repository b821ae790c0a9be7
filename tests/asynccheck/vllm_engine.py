"""The real vLLM engine loop on CPU with a fake device whose timeline is the known truth.

Real vLLM code (``vllm_src``): ``EngineCore.step`` / ``step_with_batch_queue``, ``UniProcExecutor`` with
``AsyncOutputFuture``, ``MultiprocExecutor`` with ``FutureWrapper`` and a real ``WorkerProc`` busy loop
(``handle_output`` / ``async_output_busy_loop``) in a forked worker process, ``AsyncGPUModelRunnerOutput``
and MRV2 ``AsyncOutput`` (their ``__init__`` records the copy-ready event, ``get_output`` synchronizes
it). Stand-ins: the scheduler (host work of known length), the worker (launches the forward onto the
fake device and returns ``None`` from ``execute_model``; launches the sampler behind it and returns the
async output from ``sample_tokens``, like ``GPUModelRunner``), the message queues between engine and worker process (multiprocessing queues),
and torch (``FakeDevice``: one in-order stream; an event completes when the stream reaches it; an
async output's ``.to("cpu", non_blocking=True)`` copies are device work of its step, as in vLLM).

Host work is ``time.sleep`` (a host thread that releases the GIL, like C++ launch paths); see
docs/async_check.md for what GIL-holding host work does to the watcher's precision.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class FakeDevice:
    """One in-order device stream on the host clock: work starts when launched and the stream is free."""

    def __init__(self) -> None:
        self.tail = 0.0
        self.intervals: list[tuple[float, float]] = []  # (start, end) per launched forward, perf_counter s
        self.wake_lags: list[float] = []  # how late each blocking synchronize returned (s): host latency
        self.copies: dict[int, tuple[float, float]] = {}
        """Step index -> (its compute's end, its output's first copy start), perf_counter s: the device idles
        between the two while the host builds the output (after a blocking launch returned)."""
        self.lock = threading.Lock()

    def clear(self) -> None:
        self.intervals.clear()
        self.wake_lags.clear()
        self.copies.clear()

    def launch(self, duration_s: float, *, same_step: bool = False, copy: bool = False) -> None:
        """Queue work; ``same_step``: more work of the step just launched (the sampler after the forward),
        so the step's device interval ends with it; ``copy``: that work is its output's copy."""
        with self.lock:
            start = max(time.perf_counter(), self.tail)
            if copy and self.intervals and len(self.intervals) - 1 not in self.copies:
                self.copies[len(self.intervals) - 1] = (self.intervals[-1][1], start)
            self.tail = start + duration_s
            if same_step and self.intervals:
                self.intervals[-1] = (self.intervals[-1][0], self.tail)
            else:
                self.intervals.append((start, self.tail))

    def synchronize(self, *, step_end: bool = True) -> None:
        """Block until the stream is idle; ``step_end``: the step's last synchronize, whose wake-up lag the
        truth takes off (one per step)."""
        tail = self.tail
        wait_until(tail)
        if tail > 0 and step_end:
            self.wake_lags.append(max(0.0, time.perf_counter() - tail))


def wait_until(t: float) -> None:
    """Block like a device synchronize until ``t``: sleep most of it, then yield (GIL released) in short
    steps, so a loaded machine's sleep overshoot does not make the host see completion late."""
    remaining = t - time.perf_counter() - 0.0003
    if remaining > 0:
        time.sleep(remaining)
    while time.perf_counter() < t:
        time.sleep(0)


DEVICE = FakeDevice()
COPY_S = 0.000005
"""One device-to-host copy of an async output (a few token ids: a few µs of link latency)."""


class FakeEvent:
    """``torch.Event`` / ``torch.cuda.Event``: completes when the stream reaches the point it was recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.done_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.done_at = DEVICE.tail

    def query(self) -> bool:
        return self.done_at is None or time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        if self.done_at is not None:
            wait_until(self.done_at)


class FakeTensor:
    """A device tensor of sampled token ids; ``.to('cpu')`` gives the host copy (read after the event)."""

    def __init__(self, shape: tuple[int, ...] = (1, 1), fill: int = 7) -> None:
        self.shape = shape
        self.fill = fill

    def to(self, *args: Any, non_blocking: bool = False, **kwargs: Any) -> FakeTensor:
        if non_blocking and args and args[0] == "cpu":
            # the async output's ``__init__`` launches its device-to-host copies (gpu_model_runner.py
            # ``AsyncGPUModelRunnerOutput.__init__``, gpu/async_utils.py ``async_copy_to_np``) before it
            # records the copy-ready event: device work of the step, so the output is ready only after it.
            # vLLM runs the copy on ``async_output_copy_stream`` (which waits on the default stream), so the
            # next forward need not wait for it; this one stream makes it wait: immaterial at COPY_S (5 µs)
            DEVICE.launch(COPY_S, same_step=True, copy=True)
        return self

    def numpy(self) -> Any:
        import numpy as np

        return np.full(self.shape, self.fill, dtype=np.int64)

    def tolist(self) -> list[Any]:
        return self.numpy().tolist()

    def unbind(self, dim: int = 0) -> list[FakeTensor]:
        return [FakeTensor(self.shape[1:] or (1,), self.fill) for _ in range(self.shape[0])]


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass


class CpuTensor:
    """``torch.tensor([...], device="cpu")`` for the DP all-reduce bodies (a 1-rank group leaves it as is)."""

    def __init__(self, data: Any, **kwargs: Any) -> None:
        self.data = list(data)

    def __getitem__(self, i: int) -> CpuTensor:
        return CpuTensor([self.data[i]])

    def item(self) -> Any:
        return self.data[0]


def setup_torch(torch: Any) -> None:
    """The torch attributes the output classes and the DP sync touch, backed by the fake device."""
    torch.tensor = CpuTensor
    torch.Event = FakeEvent
    torch.cuda = SimpleNamespace(Event=FakeEvent, current_stream=lambda *a: _Stream(), Stream=_Stream,
                                 stream=lambda s: contextlib.nullcontext(), set_stream=lambda s: None)


@dataclass
class Timing:
    """Host and device work per step (seconds)."""

    schedule_s: float = 0.002
    prep_s: float = 0.0  # host input prep inside execute_model before the forward launch (the gap is
    # measured to the launch start, so prep time is under-read; 0 keeps the truth comparable)
    forward_s: float = 0.008  # twice the host work per step: async hides it with margin on a loaded machine
    sample_s: float = 0.0003  # the sampler's device work, launched by sample_tokens behind the forward
    update_s: float = 0.001
    blocking_launch: bool = False  # the launch synchronizes the device (ASCEND_LAUNCH_BLOCKING-like)
    blocking_sample: bool = False  # sample_tokens synchronizes it (a host read of device data there)


class FakeScheduler:
    """Scheduler stand-in: ``steps`` one-token decode steps, each schedule/update of known host time."""

    def __init__(self, steps: int, timing: Timing) -> None:
        self.left = steps
        self.in_flight = 0
        self.timing = timing
        self.updates = 0

    def has_requests(self) -> bool:
        return self.left > 0 or self.in_flight > 0

    def has_unfinished_requests(self) -> bool:
        return self.has_requests()

    def schedule(self, *args: Any) -> SimpleNamespace:
        time.sleep(self.timing.schedule_s)
        tokens = 1 if self.left > 0 else 0
        self.left -= tokens
        self.in_flight += tokens
        return SimpleNamespace(total_num_scheduled_tokens=tokens, pending_structured_output_tokens=False)

    def get_grammar_bitmask(self, scheduler_output: Any) -> None:
        return None

    def update_from_output(self, scheduler_output: Any, model_output: Any) -> dict:
        time.sleep(self.timing.update_s)
        self.in_flight -= scheduler_output.total_num_scheduled_tokens
        self.updates += 1
        return {}

    def make_stats(self) -> None:
        return None


class FakeWorker:
    """``Worker`` stand-in with ``GPUModelRunner``'s contract: ``execute_model`` launches the forward and
    returns ``None``; ``sample_tokens`` returns the async output (async) or a synchronised output (sync)."""

    def __init__(self, mods: Any, timing: Timing, async_output: bool, output_kind: str = "v1") -> None:
        self.mods = mods
        self.timing = timing
        self.async_output = async_output
        self.output_kind = output_kind
        self.forward_pending = False

    def execute_model(self, scheduler_output: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return SimpleNamespace(req_ids=[], sampled_token_ids=[])
        if self.timing.prep_s:
            time.sleep(self.timing.prep_s)
        DEVICE.launch(self.timing.forward_s)
        pooling = self.output_kind in ("pool", "mrv2-pool")
        self.forward_pending = not pooling
        if self.timing.blocking_launch:
            DEVICE.synchronize(step_end=False)  # the step ends later: its sampler, its output's copy
        if pooling:  # pooling runners return the output here, no sampling
            out = SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}, pooler_output=None)
            if not self.async_output:
                DEVICE.synchronize()
                return out
            kwargs = dict(model_runner_output=out, raw_pooler_output=[FakeTensor((4,))],
                          # MRV2 0.23 takes one batch tensor, 0.33 a list (or a torch.Tensor, stubbed here)
                          pooler_output=FakeTensor((1, 4)) if self.mods.version == "0.23.0" else [FakeTensor((4,))],
                          finished_mask=[True], is_valid=None, async_output_copy_stream=_Stream(),
                          main_stream=_Stream(), copy_stream=_Stream())
            cls = (self.mods.gpu_model_runner.AsyncGPUPoolingModelRunnerOutput if self.output_kind == "pool"
                   else self.mods.async_utils.AsyncPoolingOutput)
            return _call_supported(cls, **kwargs)
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=None, logprobs=None,
                              prompt_logprobs_dict={}, prompt_token_id_logprobs_dict={})
        if self.forward_pending:  # GPUModelRunner.sample_tokens launches the sampler on the device
            self.forward_pending = False
            DEVICE.launch(self.timing.sample_s, same_step=True)
        if not self.async_output or self.timing.blocking_sample or self.timing.blocking_launch:
            # sync: GPUModelRunner's .tolist() on the sampled ids, the step's end; blocking: every launch,
            # and the async output's copy (launched after this returns) ends the step
            DEVICE.synchronize(step_end=not self.async_output)
        if not self.async_output:
            out.sampled_token_ids = [[7]]
            return out
        if self.output_kind == "mrv2":
            return _mrv2_output(self.mods, out)
        return _call_supported(self.mods.gpu_model_runner.AsyncGPUModelRunnerOutput, model_runner_output=out,
                               sampled_token_ids=FakeTensor(), logprobs_tensors=None, invalid_req_indices=[],
                               async_output_copy_stream=_Stream(), vocab_size=32000)

    def execute_dummy_batch(self) -> None:
        return None


def _call_supported(func: Any, **kwargs: Any) -> Any:
    params = _params(func)
    return func(**{k: v for k, v in kwargs.items() if k in params})


@functools.lru_cache(maxsize=None)
def _params(func: Any) -> frozenset[str]:
    """The parameters the release's class takes (cached: ``inspect.signature`` per step would be host work
    between the device's end and the output's creation that no real worker does, counted as device idle)."""
    import inspect

    return frozenset(inspect.signature(func).parameters)


def _mrv2_output(mods: Any, out: Any) -> Any:
    sampler_output = SimpleNamespace(sampled_token_ids=FakeTensor(), logprobs_tensors=None, num_nans=None,
                                     sampling_mask_tensors=None, num_rejected=FakeTensor())
    return _call_supported(mods.async_utils.AsyncOutput, model_runner_output=out, sampler_output=sampler_output,
                           num_sampled_tokens=FakeTensor((1,), 1), main_stream=_Stream(), copy_stream=_Stream(),
                           check_ep_fault=False, pending_aux_output=None)


class ThreadedExecutor:
    """Mixin for ``UniProcExecutor``: resolves async outputs on an output thread (vLLM <= 0.11's
    ``collective_rpc(non_block=True)``: ``get_output`` submitted to a ``WorkerAsyncOutput`` pool)."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="WorkerAsyncOutput")

    def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False, single_value: bool = False) -> Any:
        result = getattr(self.driver_worker, method)(*args, **(kwargs or {}))
        if non_block and hasattr(result, "get_output"):
            return self._pool.submit(result.get_output)
        if non_block:
            future: Future = Future()
            future.set_result(result)
            return future
        return result


class QueueMQ:
    """``MessageQueue`` stand-in over a multiprocessing queue (``enqueue`` / ``dequeue``)."""

    def __init__(self, q: Any) -> None:
        self.q = q

    def enqueue(self, obj: Any) -> None:
        self.q.put(obj)

    def dequeue(self, timeout: Any = None, indefinite: bool = False) -> Any:
        return self.q.get(timeout=timeout if isinstance(timeout, (int, float)) else 30)


def _worker_main(mods: Any, timing: Timing, async_output: bool, requests: Any, responses: Any, truth: Any) -> None:
    """Forked worker process: a real ``WorkerProc`` busy loop on the fake device."""
    DEVICE.clear()
    mpe = mods.multiproc_executor
    proc = mpe.WorkerProc.__new__(mpe.WorkerProc)
    proc.rpc_broadcast_mq = QueueMQ(requests)
    proc.worker_response_mq = QueueMQ(responses)
    proc.worker = FakeWorker(mods, timing, async_output)
    proc.rank = 0
    proc.use_async_scheduling = async_output
    if async_output:
        proc.async_output_queue = queue.Queue()
        threading.Thread(target=proc.async_output_busy_loop, daemon=True, name="WorkerAsyncOutputCopy").start()

    def stop(*args: Any) -> None:
        truth.put((list(DEVICE.intervals), list(DEVICE.wake_lags)))
        raise SystemExit

    proc.worker.shutdown_now = stop
    try:
        proc.worker_busy_loop()
    except SystemExit:
        pass


def make_executor(mods: Any, kind: str, timing: Timing, async_output: bool, output_kind: str = "v1") -> Any:
    """``uniproc`` / ``threaded`` / ``multiproc`` executor around the fake worker (made with ``__new__``)."""
    if kind in ("uniproc", "threaded"):
        base = mods.uniproc_executor.UniProcExecutor
        cls = type("ThreadedUniProcExecutor", (ThreadedExecutor, base), {}) if kind == "threaded" else base
        ex = cls.__new__(cls)
        ex.driver_worker = FakeWorker(mods, timing, async_output, output_kind)
        ex.truth = lambda: list(DEVICE.intervals)
        ex.lags = lambda: list(DEVICE.wake_lags)
        ex.stop = lambda: None
        return ex
    mpe = mods.multiproc_executor
    ctx = mp.get_context("fork")
    requests, responses, truth = ctx.Queue(), ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=_worker_main, args=(mods, timing, async_output, requests, responses, truth), daemon=True)
    worker.start()
    ex = mpe.MultiprocExecutor.__new__(mpe.MultiprocExecutor)
    ex.rpc_broadcast_mq = QueueMQ(requests)
    ex.response_mqs = [QueueMQ(responses)]
    ex.futures_queue = deque()
    ex.is_failed = False
    ex.output_rank = 0
    ex.kv_output_aggregator = None
    ex.ec_output_aggregator = None

    def stop() -> None:
        requests.put(("shutdown_now", (), {}, None))
        ex.device_intervals, ex.worker_lags = truth.get(timeout=30)
        worker.join(10)

    ex.stop = stop
    ex.truth = lambda: ex.device_intervals
    ex.lags = lambda: ex.worker_lags
    return ex


def make_engine(mods: Any, *, async_loop: bool, executor: Any, scheduler: FakeScheduler, pooling: bool = False,
                cls: Any = None) -> Any:
    """A real ``EngineCore`` (``__new__``, like vLLM's own unit tests) with the attributes its loops read
    (``cls``: a subclass such as ``DPEngineCoreProc``)."""
    core = mods.core
    cls = cls or core.EngineCore
    engine = cls.__new__(cls)
    engine.vllm_config = SimpleNamespace(
        observability_config=SimpleNamespace(enable_logging_iteration_details=False))
    engine.log_stats = False
    engine.scheduler = scheduler
    engine.model_executor = executor
    engine.batch_queue_size = 2 if async_loop else 1
    engine.batch_queue = deque(maxlen=2) if async_loop else None
    engine.is_ec_consumer = True
    engine.is_pooling_model = pooling
    engine.is_mm_encoder_only = False
    engine.use_spec_decode = False
    engine.check_for_draft_tokens = False
    engine.async_scheduling = async_loop
    engine.aborts_queue = queue.Queue()
    engine._weight_version = 0
    engine.step_fn = engine.step if engine.batch_queue is None else engine.step_with_batch_queue
    return engine


@dataclass
class Truth:
    """What the fake device did: forward intervals (perf_counter s) and the schedule intervals."""

    device: list[tuple[float, float]]
    schedules: list[tuple[float, float]] = field(default_factory=list)

    def gaps_ms(self) -> list[float]:
        d = sorted(self.device)
        return [max(0.0, (d[i + 1][0] - d[i][1]) * 1e3) for i in range(len(d) - 1)]


def true_gaps_ms(device: list[tuple[float, float]], wake_lags: list[float]) -> list[float]:
    """Device idle between consecutive steps (ms): from step n's last device work (its output's copy, when
    it has an async output) to step n+1's first. In the sync loop, less how late the OS woke the
    synchronizing host thread (one step-end synchronize per step, the last ones for the last steps): host
    latency the engine could not see, ms on a loaded machine."""
    gaps = Truth(device).gaps_ms()
    if len(wake_lags) >= len(gaps) + 1:
        gaps = [g - lag * 1e3 for g, lag in zip(gaps, wake_lags[-len(gaps) - 1:])]
    return gaps


def device_idle_ms(device: list[tuple[float, float]], copies: dict[int, tuple[float, float]]
                   ) -> tuple[list[float], list[float]]:
    """Device idle between consecutive steps (ms) from step n's compute end (before its output's copy),
    and the host work (ms) between that end and the copy's launch: what a gap from output-ready misses."""
    d = sorted(device)
    ends = [copies[i][0] if i in copies else d[i][1] for i in range(len(d))]
    idle = [max(0.0, (d[i + 1][0] - ends[i]) * 1e3) for i in range(len(d) - 1)]
    host = [(copies[i][1] - copies[i][0]) * 1e3 if i in copies else 0.0 for i in range(len(d) - 1)]
    return idle, host


def run_engine(engine: Any, max_calls: int = 10000) -> None:
    """Call ``step_fn`` until the scheduler is drained (what ``run_busy_loop`` does between inputs)."""
    for _ in range(max_calls):
        if not engine.scheduler.has_requests() and not engine.batch_queue:
            return
        engine.step_fn()
    raise RuntimeError("engine loop did not drain")
