"""Write msServiceProfiler captures the way its writer and parser do, for a timeline with a known truth.

Each writer follows the real code of ``Ascend/msserviceprofiler`` (GitHub mirror ``Cztk5380/msserviceprofiler``;
commits ``9582f434`` = current parser, ``e7818cfb`` = the parser as of 2025-12, "older"):

- raw ``ms_service_<host>-<pid>.db`` ``slice``: ``cpp/include/msServiceProfiler/DBExecutor/DbExecutorSliceData.h``;
  older ``Mstx``: ``DbExecutorServiceData.h`` @ e7818cfb; WAL: ``cpp/src/ServiceProfilerDbWriter.cpp``.
- MSPTI ``ascend_service_profiler_<host>-<pid>.db``: ``DbExecutorMspti{Api,kernel,Comm}Data.h``.
- ``chrome_tracing.json``: ``ms_service_profiler/exporters/exporter_trace.py`` (``add_trace_events``,
  ``export_event_from_df``: Api/Kernel rows ``ts = start // 1000``, ``pid`` from the db name) and
  ``plugins/plugin_mspit_process.py`` (``replace_name``: kernels take their Api's name).
- ``profiler.db``: ``ms_service_profiler/utils/trace_to_db.py`` (``TRACE_TABLE_DEFINITIONS``: ``thread.pid`` TEXT,
  no ``slice.pid``; ``convert_ts_to_ns``).
- ``batch.csv``: ``exporters/exporter_batch.py`` (``BATCH_RENAME_COLS``; current ``start_time(ms)`` = tx_data µs,
  never divided; older renames ``start_datetime`` to ``start_time``); ``forward.csv``: ``exporters/exporter_forward.py``
  (fixed ``ori_columns`` without ``async``; current ``start_time(ms)`` = µs / 1000; older: datetime strings).
- datetime strings: ``data_source/db_data_source.py`` (Asia/Shanghai, ``%Y-%m-%d %H:%M:%S:%f``).
"""

from __future__ import annotations

import csv
import json
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

T0_NS = 1_767_225_600_100_000_000  # 2026-01-01T00:00:00.1Z
MS = 1_000_000
HOST = "host"
SCHED_PID, SCHED_TID, EXEC_PID, EXEC_TID = 100, 101, 200, 201


@dataclass
class Span:
    name: str
    domain: str
    start: int  # ns
    end: int
    pid: int
    tid: int
    args: dict = field(default_factory=dict)


@dataclass
class Device:
    name: str  # kernel name (MSPTI)
    api: str  # the Api that launched it
    api_start: int
    api_end: int
    start: int
    end: int
    corr: int


def mindie_async(steps: int = 12) -> tuple[list[Span], list[Device]]:
    """MindIE async, host one step ahead of a device-bound FIFO (batch queue of 2).

    Step n: BatchSchedule [10n-8, 10n-7] ms, Execute [10n-7, 10n-6.8], forward(async) [10n-6.8, 10n-6.2]
    with 3 Api calls; its kernels run [10n+2.0, 10n+11.8]. Truth: schedule(n+1) = [10n+2, 10n+3] lies
    inside execute(n) = [10n-7, 10n+11.8]: overlap 100 %. A kernel given to "the last launch before it"
    makes step n end at 10n+2.2 (20 %).
    """
    spans: list[Span] = []
    dev: list[Device] = []
    at = lambda ms: T0_NS + int(round(ms * MS))  # noqa: E731
    for n in range(steps):
        b = 10 * n
        spans.append(Span("BatchSchedule", "Schedule", at(b - 8), at(b - 7), SCHED_PID, SCHED_TID,
                          {"batch_size": 4, "rid": [f"r{i}" for i in range(4)], "batchType": int(n > 0)}))
        spans.append(Span("Execute", "Schedule", at(b - 7), at(b - 6.8), SCHED_PID, SCHED_TID))
        spans.append(Span("forward", "ModelExecute", at(b - 6.8), at(b - 6.2), EXEC_PID, EXEC_TID, {"async": True}))
        spans.append(Span("get_from_output_queue", "ModelExecute", at(b - 6.9), at(b - 6.85), EXEC_PID, EXEC_TID + 1))
        for i, (api, kernel, ks, ke) in enumerate((("aclnnCast", "Cast_7a1", 2.0, 2.2),
                                                  ("aclnnMatmul", "MatMulV2_9c2", 2.2, 7.0),
                                                  ("aclnnAdd", "Add_3f0", 7.0, 11.8))):
            a = b - 6.7 + 0.2 * i
            dev.append(Device(kernel, api, at(a), at(a + 0.05), at(b + ks), at(b + ke), 3 * n + i))
    return spans, dev


