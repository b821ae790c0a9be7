"""``kvtrace load`` command line."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import click
import orjson

from otel_kvtrace import config


@click.command("load")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--endpoint", default="/v1/completions", show_default=True,
              type=click.Choice(["/v1/completions", "/v1/chat/completions"]))
@click.option("--model", help="Model name (default: the first of /v1/models).")
@click.option("--num-requests", "-n", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--request-rate", type=float, default=math.inf, show_default=True, help="Poisson arrivals/s.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True, help="Prompt words.")
@click.option("--output-len", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per answer.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True, help="Per request, s.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), help="Write results JSON here.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help=f"Request spans go to DATA_DIR/traces (default ${config.OTEL_KVTRACE_DATA_DIR} or ./kvtrace-data).")
@click.option("--run-id", help="Run id of the request spans (default load-<time>).")
@click.option("--no-spans", is_flag=True, help="Do not export request spans.")
@click.option("--from-vllm-bench", "vllm_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Import a `vllm bench serve --save-result` JSON instead of sending requests.")
def load_command(base_url: str, endpoint: str, model: str | None, num_requests: int, concurrency: int,
                 request_rate: float, prompt_len: int, output_len: int, seed: int, timeout_s: float,
                 out: Path | None, data_dir: Path | None, run_id: str | None, no_spans: bool,
                 vllm_file: Path | None) -> None:
    """Streaming load against an OpenAI-compatible server: per-request TTFT, TPOT, ITL, throughput.

    Works against vLLM's OpenAI server and `kvtrace serve-replica`. Each request is one span
    (kvtrace.load.request) whose kvtrace.request_id joins the KV tasks' kvtrace.request_ids. Failed
    requests (server gone, refused, HTTP error) are counted and named; the exit code is 1 when any failed.

    \b
    Example:
        kvtrace load --base-url http://127.0.0.1:8000 -n 64 -c 8 --prompt-len 1024 --output-len 32 --out run1.json
        kvtrace load --from-vllm-bench vllm-result.json --out run1.json
    """
    from otel_kvtrace.loadgen.client import LoadProfile, run_load
    from otel_kvtrace.loadgen.model import LoadResult

    if vllm_file is not None:
        from otel_kvtrace.loadgen.vllm_bench import VllmBenchError, read_vllm_bench

        try:
            runs = read_vllm_bench(vllm_file)
        except VllmBenchError as exc:
            raise click.ClickException(str(exc)) from exc
        for run in runs:
            print_summary(run)
        if out is not None:
            docs = [r.to_json() for r in runs]
            out.write_bytes(orjson.dumps(docs[0] if len(docs) == 1 else docs, option=orjson.OPT_INDENT_2))
        return
    profile = LoadProfile(base_url.rstrip("/"), endpoint, model, num_requests, concurrency, request_rate,
                          prompt_len, output_len, seed, timeout_s)
    result: LoadResult = _run_with_progress(profile)
    print_summary(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2))
    if not no_spans:
        from otel_kvtrace.loadgen.spans import export_request_spans

        rid = run_id or f"load-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        delivery = export_request_spans(result, data_dir or Path(config.data_dir()), rid)
        click.echo(f"request spans: {delivery.line()}")
    failed = result.summary()["failed"]
    if failed:
        click.echo(f"error: {failed} of {len(result.requests)} requests failed: "
                   + "; ".join(result.summary()["errors"]), err=True)
        raise SystemExit(1)


def _run_with_progress(profile: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from otel_kvtrace.loadgen.client import run_load

    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        bar = progress.add_task("requests", total=profile.num_requests)
        return run_load(profile, on_done=lambda _r: progress.advance(bar))


def print_summary(result: Any) -> None:
    """One line per metric: p50/p95/p99 of TTFT, TPOT, ITL and the throughputs."""
    s = result.summary()
    if not result.requests and "vllm_summary" in result.profile:
        v = result.profile["vllm_summary"]
        click.echo(f"{result.source}: run-level only (saved without --save-detailed): completed {v.get('completed')}, "
                   f"median TTFT {v.get('median_ttft_ms')} ms, p99 TTFT {v.get('p99_ttft_ms')} ms, "
                   f"output {v.get('output_throughput')} tok/s")
        return
    click.echo(f"{result.source}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s; "
               f"output {s['output_throughput_tok_s']:.1f} tok/s, {s['request_throughput_req_s']:.2f} req/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        p = s[key]
        if p["n"]:
            click.echo(f"  {key[:-3].upper():5} p50 {p['p50']:.2f} ms  p95 {p['p95']:.2f} ms  p99 {p['p99']:.2f} ms")
