"""A MultiprocExecutor worker's ``worker_launch`` spans give each engine step the launch that really
queued its device work (the engine's dispatch returns at once; a blocking launch blocks in the worker)."""

from __future__ import annotations

from otel_kvtrace.asynccheck import model as m
from otel_kvtrace.asynccheck.steps import join_worker_launches


def _call(name: str, start: int, end: int) -> m.SpanRow:
    return m.SpanRow("r", "w", "r/pid2", None, m.WORKER_LAUNCH, m.WORKER_LAUNCH, start, end,
                     {m.ATTR_WORKER_CALL: name})


def _steps(batch_queue: bool) -> list[m.StepRow]:
    # engine: dispatch of step n at 100n (returns at once), update at 100n + 90
    return [m.StepRow("r", "r/pid1", n, launch_start=100 * n, launch_end=100 * n + 1, update_start=100 * n + 90,
                      update_end=100 * n + 95, done=100 * n + 90, done_precision=m.DONE_ENGINE_OBSERVED,
                      batch_queue=batch_queue) for n in range(3)]


def test_each_step_takes_its_worker_execute_model_and_sample_tokens() -> None:
    steps = _steps(batch_queue=False)
    calls = [c for n in range(3) for c in (_call("execute_model", 100 * n + 5, 100 * n + 60),
                                           _call("sample_tokens", 100 * n + 61, 100 * n + 80))]
    join_worker_launches(steps, [_call("sample_tokens", -50, -40)] + calls, sync_outputs=True)
    assert [(r.worker_launch_start, r.worker_launch_end) for r in steps] == [(5, 80), (105, 180), (205, 280)]
    # the sync loop: the worker's last call returned the synchronous output, before the engine saw it
    assert [(r.done, r.done_precision) for r in steps] == [(100 * n + 80, m.DONE_WORKER_RETURN) for n in range(3)]


def test_async_steps_never_take_the_workers_return_as_ready() -> None:
    """In the async loop sample_tokens returns the async output before it is ready."""
    steps = _steps(batch_queue=True)
    join_worker_launches(steps, [_call("execute_model", 5, 10), _call("sample_tokens", 11, 12)], sync_outputs=True)
    assert (steps[0].worker_launch_start, steps[0].worker_launch_end) == (5, 12)
    assert steps[0].done_precision == m.DONE_ENGINE_OBSERVED
    assert steps[1].worker_launch_start is None  # no call of its own: never the previous step's
