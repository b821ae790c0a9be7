"""Shared helpers for the analysis tests: the synthetic OTLP/JSON writer lives in bench/."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_traces import QueueSpec, simulate_queue, write_otlp_json  # bench/, on sys.path via tests/conftest.py


@pytest.fixture(scope="session")
def synthetic_trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two queues (two configs) of a realistic synthetic workload with HOL, one of them bounded."""
    out = tmp_path_factory.mktemp("traces")
    hol = QueueSpec(run_id="runA", pid=11, cfg_label="synthetic hol")
    bounded = QueueSpec(run_id="runB", pid=12, cfg_label="synthetic bounded", path="key")
    write_otlp_json(out / "a.jsonl", [(hol, simulate_queue(hol, 400, seed=1, hol_probability=0.2))],
                    with_send_tasks=True)
    write_otlp_json(out / "b.jsonl.gz", [(bounded, simulate_queue(bounded, 300, seed=2, hol_probability=0.2,
                                                                  bounded_probability=0.5))])
    return out
