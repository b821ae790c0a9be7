"""Seeded fuzz: a few hundred malformed captures of every format; `kvtrace async check` never tracebacks.

Each input starts from a valid capture in the writer's format (``msprof_writer``) or one of our traces and
is broken in one way that real files break: truncation, a wrong type, an absurd number, deep nesting,
NUL bytes, a bad quote, a dropped column, a row with NULLs.
"""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from otel_kvtrace.asynccheck.replica import ReplicaConfig, run_replica
from otel_kvtrace.cli import main

from .msprof_writer import chrome_events, mindie_async, write_csvs, write_raw_dbs

SEED = 1313
PER_FORMAT = 60
_ODD_VALUES = [None, True, "", "x", "1e999", "-1", 1e308, -1, 2**70, -(2**70), "2026-13-45 99:99:99:999999",
               [], {}, [[[[1]]]], "NaN", "Infinity", 0.5, "\x00", "💥" * 3]


def _mutate_json_value(rng: random.Random, ev: dict) -> None:
    key = rng.choice(["ts", "dur", "pid", "tid", "name", "args", "ph"])
    ev[key] = rng.choice(_ODD_VALUES)


def _chrome_inputs(rng: random.Random, out: Path, spans, dev) -> list[Path]:
    paths = []
    base = chrome_events(spans, dev)
    for i in range(PER_FORMAT):
        events = json.loads(json.dumps(base))
        kind = i % 6
        if kind == 0:
            for ev in rng.sample(events, 5):
                _mutate_json_value(rng, ev)
            text = json.dumps(events)
        elif kind == 1:
            text = json.dumps(events)[: rng.randrange(1, 4000)]
        elif kind == 2:
            text = "[" * rng.choice([10, 5000, 100000]) + "]" * 3
        elif kind == 3:
            text = json.dumps({"traceEvents": rng.choice([None, 1, "x", [1, [2]], {"a": 1}])})
        elif kind == 4:
            text = json.dumps(rng.choice([[1, 2, "a"], {"x": [1]}, "str", 42, None]))
        else:
            events[rng.randrange(len(events))]["args"] = {"async": rng.choice(_ODD_VALUES), "asyncQueueDepth=": [1]}
            text = json.dumps(events).replace('"ts"', '"ts"', 1) + rng.choice(["", ",", "]", "\x00"])
        path = out / f"chrome{i}" / "chrome_tracing.json"
        path.parent.mkdir(parents=True)
        path.write_text(text)
        paths.append(path.parent)
    return paths


def _csv_inputs(rng: random.Random, out: Path, spans) -> list[Path]:
    paths = []
    for i in range(PER_FORMAT):
        folder = out / f"csv{i}"
        folder.mkdir()
        batch, forward = write_csvs(folder, spans, older=bool(i % 2))
        for path in (batch, forward):
            lines = path.read_text().splitlines()
            kind = rng.randrange(6)
            j = rng.randrange(1, len(lines))
            if kind == 0:
                cells = lines[j].split(",")
                cells[rng.randrange(len(cells))] = str(rng.choice(_ODD_VALUES))
                lines[j] = ",".join(cells)
            elif kind == 1:
                lines[j] = lines[j] + "\x00" + '"unterminated'
            elif kind == 2:
                lines[0] = lines[0].replace("start_time", "begin", 1)
            elif kind == 3:
                lines[j] = "x" * rng.choice([10, 200_000])
            elif kind == 4:
                lines = lines[: rng.randrange(1, len(lines))]
            else:
                lines[j] = '"' + lines[j]
            path.write_text("\n".join(lines) + "\n")
        paths.append(folder)
    return paths


