"""serve-replica + the load generator: real processes, real HTTP, real traces."""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.load import load_traces
from otel_kvtrace.loadgen import LoadProfile, run_load
from otel_kvtrace.replica.config import ReplicaConfig, ReplicaConfigError
from otel_kvtrace.serve.kvconfig import parse_kv_transfer_config
from tests.serve.conftest import serve_replica, wait_exit


def _server_log(data_dir: Path) -> dict[str, dict]:
    out = {}
    for path in (data_dir / "requests").glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            rec = orjson.loads(line)
            out[rec["request_id"]] = rec
    return out


def test_ttft_agrees_with_server_first_token_time_and_ids_join_kv_tasks(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_replica(data) as (url, proc):
        result = run_load(LoadProfile(url, "/v1/chat/completions", None, num_requests=12, concurrency=3,
                                      prompt_len=300, output_len=4))
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc) == 0
    assert result.summary()["failed"] == 0, result.summary()["errors"]
    server = _server_log(data)
    # TTFT agreement: the client's first chunk with a choice (the role chunk, sent with the first token as
    # vLLM does) against the server's first-token time, both on this host's clock: median within 1 ms
    gaps = [abs(r.first_token_unix_ns - server[r.request_id]["first_token_unix_ns"]) for r in result.requests]
    assert statistics.median(gaps) <= 1_000_000, sorted(gaps)
    for r in result.requests:
        s = server[r.request_id]
        assert s["output_tokens"] == r.output_tokens == 4
        # ordering only (no timing threshold): the server's first token falls inside the client's request
        assert r.start_unix_ns <= s["first_token_unix_ns"] <= r.end_unix_ns
        assert r.start_unix_ns <= r.first_token_unix_ns <= r.end_unix_ns
        assert len(r.itl_ms) == 4  # first chunk with a choice = the role chunk, as vllm bench serve
    con = load_traces(data / "traces").con
    kv_ids = {row[0] for row in con.sql("SELECT DISTINCT unnest(request_ids) FROM tasks").fetchall()}
    assert {r.request_id for r in result.requests} <= kv_ids  # chat ids are the KV ids themselves


def test_completion_ids_join_by_prefix_and_tpot_follows_the_step_time(server) -> None:
    url, _proc, _data = server
    result = run_load(LoadProfile(url, "/v1/completions", None, num_requests=4, concurrency=1, prompt_len=50,
                                  output_len=6))
    s = result.summary()
    assert s["completed"] == 4 and s["total_output_tokens"] == 24
    assert all(r.request_id.startswith("cmpl-") and len(r.itl_ms) == 5 for r in result.requests)
    assert s["tpot_ms"]["p50"] > 0 and s["itl_ms"]["n"] == 20


def test_killed_server_mid_run_is_reported_not_a_traceback(tmp_path: Path) -> None:
    with serve_replica(tmp_path / "data") as (url, proc):
        load = subprocess.Popen([sys.executable, "-m", "otel_kvtrace.cli", "load", "--base-url", url, "-n", "6",
                                 "-c", "3", "--output-len", "400", "--prompt-len", "10", "--no-spans"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = tmp_path / "data" / "requests"
        deadline = time.monotonic() + 60  # kill once the server has streamed: the first request log line
        while time.monotonic() < deadline and not any(p.stat().st_size for p in first.glob("*.jsonl")):
            time.sleep(0.05)
        proc.kill()
        out, err = load.communicate(timeout=60)
    assert load.returncode == 1, (out, err)
    assert "Traceback" not in err + out
    assert "requests failed" in err
    assert "server disconnected mid-stream" in err  # the in-flight ones; later ones are refused


def test_health_models_and_bad_request(server) -> None:
    import urllib.error
    import urllib.request

    url, _proc, _data = server
    assert urllib.request.urlopen(f"{url}/health").status == 200
    models = orjson.loads(urllib.request.urlopen(f"{url}/v1/models").read())
    assert models["data"][0]["id"] == "kvtrace-replica"
    req = urllib.request.Request(f"{url}/v1/completions", data=b'{"prompt": "x", "max_tokens": 0}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and b"max_tokens" in err.value.read()


def test_kv_transfer_config_sets_the_layerwise_keys() -> None:
    text = ('{"kv_connector":"AscendStoreConnector","kv_connector_extra_config":{"layerwise_num_shared_buffers":"3",'
            '"layerwise_prefetch_layers":2,"layerwise_independent_layers":[0,-1],"replica_buffer_reuse":false}}')
    cfg = parse_kv_transfer_config(text, ReplicaConfig(num_layers=8))
    assert (cfg.resolved_buffers, cfg.resolved_prefetch, cfg.resolved_independent, cfg.buffer_reuse) == (
        3, 2, (0, 7), False)
    with pytest.raises(ReplicaConfigError, match="independent_layers"):
        parse_kv_transfer_config('{"kv_connector_extra_config":{"layerwise_independent_layers":[9]}}', cfg)


def test_bad_kv_transfer_config_is_a_clear_cli_error() -> None:
    result = CliRunner().invoke(main, ["serve-replica", "--kv-transfer-config", "{not json"])
    assert result.exit_code == 2 and "not JSON" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_run_id_cannot_escape_the_data_dir(tmp_path: Path) -> None:
    from otel_kvtrace.loadgen.model import LoadResult, RequestResult
    from otel_kvtrace.loadgen.spans import export_request_spans
    from otel_kvtrace.resources.sampler import resources_path

    data = tmp_path / "a" / "b" / "data"
    evil = "x/../../../escaped"
    with serve_replica(data, "--run-id", evil) as (url, proc):
        result = run_load(LoadProfile(url, "/v1/completions", None, num_requests=1, concurrency=1, prompt_len=5,
                                      output_len=2))
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc) == 0
    assert result.summary()["failed"] == 0
    export_request_spans(LoadResult({}, [RequestResult(0, "r", 1, 2, 3)], 1.0), data, evil)
    assert resources_path(data, evil).resolve().is_relative_to(data.resolve())
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.resolve().is_relative_to(data.resolve()) for p in written), written


@pytest.mark.parametrize("how", ["env", "flag"])
def test_serve_replica_runs_under_the_requested_scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          how: str) -> None:
    data = tmp_path / "data"
    args: tuple[str, ...] = ()
    if how == "env":
        monkeypatch.setenv("OTEL_KVTRACE_SCHEDULER", "ready_queue")
    else:
        args = ("--scheduler", "ready_queue")
    with serve_replica(data, *args) as (url, proc):
        result = run_load(LoadProfile(url, "/v1/completions", None, num_requests=2, concurrency=2, prompt_len=300,
                                      output_len=2))
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc) == 0
    assert result.summary()["failed"] == 0
    con = load_traces(data / "traces").con
    assert con.execute("SELECT DISTINCT cfg_scheduler FROM tasks").fetchall() == [("ready_queue",)]
