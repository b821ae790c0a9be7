"""The serving engine: continuous batching over the replica, KV tasks named after the requests, failures."""

from __future__ import annotations

import threading

from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.serve.engine import RING_STEPS, EngineRequest, ReplicaEngine


class _Tokens:
    def __init__(self) -> None:
        self.got: list[int] = []
        self.done = threading.Event()

    def __call__(self, index: int, _ns: int) -> None:
        self.got.append(index)
        if index < 0 or len(self.got) == self.want:
            self.done.set()


def _request(engine: ReplicaEngine, rid: str, tokens: int, prompt: int = 300) -> _Tokens:
    sink = _Tokens()
    sink.want = tokens
    engine.submit(EngineRequest(rid, prompt, tokens, sink))
    return sink


def test_batches_requests_names_their_kv_tasks_and_wraps_the_ring() -> None:
    engine = ReplicaEngine(ReplicaConfig(num_layers=4, num_shared_buffers=2, prefetch_layers=2), max_num_seqs=2)
    engine.start()
    try:
        seen: list[list[str]] = []
        engine.on_step = lambda step: seen.append([r.req_id for r in engine.plan.requests[step % RING_STEPS]])
        sinks = [_request(engine, f"cmpl-{i}-0", tokens=RING_STEPS // 2 + 3) for i in range(3)]
        for s in sinks:
            assert s.done.wait(60)
    finally:
        assert engine.stop()
    assert all(s.got == list(range(s.want)) for s in sinks)
    prefills = [ids for ids in seen if ids]
    # max_num_seqs=2: two requests prefill together, the third only after one finished (continuous batching)
    assert prefills[0] == ["cmpl-0-0", "cmpl-1-0"] and ["cmpl-2-0"] in prefills[1:]
    assert engine.stats.steps > RING_STEPS  # the plan ring wrapped while requests were running
    assert engine.stats.tokens == sum(s.want for s in sinks) and engine.stats.error is None


def test_a_failed_forward_ends_every_request_and_stops_serving() -> None:
    engine = ReplicaEngine(ReplicaConfig(num_layers=4, num_shared_buffers=2, prefetch_layers=2), max_num_seqs=4,
                           wait_timeout_s=1.0)
    engine.plan.fail_index = 1  # the replica's own fault injection: step 0 (the prefill), layer 1's load copy fails
    engine.start()
    try:
        sink = _request(engine, "cmpl-x-0", tokens=50)
        late = _request(engine, "cmpl-y-0", tokens=50)
        assert sink.done.wait(30) and late.done.wait(30)
    finally:
        engine.stop()
    assert sink.got[-1] == -1 and late.got[-1] == -1
    assert not engine.alive and engine.stats.error is not None