def _db_inputs(rng: random.Random, out: Path, spans, dev) -> list[Path]:
    paths = []
    for i in range(PER_FORMAT):
        folder = out / f"db{i}"
        dbs = write_raw_dbs(folder, spans, dev, older=bool(i % 3 == 0))
        db = rng.choice(dbs)
        con = sqlite3.connect(db)
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")]
        table = rng.choice(tables)
        cols = [r[1] for r in con.execute(f'PRAGMA table_info("{table}")')]
        kind = rng.randrange(4)
        if kind == 0:
            col = rng.choice(cols)
            value = rng.choice(_ODD_VALUES)
            value = json.dumps(value) if isinstance(value, (list, dict)) else value
            value = str(value) if isinstance(value, int) and abs(value) >= 2**63 else value
            con.execute(f'UPDATE "{table}" SET "{col}" = ? WHERE rowid IN (SELECT rowid FROM "{table}" LIMIT 3)', (value,))
        elif kind == 1:
            con.execute(f'DROP TABLE "{table}"')
            con.execute(f'CREATE TABLE "{table}" (x TEXT)')
        elif kind == 2:
            con.execute(f'INSERT INTO "{table}" DEFAULT VALUES')
        else:
            con.commit()
            con.close()
            data = db.read_bytes()
            db.write_bytes(data[: rng.randrange(100, max(101, len(data)))])
            paths.append(folder)
            continue
        con.commit()
        con.close()
        paths.append(folder)
    return paths


def _otlp_inputs(rng: random.Random, out: Path) -> list[Path]:
    good = run_replica(ReplicaConfig(mode="async", num_steps=4), out_dir=out / "good").read_text().splitlines()
    paths = []
    for i in range(PER_FORMAT):
        lines = list(good)
        j = rng.randrange(len(lines))
        doc = json.loads(lines[j])
        kind = rng.randrange(5)
        span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        if kind == 0:
            span[rng.choice(["startTimeUnixNano", "endTimeUnixNano", "name", "attributes"])] = rng.choice(_ODD_VALUES)
        elif kind == 1:
            doc["resourceSpans"][0]["resource"] = rng.choice(_ODD_VALUES)
        elif kind == 2:
            span["attributes"] = [{"key": "async.step", "value": {"intValue": rng.choice(["x", "99999999999999999999"])}}]
        elif kind == 3:
            doc = rng.choice(_ODD_VALUES)
        else:
            lines[j] = lines[j][: rng.randrange(len(lines[j]))]
            doc = None
        if doc is not None or kind == 3:
            lines[j] = json.dumps(doc)
        path = out / f"otlp{i}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def malformed_inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = random.Random(SEED)
    out = tmp_path_factory.mktemp("fuzz")
    spans, dev = mindie_async(steps=5)
    return (_chrome_inputs(rng, out, spans, dev) + _csv_inputs(rng, out, spans) + _db_inputs(rng, out, spans, dev)
            + _otlp_inputs(rng, out))


def test_no_malformed_input_gives_a_traceback(malformed_inputs: list[Path]) -> None:
    assert len(malformed_inputs) >= 240
    crashed = []
    for path in malformed_inputs:
        result = CliRunner().invoke(main, ["async", "check", str(path)])
        if result.exit_code not in (0, 2) or (result.exception and not isinstance(result.exception, SystemExit)):
            crashed.append(f"{path}: {type(result.exception).__name__}: {result.exception}")
    assert not crashed, "\n".join(crashed[:10])


def test_one_bad_csv_row_is_a_named_skip_not_a_lost_file(tmp_path: Path) -> None:
    spans, _ = mindie_async(steps=6)
    batch, forward = write_csvs(tmp_path, spans)
    lines = forward.read_text().splitlines()
    lines[3] = lines[3].replace(lines[3].split(",")[-1], "1e999")
    lines[4] = lines[4] + "\x00"
    forward.write_text("\n".join(lines) + "\n")
    from otel_kvtrace.asynccheck.importers import import_paths

    result = import_paths([forward], "r")
    assert len([s for s in result.spans if s.origin == "forward"]) == 4
    assert [(Path(i.file).name, i.line) for i in result.issues] == [("forward.csv", 4), ("forward.csv", 5)]
    assert "more than a day" in result.issues[0].reason
