"""The engine-loop patch table: install/uninstall symmetry, pass-through semantics, no vLLM import."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_kvtrace.asynccheck import instrument
from otel_kvtrace.asynccheck.assemble import StepAssembler
from otel_kvtrace.asynccheck.instrument import PATCH_POINTS, EngineLoopInstrumentation
from otel_kvtrace.asynccheck.recorder import StampBuffer, StampKind
from otel_kvtrace.asynccheck.replica import (
    REPLICA_OWNERS,
    FakeDevice,
    ReplicaExecutor,
    ReplicaConfig,
    ReplicaEngineCore,
    ReplicaScheduler,
    SchedulerOutput,
    VirtualClock,
)


def _originals() -> dict[tuple[type, str], object]:
    return {
        (cls, p.member): vars(cls)[p.member]
        for p in PATCH_POINTS
        for cls in REPLICA_OWNERS.get(p.role, ())  # no worker class: the replica runs no worker process
        if p.member in vars(cls)
    }


@pytest.fixture
def traced() -> Iterator[tuple[EngineLoopInstrumentation, StampBuffer, VirtualClock]]:
    clock = VirtualClock()
    buffer = StampBuffer(capacity=4096, clock=clock)
    inst = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS)
    inst.install()
    yield inst, buffer, clock
    inst.uninstall()


def test_every_patch_point_is_installed_and_restored() -> None:
    before = _originals()
    inst = EngineLoopInstrumentation(StampBuffer(capacity=64), owners=REPLICA_OWNERS)
    try:
        names = inst.install()
        # the replica follows the pre-0.23 executor contract: no sample_tokens (the real-vLLM
        # conformance tests cover that point)
        assert {p.member for p in PATCH_POINTS} - {n.rsplit(".", 1)[-1] for n in names} == {"sample_tokens"}
        assert len(names) == len(before)
        assert all(vars(cls)[attr] is not orig for (cls, attr), orig in before.items())
    finally:
        inst.uninstall()
    inst.uninstall()  # idempotent
    assert all(vars(cls)[attr] is orig for (cls, attr), orig in before.items())


def test_nothing_is_recorded_after_uninstall() -> None:
    clock = VirtualClock()
    buffer = StampBuffer(capacity=256, clock=clock)
    inst = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS)
    inst.install()
    inst.uninstall()
    ReplicaEngineCore(clock, StampBuffer(capacity=256, clock=clock), ReplicaConfig(mode="async", num_steps=3)).run()
    assert buffer.drain(settle_s=0) == []


def test_stamps_assemble_into_ordered_steps(traced) -> None:
    _, buffer, clock = traced
    ReplicaEngineCore(clock, buffer, ReplicaConfig(mode="async", num_steps=5)).run()
    steps = StepAssembler().feed(buffer.drain(settle_s=0))
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    for s in steps:
        assert s.schedule[0] <= s.schedule[1] <= s.launch[0] <= s.launch[1] <= s.done <= s.update[0]
        assert s.batch_queue
        assert s.done_precision == "device_ready"
    assert [s.queue_depth for s in steps] == [1, 2, 2, 2, 2]


def test_exceptions_and_return_values_pass_through(traced) -> None:
    _, buffer, clock = traced
    scheduler = ReplicaScheduler(clock, ReplicaConfig(num_steps=2))
    out = scheduler.schedule()
    assert out.step == 0  # the original's return value

    executor = ReplicaExecutor(clock, FakeDevice(clock, buffer), ReplicaConfig())
    with pytest.raises(AttributeError, match="step"):
        executor.execute_model(object())  # the original raises; the wrapper must not change that
    assert executor.execute_model(out).done_ns > clock.now_ns  # flag was reset: next launch recorded
    kinds = [s.kind for s in buffer.drain(settle_s=0) if s.kind not in (StampKind.COMPUTE, StampKind.COMM)]
    assert kinds == [
        StampKind.SCHED_BEGIN, StampKind.SCHED_END,
        StampKind.LAUNCH_BEGIN, StampKind.LAUNCH_END,
        StampKind.LAUNCH_BEGIN, StampKind.LAUNCH_END,
    ]


def test_super_chain_of_schedule_is_one_span(traced) -> None:
    inst, buffer, clock = traced

    class SubScheduler(ReplicaScheduler):
        def schedule(self):  # noqa: ANN201 - like vLLM-Ascend's RecomputeScheduler
            return super().schedule()

    owners = {"scheduler": (SubScheduler,)}
    sub = EngineLoopInstrumentation(buffer, owners=owners)
    sub.state = inst.state  # both tables share the process's loop state, as in a real install
    sub.install()
    try:
        SubScheduler(clock, ReplicaConfig()).schedule()
    finally:
        sub.uninstall()
    kinds = [s.kind for s in buffer.drain(settle_s=0)]
    assert kinds == [StampKind.SCHED_BEGIN, StampKind.SCHED_END]


def test_vllm_table_installs_nothing_without_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    inst = EngineLoopInstrumentation(StampBuffer(capacity=8))
    assert inst.install() == []
    monkeypatch.setenv("OTEL_KVTRACE_ENABLED", "0")
    assert instrument.install_from_env(tmp_path) is None
    monkeypatch.setenv("OTEL_KVTRACE_ENABLED", "1")
    assert instrument.install_from_env(tmp_path) is None  # vllm is not importable here
    assert not list(tmp_path.iterdir())


def test_importing_the_instrumentation_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, otel_kvtrace.asynccheck.instrument, otel_kvtrace.asynccheck.replica;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'torch_npu', 'vllm_ascend')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_output_thread_stamps_concurrently_without_loss() -> None:
    buffer = StampBuffer(capacity=10_000)
    inst = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS)
    inst.install()
    try:
        from otel_kvtrace.asynccheck.replica import ReplicaModelRunnerOutput

        def worker() -> None:
            for i in range(2_000):
                ReplicaModelRunnerOutput(i).get_output()

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        inst.uninstall()
    assert len(buffer.drain()) == 6_000
    assert buffer.dropped == 0


def test_scheduler_subclass_chosen_at_engine_init_is_adopted_and_restored() -> None:
    class CustomScheduler(ReplicaScheduler):  # not in the owner table, overrides without super()
        def schedule(self):  # noqa: ANN201
            self.clock.advance(self.cfg.schedule_ns)
            out = SchedulerOutput(self.scheduled)
            self.scheduled += 1
            return out

    original = vars(CustomScheduler)["schedule"]
    clock = VirtualClock()
    buffer = StampBuffer(capacity=4096, clock=clock)
    inst = EngineLoopInstrumentation(buffer, owners=REPLICA_OWNERS)
    inst.install()
    try:
        ReplicaEngineCore(clock, buffer, ReplicaConfig(mode="async", num_steps=4), scheduler_cls=CustomScheduler).run()
        assert vars(CustomScheduler)["schedule"] is not original
    finally:
        inst.uninstall()
    assert vars(CustomScheduler)["schedule"] is original
    steps = StepAssembler().feed(buffer.drain(settle_s=0))
    assert [s.step for s in steps] == [0, 1, 2, 3]


def test_a_failing_watcher_registration_never_reaches_the_output() -> None:
    """Instrumentation failures disable the watcher; the output is constructed as without tracing."""

    class Exploding:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError("boom")

    class Output:
        def __init__(self, value: int) -> None:
            self.value = value
            self.async_copy_ready_event = Exploding()

        def get_output(self) -> int:
            return self.value

    buffer = StampBuffer(capacity=64)
    inst = EngineLoopInstrumentation(buffer, owners={"output": (Output,)})
    inst.install()
    try:
        inst.state.watcher.pending = None  # type: ignore[assignment]  # register() will raise
        assert Output(3).get_output() == 3
        assert inst.state.watcher.failed
        assert Output(4).value == 4
    finally:
        inst.uninstall()
