"""``kvtrace load``: request-level truth (TTFT, TPOT, ITL, throughput) from an OpenAI-compatible server.

``client`` (the generator), ``model`` (results and summary), ``spans`` (request spans through the OTel
SDK), ``vllm_bench`` (importer for ``vllm bench serve --save-result`` JSON).
"""

from otel_kvtrace.loadgen.client import LoadProfile, run_load
from otel_kvtrace.loadgen.model import LoadResult, RequestResult
from otel_kvtrace.loadgen.vllm_bench import read_vllm_bench

__all__ = ["LoadProfile", "LoadResult", "RequestResult", "read_vllm_bench", "run_load"]
