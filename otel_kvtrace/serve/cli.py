"""``kvtrace serve-replica`` command line."""

from __future__ import annotations

import os
from pathlib import Path

import click

from otel_kvtrace import config


@click.command("serve-replica")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="0 picks a free port (printed).")
@click.option("--model", default="kvtrace-replica", show_default=True, help="Served model name.")
@click.option("--preset", default="hol", show_default=True,
              help="Replica scenario the model starts from (kvtrace demo's presets: hol, fifo-optimal, ...).")
@click.option("--kv-transfer-config", "kv_config", help="vLLM's JSON; layerwise keys in kv_connector_extra_config.")
@click.option("--num-layers", type=int, help="Layers N of the replica model (default: the preset's).")
@click.option("--max-num-seqs", type=int, default=8, show_default=True, help="Running requests per step.")
@click.option("--block-tokens", type=int, default=128, show_default=True, help="Prompt tokens per KV block.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help=f"Traces and request log (default ${config.OTEL_KVTRACE_DATA_DIR} or ./kvtrace-data).")
@click.option("--run-id", help=f"Trace run id (default ${config.OTEL_KVTRACE_RUN_ID} or serve-<time>-<pid>).")
@click.option("--scheduler", help=f"Live recv policy (fifo, ready_queue, gate_group; default ${config.OTEL_KVTRACE_SCHEDULER} "
                                   "or fifo), recorded as kvtrace.cfg.scheduler.")
@click.option("--no-trace", is_flag=True, help="Serve without tracing.")
@click.option("--no-resources", is_flag=True, help="No per-step resource series (DATA_DIR/metrics, OTel gauges).")
def serve_replica_command(host: str, port: int, model: str, preset: str, kv_config: str | None,
                          num_layers: int | None, max_num_seqs: int, block_tokens: int, seed: int,
                          data_dir: Path | None, run_id: str | None, scheduler: str | None, no_trace: bool,
                          no_resources: bool) -> None:
    """OpenAI-compatible streaming server whose model runs the threaded replica's layerwise pipeline.

    Serves /health, /v1/models, /v1/completions and /v1/chat/completions (stream: true -> SSE). Each
    engine step admits waiting requests (up to --max-num-seqs running), runs one forward step of the
    replica (real recv/send threads, KV load and save tasks for the step's prefills, traced like
    vLLM-Ascend) and gives every running request one token. Traces go to DATA_DIR/traces (or OTLP
    when OTEL_EXPORTER_OTLP_ENDPOINT is set), the server-side first-token times to
    DATA_DIR/requests/. SIGTERM or Ctrl-C stops it cleanly.

    \b
    Example:
        kvtrace serve-replica --port 8000 --kv-transfer-config \\
          '{"kv_connector":"AscendStoreConnector","kv_role":"kv_both",
            "kv_connector_extra_config":{"layerwise_num_shared_buffers":2,"layerwise_prefetch_layers":4,
                                         "layerwise_independent_layers":[0,4]}}'
        kvtrace load --base-url http://127.0.0.1:8000 --num-requests 32 --concurrency 4
    """
    from otel_kvtrace.demo import PRESETS
    from otel_kvtrace.replica.config import ReplicaConfigError
    from otel_kvtrace.schedule.install import check_scheduler, from_env
    from otel_kvtrace.serve.kvconfig import parse_kv_transfer_config
    from otel_kvtrace.serve.run import ServeOptions, serve_replica

    if preset not in PRESETS:
        raise click.BadParameter(f"must be one of {sorted(PRESETS)}", param_hint="--preset")
    base = PRESETS[preset]
    try:
        changes: dict[str, object] = {"seed": seed, "scheduler": from_env(merged_copy=True)}
        if scheduler is not None:
            try:
                changes["scheduler"] = check_scheduler(scheduler, merged_copy=True)  # the replica can merge
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--scheduler") from exc
        if num_layers is not None:
            changes.update(num_layers=num_layers, independent_layers=(0,),
                           slow=type(base.slow)())  # the preset's layer choices may not exist any more
        cfg = parse_kv_transfer_config(kv_config, base.with_(**changes))
    except ReplicaConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-transfer-config") from exc
    if max_num_seqs < 1 or block_tokens < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-num-seqs/--block-tokens")
    data = data_dir or Path(os.environ.get(config.OTEL_KVTRACE_DATA_DIR) or config.DEFAULT_DATA_DIR)
    try:
        code = serve_replica(ServeOptions(cfg, host, port, model, data, max_num_seqs, block_tokens, not no_trace,
                                          run_id or os.environ.get(config.OTEL_KVTRACE_RUN_ID) or None,
                                          not no_resources))
    except OSError as exc:  # port in use, unwritable data dir
        raise click.ClickException(str(exc)) from exc
    raise SystemExit(code)
