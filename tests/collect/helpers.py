"""Shared helpers for the receiver tests: run `kvtrace collect` as a process, read the files it wrote."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from otel_kvtrace.export.otlp_json import json_line_to_request

SENDER = Path(__file__).with_name("sender.py")
_LISTEN = re.compile(r"listening on grpc [^:]+:(\d+), http [^:]+:(\d+)/v1/traces")


class CollectProcess:
    """`python -m otel_kvtrace.cli collect` on free ports, with its stderr captured."""

    def __init__(self, out_dir: Path, *extra: str, grpc_port: int = 0, http_port: int = 0,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_kvtrace.cli", "collect", "--out", str(out_dir),
             "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--status-interval", "0", *extra],
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - only resource limits, set before exec
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 30
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError(f"kvtrace collect exited early: {''.join(self.lines)}")
            self.lines.append(line)
            m = _LISTEN.search(line)
            if m:
                self.grpc_port, self.http_port = int(m.group(1)), int(m.group(2))
                return
        raise AssertionError("kvtrace collect did not report its ports")

    def terminate(self, sig: int) -> tuple[int, str]:
        """Send ``sig``; return (exit code, the rest of stderr)."""
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, "".join(self.lines) + err


def run_senders(jobs: list[tuple[str, str, int, Path]]) -> list[list[tuple[str, str]]]:
    """Start every (protocol, endpoint, n, ids_file) sender process at once; wait; return their span ids."""
    procs = [
        subprocess.Popen([sys.executable, str(SENDER), proto, endpoint, str(n), str(ids)], stderr=subprocess.PIPE)
        for proto, endpoint, n, ids in jobs
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    import json

    return [[tuple(pair) for pair in json.loads(ids.read_text())] for *_, ids in jobs]


def collected_span_ids(out_dir: Path) -> Counter[tuple[str, str]]:
    """(trace_id, span_id) hex -> how often it appears in every *.jsonl under ``out_dir``.

    Every line must parse with the project's OTLP/JSON codec.
    """
    seen: Counter[tuple[str, str]] = Counter()
    for path in sorted(out_dir.glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            req = json_line_to_request(line)
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        seen[(span.trace_id.hex(), span.span_id.hex())] += 1
    return seen
