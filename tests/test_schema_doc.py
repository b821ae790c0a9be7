"""docs/schema.md is the contract: every span name and attribute key the exporter writes is listed there."""

from __future__ import annotations

from pathlib import Path

from otel_kvtrace.export.spans import SpanBuilder
from otel_kvtrace.record.model import ALL_CHILD_SPAN_NAMES, Dep, Outcome, QueueInfo, Stage, TaskKind, TaskRecord, RECV_ROOT_SPAN, SEND_ROOT_SPAN
from otel_kvtrace.record.recorder import ClockAnchor

SCHEMA = (Path(__file__).resolve().parent.parent / "docs" / "schema.md").read_text()


def _full_record(kind: int, bounded: bool) -> TaskRecord:
    rec = TaskRecord(queue=QueueInfo(run_id="r", path="gva", thread_name="recv", pid=1, num_layers=4))
    rec.kind = kind
    rec.layer_id, rec.step, rec.seq = 3, 1, 7
    rec.final_layer = True
    rec.wait_for_save_layer, rec.gate_id = 1, 2
    rec.t_enqueue, rec.t_dequeue, rec.t_backend_return, rec.t_complete = 100, 200, 900, 950
    for i, stage in enumerate(Stage):
        rec.stages.extend((int(stage), 200 + 10 * i, 205 + 10 * i))
    for dep in Dep:
        if bounded:
            rec.dep_bounds(int(dep), 150, 180)
        else:
            rec.dep_exact(int(dep), 150)
    rec.outcome = Outcome.ERROR
    rec.error = RuntimeError("copy failed")
    rec.consumer_release = 1  # released at a step boundary without its consumer wait
    return rec


def _emitted() -> tuple[set[str], set[str]]:
    names: set[str] = set()
    keys: set[str] = set()
    builder = SpanBuilder(ClockAnchor(0, 10**18))
    for kind in (TaskKind.RECV, TaskKind.SEND):
        for bounded in (False, True):
            for span in builder.build(_full_record(kind, bounded)):
                names.add(span["name"])
                keys.update(a["key"] for a in span.get("attributes", []))
    return names, keys


def test_every_span_name_is_documented() -> None:
    names, _ = _emitted()
    assert names >= {RECV_ROOT_SPAN, SEND_ROOT_SPAN, *ALL_CHILD_SPAN_NAMES}
    for name in names:
        assert f"`{name}`" in SCHEMA, f"span {name} is not in docs/schema.md"


def test_every_attribute_key_is_documented() -> None:
    _, keys = _emitted()
    for key in keys:
        documented = f"`{key}`" in SCHEMA
        # `ts.dep.<dep>_lo/_hi` are documented by pattern
        if not documented and key.startswith("kvtrace.ts.dep.") and key.endswith(("_lo", "_hi")):
            documented = "`kvtrace.ts.dep.<dep>_lo`" in SCHEMA
        assert documented, f"attribute {key} is not in docs/schema.md"
