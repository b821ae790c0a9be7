"""OTLP/gRPC ``TraceService/Export`` and ``MetricsService/Export`` endpoint.

Each method is registered with raw-bytes (de)serialisation so that a body that does not decode is answered
with INVALID_ARGUMENT and counted here, instead of grpcio's generic INTERNAL "Exception deserializing".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo

from otel_kvtrace.collect.queue import MemoryBudget
from otel_kvtrace.collect.stats import StatsCounter
from otel_kvtrace.collect.validate import SIGNALS, AcceptFn, MalformedRequest, Signal

_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
_log = logging.getLogger(__name__)


def _retry_info(seconds: float) -> bytes:
    delay = Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return RetryInfo(retry_delay=delay).SerializeToString()


class GrpcEndpoint:
    """A grpc server with one Export method per signal, bound to ``host:port`` (port 0 picks a free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        accept: AcceptFn,
        on_malformed: Callable[[], None],
        max_request_bytes: int,
        memory: MemoryBudget,
        stats: StatsCounter,
        max_workers: int = 8,
        retry_after_s: float = 0.5,
    ) -> None:
        self._accept = accept
        self._on_malformed = on_malformed
        self._memory = memory
        self._stats = stats
        self._retry_after_s = retry_after_s
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvtrace-collect-grpc"),
            options=[
                ("grpc.so_reuseport", 0),  # a taken port must fail to bind, not be shared
                # applies to the decompressed message: grpc-encoding gzip cannot inflate past it
                ("grpc.max_receive_message_length", max_request_bytes),
                ("grpc.max_concurrent_streams", max_workers),
            ],
        )
        self._server.add_generic_rpc_handlers(tuple(
            grpc.method_handlers_generic_handler(signal.grpc_service, {"Export": self._handler(signal)})
            for signal in SIGNALS))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind {address}: {exc}") from exc
        if bound == 0:
            raise OSError(f"cannot bind {address}")
        self.port = bound

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float) -> None:
        """Refuse new RPCs and wait up to ``grace_s`` for running ones to finish."""
        self._server.stop(grace_s).wait()

    def _handler(self, signal: Signal) -> grpc.RpcMethodHandler:
        """bytes in, bytes out: decoding happens in ``_export_reserved``, where a failure is counted."""
        return grpc.unary_unary_rpc_method_handler(lambda body, context: self._export(signal, body, context))

    def _export(self, signal: Signal, body: bytes, context: grpc.ServicerContext) -> bytes:
        """Decode, hand to the receiver, answer; grpcio has already decompressed and size-checked ``body``."""
        if not self._memory.try_reserve(len(body)):
            self._stats.add(refused_memory=1)
            self._abort_retry(context, "receiver memory budget in use by other requests; retry")
        try:
            return self._export_reserved(signal, body, context)
        finally:
            self._memory.release(len(body))

    def _export_reserved(self, signal: Signal, body: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            req = signal.decode_protobuf(body)
        except MalformedRequest as exc:
            self._on_malformed()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            result = self._accept(signal, req, len(body))
        except Exception:  # noqa: BLE001 - a bug must cost one request an INTERNAL answer, never the server
            _log.exception("kvtrace collect: unexpected error handling a gRPC request")
            self._stats.add(internal_errors=1)
            context.abort(grpc.StatusCode.INTERNAL, "internal error in kvtrace collect")
        if result.response is not None:
            return result.response.SerializeToString()
        if result.too_large:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, result.message)
        if result.queue_full:
            self._abort_retry(context, result.message)
        context.abort(grpc.StatusCode.UNAVAILABLE, result.message)
        raise AssertionError("unreachable")  # abort raises

    def _abort_retry(self, context: grpc.ServicerContext, message: str) -> None:
        context.set_trailing_metadata(((_RETRY_INFO_KEY, _retry_info(self._retry_after_s)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
