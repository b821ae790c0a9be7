"""Importer for `vllm bench serve --save-result` (keys from vllm/benchmarks/serve.py benchmark()/main)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from otel_kvtrace.cli import main
from otel_kvtrace.loadgen import read_vllm_bench
from otel_kvtrace.loadgen.vllm_bench import VllmBenchError


def _vllm_result(detailed: bool) -> dict:
    """The dict vLLM's `main` writes: its header keys, then `benchmark()`'s result dict."""
    doc = {
        "date": "20260101-000000", "backend": "openai-chat", "label": None, "model_id": "m", "tokenizer_id": "m",
        "num_prompts": 3, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 2,
        "duration": 2.0, "completed": 2, "failed": 1, "total_input_tokens": 30, "total_output_tokens": 8,
        "request_throughput": 1.0, "request_goodput": None, "output_throughput": 4.0, "total_token_throughput": 19.0,
        "input_lens": [10, 10, 10], "output_lens": [4, 4, 0], "ttfts": [0.1, 0.3, 0.0],
        "itls": [[0.01, 0.02, 0.03], [0.02, 0.02, 0.02], []], "latencies": [0.16, 0.36, 0.0],
        "start_times": [100.0, 100.5, 101.0], "queue_times": [0.0, 0.0, 0.0], "generated_texts": ["a", "b", ""],
        "errors": ["", "", "Traceback ... ServerDisconnectedError"], "max_output_tokens_per_s": 5.0,
        "max_concurrent_requests": 2, "rtfx": 0.0,
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "std_ttft_ms": 100.0, "p99_ttft_ms": 298.0,
    }
    if not detailed:
        for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
            doc.pop(key)
    return doc


def test_detailed_result_gives_per_request_ttft_tpot_itl(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(orjson.dumps(_vllm_result(True)))
    [run] = read_vllm_bench(path)
    s = run.summary()
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["n"] == 6
    # TPOT = (latency - ttft) / (output - 1): (160-100)/3 = 20, (360-300)/3 = 20
    assert s["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert s["output_throughput_tok_s"] == pytest.approx(4.0)


def test_run_level_only_and_append_result_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(orjson.dumps(_vllm_result(False)) + b"\n" + orjson.dumps(_vllm_result(True)))
    a, b = read_vllm_bench(path)
    assert a.requests == [] and a.profile["vllm_summary"]["median_ttft_ms"] == 200.0
    assert len(b.requests) == 3
    out = CliRunner().invoke(main, ["load", "--from-vllm-bench", str(path)])
    assert out.exit_code == 0 and "run-level only" in out.output


def test_not_a_vllm_result_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(b'{"duration": 1, "completed": 1}\n{"oops": 1}\n')
    with pytest.raises(VllmBenchError, match=r"r\.json:2: not a `vllm bench serve"):
        read_vllm_bench(path)
    out = CliRunner().invoke(main, ["load", "--from-vllm-bench", str(path)])
    assert out.exit_code == 1 and "r.json:2" in out.output and out.exception is None or isinstance(
        out.exception, SystemExit)


def test_perf_counter_start_times_are_anchored_on_the_date(tmp_path: Path) -> None:
    import datetime as dt

    path = tmp_path / "r.json"
    path.write_bytes(orjson.dumps(_vllm_result(True)))  # start_times 100.0, 100.5, 101.0 (perf_counter s)
    [run] = read_vllm_bench(path)
    end = dt.datetime.strptime("20260101-000000", "%Y%m%d-%H%M%S").timestamp()
    starts = [r.start_unix_ns for r in run.requests]
    assert starts[0] == int((end - 2.0) * 1e9)  # date (after the run) - duration
    assert starts[1] - starts[0] == 500_000_000 and starts[2] - starts[0] == 1_000_000_000
    assert run.profile["clock"].startswith("date - duration")
    doc = _vllm_result(True)
    doc["date"] = None
    path.write_bytes(orjson.dumps(doc))
    [rel] = read_vllm_bench(path)
    assert rel.profile["clock"] == "relative" and rel.requests[0].start_unix_ns == 0


@pytest.mark.parametrize(("key", "value"), [("duration", "abc"), ("ttfts", 5), ("itls", [["x"], [], []]),
                                            ("latencies", ["a", 0.1, 0.2])])
def test_wrong_types_name_the_file_and_key(tmp_path: Path, key: str, value: object) -> None:
    doc = _vllm_result(True)
    doc[key] = value
    path = tmp_path / "r.json"
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(VllmBenchError, match=rf"r.json:1: '{key}"):
        read_vllm_bench(path)
    out = CliRunner().invoke(main, ["load", "--from-vllm-bench", str(path)])
    assert out.exit_code != 0 and "Traceback" not in out.output and key in out.output
