"""``kvtrace serve-replica``: an OpenAI-compatible streaming server whose model is the threaded replica.

``engine`` (continuous batching over the replica's layerwise pipeline), ``server`` (HTTP routes),
``kvconfig`` (vLLM's ``--kv-transfer-config`` JSON), ``run`` (process lifecycle, tracing, signals).
"""

from otel_kvtrace.serve.run import ServeOptions, serve_replica

__all__ = ["ServeOptions", "serve_replica"]