def _prof_id(pid: int) -> str:
    return f"ms_service_{HOST}-{pid}"


def _connect_wal(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode = WAL;")  # ServiceProfilerDbWriter.cpp
    return con


def write_raw_dbs(folder: Path, spans: list[Span], dev: list[Device], *, older: bool = False) -> list[Path]:
    """``ms_service_<host>-<pid>.db`` per process (``slice``, or ``Mstx`` when ``older``) + the MSPTI db."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for pid in sorted({s.pid for s in spans}):
        path = folder / f"{_prof_id(pid)}.db"
        con = _connect_wal(path)
        if older:
            con.execute("CREATE TABLE IF NOT EXISTS Mstx (message TEXT,flag INTEGER,markId INTEGER,timestamp INTEGER,"
                        "endTimestamp INTEGER,pid INTEGER,tid INTEGER);")
            con.execute("CREATE TABLE meta (name TEXT, value TEXT)")
            for i, s in enumerate(x for x in spans if x.pid == pid):
                msg = json.dumps({**s.args, "domain": s.domain, "name": s.name, "type": 2})  # profiler.py get_msg
                con.execute("INSERT INTO Mstx VALUES (?,?,?,?,?,?,?)", (msg, 2, i, s.start, s.end, s.pid, s.tid))
        else:
            con.execute("CREATE TABLE IF NOT EXISTS slice (id INTEGER PRIMARY KEY AUTOINCREMENT, timestamp INTEGER, "
                        "duration INTEGER, name TEXT, depth INTEGER, track_id INTEGER, cat TEXT, args TEXT, cname TEXT, "
                        "end_time INTEGER, flag_id TEXT, pid INTEGER, tid INTEGER);")
            con.execute("CREATE TABLE thread (track_id INTEGER PRIMARY KEY, tid INTEGER, pid INTEGER, thread_name TEXT, "
                        "thread_sort_index INTEGER)")
            con.execute("CREATE TABLE meta (name TEXT, value TEXT, slice TEXT)")
            for s in (x for x in spans if x.pid == pid):
                con.execute("INSERT OR IGNORE INTO thread VALUES (?,?,?,?,0)", (s.tid, s.tid, s.pid, f"{s.domain}({s.tid})"))
                con.execute("INSERT INTO slice (timestamp, duration, name, depth, track_id, cat, args, cname, end_time, "
                            "flag_id, pid, tid) VALUES (?,?,?,0,?,?,?,'',?,'',?,?)",
                            (s.start, s.end - s.start, s.name, s.tid, s.domain, json.dumps({**s.args, "type": 2}),
                             s.end, s.pid, s.tid))
        con.commit()
        con.close()
        out.append(path)
    if dev:
        path = folder / (f"ascend_service_profiler_{EXEC_PID}.db" if older else f"ascend_service_profiler_{HOST}-{EXEC_PID}.db")
        con = _connect_wal(path)
        con.execute("CREATE TABLE IF NOT EXISTS Api (name TEXT,start INTEGER,end INTEGER,processId INTEGER,"
                    "threadId INTEGER,correlationId INTEGER);")
        con.execute("CREATE TABLE IF NOT EXISTS Kernel (type TEXT,name TEXT,start INTEGER,end INTEGER,deviceId INTEGER,"
                    "streamId INTEGER,correlationId INTEGER);")
        for d in dev:
            con.execute("INSERT INTO Api VALUES (?,?,?,?,?,?)", (d.api, d.api_start, d.api_end, EXEC_PID, EXEC_TID, d.corr))
            con.execute("INSERT INTO Kernel VALUES ('KERNEL_AICORE',?,?,?,0,2,?)", (d.name, d.start, d.end, d.corr))
        con.commit()
        con.close()
        out.append(path)
    return out


def _us(ns: int) -> float:
    return ns / 1000  # tx_data_df start_time: ns / 1000 (db_data_source.py)


def chrome_events(spans: list[Span], dev: list[Device]) -> list[dict]:
    """exporter_trace.py: X rows ``tid = domain(tid)``; Api/Kernel rows with the Api's name, µs ints, ``args {}``."""
    ev: list[dict] = [{"name": "process_name", "ph": "M", "pid": SCHED_PID, "args": {"name": "schedule"}}]
    for s in spans:
        args = {k: v for k, v in s.args.items() if k != "batchType"}  # the parser maps batchType to batch_type
        if "batchType" in s.args:
            args["batch_type"] = ("Prefill", "Decode")[s.args["batchType"]]
        ev.append({"name": s.name, "ph": "X", "ts": _us(s.start), "dur": _us(s.end) - _us(s.start), "pid": s.pid,
                   "tid": f"{s.domain}({s.tid})", "args": {**args, "start_datetime": _dt(s.start)}})
    for d in dev:
        ev.append({"name": d.api, "ph": "X", "ts": d.api_start // 1000, "dur": d.api_end // 1000 - d.api_start // 1000,
                   "pid": EXEC_PID, "tid": "Api", "args": {}})
    for d in dev:
        ev.append({"name": d.api, "ph": "X", "ts": d.start // 1000, "dur": d.end // 1000 - d.start // 1000,
                   "pid": EXEC_PID, "tid": "Kernel", "args": {}})
    return ev


def write_chrome(folder: Path, spans: list[Span], dev: list[Device]) -> Path:
    path = folder / "chrome_tracing.json"
    path.write_text(json.dumps(chrome_events(spans, dev)))
    return path


def write_profiler_db(folder: Path, spans: list[Span], dev: list[Device]) -> Path:
    """trace_to_db.py: process/thread/slice from the chrome events; ``thread.pid`` TEXT; ns."""
    path = folder / "profiler.db"
    con = _connect_wal(path)
    con.execute("CREATE TABLE process (pid TEXT PRIMARY KEY, process_name TEXT, label TEXT, process_sort_index INTEGER);")
    con.execute("CREATE TABLE thread (track_id INTEGER PRIMARY KEY, tid TEXT, pid TEXT, thread_name TEXT, "
                "thread_sort_index INTEGER);")
    con.execute("CREATE TABLE slice (id INTEGER PRIMARY KEY AUTOINCREMENT, timestamp INTEGER, duration INTEGER, "
                "name TEXT, depth INTEGER, track_id INTEGER, cat TEXT, args TEXT, cname TEXT, end_time INTEGER, "
                "flag_id TEXT);")
    tracks: dict[tuple[str, str], int] = {}
    for e in chrome_events(spans, dev):
        if e["ph"] != "X":
            continue
        key = (str(e["pid"]), str(e["tid"]))
        if key not in tracks:
            tracks[key] = len(tracks) + 1
            con.execute("INSERT INTO thread VALUES (?,?,?,?,0)", (tracks[key], key[1], key[0], key[1]))
        ts = int(float(e["ts"]) * 1000)
        dur = int(float(e["dur"]) * 1000)
        con.execute("INSERT INTO slice (timestamp, duration, name, track_id, cat, args, cname, end_time, flag_id) "
                    "VALUES (?,?,?,?,NULL,?,NULL,?,NULL)", (ts, dur, e["name"], tracks[key], json.dumps(e["args"]), ts + dur))
    con.commit()
    con.close()
    return path


SHANGHAI = timezone(timedelta(hours=8))


def _dt(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, SHANGHAI).strftime("%Y-%m-%d %H:%M:%S:%f")


def write_csvs(folder: Path, spans: list[Span], *, older: bool = False) -> tuple[Path, Path]:
    """batch.csv and forward.csv in the current or the older (datetime-string) generation."""
    batch = folder / "batch.csv"
    rows = [s for s in spans if s.name in ("BatchSchedule", "Execute", "modelExec")]
    with batch.open("w", newline="") as fh:
        w = csv.writer(fh)
        if older:
            w.writerow(["name", "res_list", "start_time", "end_time", "during_time(ms)", "batch_type", "prof_id",
                        "total_batch_size"])
            for s in rows:
                w.writerow([s.name, "[]", _dt(s.start), _dt(s.end), (s.end - s.start) / MS, "Decode", _prof_id(s.pid), 4])
        else:
            w.writerow(["name", "res_list", "start_datetime", "end_datetime", "during_time", "batch_type", "prof_id",
                        "batch_size", "dp_rank", "start_time(ms)", "end_time(ms)"])
            for s in rows:
                w.writerow([s.name, "[]", _dt(s.start), _dt(s.end), (s.end - s.start) / MS, "Decode", _prof_id(s.pid), 4,
                            0, _us(s.start), _us(s.end)])
    forward = folder / "forward.csv"
    fwd = [s for s in spans if s.name == "forward"]
    with forward.open("w", newline="") as fh:
        w = csv.writer(fh)
        if older:
            w.writerow(["name", "relative_start_time(ms)", "start_time", "end_time", "during_time(ms)", "bubble_time(ms)",
                        "batch_size", "batch_type", "forward_iter", "dp_rank", "prof_id", "hostname"])
        else:
            w.writerow(["name", "relative_start_time(ms)", "start_datetime", "end_datetime", "during_time(ms)",
                        "bubble_time(ms)", "batch_size", "batch_type", "forward_iter", "dp_rank", "prof_id", "hostname",
                        "start_time(ms)", "end_time(ms)"])
        for i, s in enumerate(fwd):
            rel = (s.start - fwd[0].start) / MS
            bubble = (fwd[i + 1].start - s.end) / MS if i + 1 < len(fwd) else ""
            base = [s.name, rel]
            tail = [(s.end - s.start) / MS, bubble, 4, "Decode", i + 1, 0, _prof_id(s.pid), HOST]
            if older:
                w.writerow(base + [_dt(s.start), _dt(s.end)] + tail)
            else:
                w.writerow(base + [_dt(s.start), _dt(s.end)] + tail + [_us(s.start) / 1000, _us(s.end) / 1000])
    return batch, forward


def write_parse_folder(folder: Path, *, older: bool = False, raw: bool = True) -> Path:
    """The normal parse output folder (chrome_tracing.json, batch.csv, forward.csv, profiler.db) + raw DBs."""
    spans, dev = mindie_async()
    folder.mkdir(parents=True, exist_ok=True)
    write_chrome(folder, spans, dev)
    write_profiler_db(folder, spans, dev)
    write_csvs(folder, spans, older=older)
    if raw:
        write_raw_dbs(folder / "raw", spans, dev, older=older)
    return folder


def write_request_csv(folder: Path, latencies_ms: list[int], *, older: bool = False, tokens: int = 100) -> Path:
    """request.csv as ``exporters/exporter_req_data.py`` writes it (``execution_time`` = end//1000 - start//1000 ms;
    the current parser appends ``start_time(ms)``, integer epoch ms)."""
    path = folder / "request.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        head = ["http_rid", "start_datetime", "recv_token_size", "reply_token_size", "execution_time(ms)",
                "queue_wait_time(ms)", "first_token_latency(ms)", "cache_hit_rate"]
        w.writerow(head if older else head + ["start_time(ms)"])
        for i, lat in enumerate(latencies_ms):
            start = T0_NS + i * 100 * MS
            row = [f"req{i}", _dt(start), 32, tokens, lat, 1.5, 20.0, "N/A"]
            w.writerow(row if older else row + [start // MS])
    return path
