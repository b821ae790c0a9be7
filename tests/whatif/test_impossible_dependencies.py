"""What-if refuses dependency graphs no policy can serve, naming the tasks; valid random graphs replay.

A cycle here is a task whose save or gate happens after the forward passed a layer whose load is the
task itself or one queued after it (the forward passes layer c only after every load of a layer <= c).
Fuzz: seeded random schedules of the upstream shape, with and without one injected impossible link.
"""

from __future__ import annotations

import random

import pytest

from otel_kvtrace.whatif.replay import replay_run
from otel_kvtrace.whatif.task import ReplayInputError, ReplayTask


def _schedule(rng: random.Random, steps: int = 2, layers: int = 6) -> list[ReplayTask]:
    tasks = []
    clock = seq = 0
    for step in range(steps):
        for layer in range(layers):
            clock += rng.randint(0, 50)
            lower = list(range(layer))
            gate = rng.choice([None, *lower]) if lower else None
            src = rng.choice([None, *lower]) if lower else None
            tasks.append(ReplayTask(
                queue="q", seq=seq, step=step, layer_id=layer, arrival_ns=clock,
                work_ns=tuple(rng.randint(1, 200) for _ in range(4)),  # type: ignore[arg-type]
                ready_save_ns=clock + rng.randint(0, 2000) if src is not None else None,
                ready_gate_ns=clock + rng.randint(0, 2000) if gate is not None else None,
                final_layer=layer == layers - 1, gate_id=gate, wait_for_save_layer=src,
                recorded_complete_ns=clock + rng.randint(0, 3000), run_id="r", cfg_label="c"))
            seq += 1
        clock += 5000
    return tasks


CYCLES = [  # (position of the task, field, layer offset from its own layer)
    (2, "gate_id", 0), (2, "gate_id", 1), (2, "gate_id", 3), (0, "gate_id", 0), (4, "gate_id", 1),
    (1, "wait_for_save_layer", 1), (3, "wait_for_save_layer", 2), (0, "wait_for_save_layer", 5),
    (8, "gate_id", 0), (8, "wait_for_save_layer", 1), (10, "gate_id", 1), (6, "gate_id", 2),
    (7, "wait_for_save_layer", 3), (9, "gate_id", 2),
]


@pytest.mark.parametrize(("pos", "field", "offset"), CYCLES)
def test_a_cycle_is_refused_naming_the_task(pos: int, field: str, offset: int) -> None:
    tasks = _schedule(random.Random(pos * 31 + offset))
    t = tasks[pos]
    setattr(t, field, min(t.layer_id + offset, 5))
    if field == "gate_id":
        t.ready_gate_ns = t.arrival_ns + 10
    else:
        t.ready_save_ns = t.arrival_ns + 10
    with pytest.raises(ReplayInputError, match=rf"seq={t.seq} \(step {t.step}, layer {t.layer_id}\) waits for"):
        replay_run(tasks)


@pytest.mark.parametrize("seed", range(60))
def test_random_valid_schedules_replay_and_random_cycles_are_refused(seed: int) -> None:
    rng = random.Random(seed)
    tasks = _schedule(rng, steps=rng.randint(1, 3), layers=rng.randint(2, 8))
    run = replay_run(tasks)
    assert run.summary()
    bad = rng.choice([t for t in tasks if t.layer_id < max(x.layer_id for x in tasks)])
    bad.gate_id = rng.randint(bad.layer_id, max(x.layer_id for x in tasks))
    bad.ready_gate_ns = bad.arrival_ns
    with pytest.raises(ReplayInputError, match=f"seq={bad.seq} "):
        replay_run(tasks)


def test_the_cli_exits_2_naming_the_task_of_a_cycle_in_a_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    import orjson

    from synthetic_traces import QueueSpec, request_lines, simulate_queue  # bench/ (tests/conftest.py)

    spec = QueueSpec(run_id="cycle")
    lines = [orjson.loads(x) for x in request_lines(spec, simulate_queue(spec, 16, seed=1))]
    target = None
    for doc in lines:
        for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            attrs = {a["key"]: a for a in span.get("attributes", [])}
            if span["name"] == "kvtrace.recv.task" and "kvtrace.gate_id" in attrs and target is None:
                layer = int(attrs["kvtrace.layer_id"]["value"]["intValue"])
                attrs["kvtrace.gate_id"]["value"] = {"intValue": str(layer + 1)}
                target = attrs["kvtrace.seq"]["value"]["intValue"]
    assert target is not None
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in lines))
    proc = subprocess.run([sys.executable, "-m", "otel_kvtrace.cli", "whatif", str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"seq={target} " in proc.stderr and "Traceback" not in proc.stderr
