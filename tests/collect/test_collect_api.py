"""``otel_kvtrace.collect.collect``: the foreground API the CLI wraps (stop event, progress lines, counts)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import requests

from otel_kvtrace.collect import ReceiverStats, collect


def test_collect_reports_where_it_listens_progress_and_final_counts(tmp_path: Path) -> None:
    lines: list[str] = []
    stop = threading.Event()
    result: list[ReceiverStats] = []
    runner = threading.Thread(
        target=lambda: result.append(
            collect(out=tmp_path, grpc_port=None, http_port=0, status_interval=0.05, stop_event=stop,
                    progress=lines.append)
        )
    )
    runner.start()
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    m = re.search(r"listening on http 127\.0\.0\.1:(\d+)/v1/traces; writing (\S+)", lines[0])
    assert m, lines
    r = requests.post(f"http://127.0.0.1:{m.group(1)}/v1/traces", data=b"\x0a\xff",
                      headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400
    while not any("malformed 0 grpc + 1 http" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.01)  # the periodic status line reports the change
    stop.set()
    runner.join(10)
    assert not runner.is_alive()
    (stats,) = result
    assert stats.malformed_http == 1 and stats.http_requests == 0
    assert "malformed 0 grpc + 1 http" in lines[-1]
    assert Path(m.group(2)).parent == tmp_path
