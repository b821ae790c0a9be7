"""Per-worker resource attributes read from a real ``KVPoolWorker`` and main's real layout builder."""

from __future__ import annotations

import importlib

import pytest

from otel_kvtrace.instrument.upstream import worker_resource_attributes

from .harness import FakeBackend, Upstream, pool_worker

pytestmark = pytest.mark.upstream


def test_ranks_role_and_defaults(upstream: Upstream) -> None:
    worker = pool_worker(upstream, 4, 2, FakeBackend())
    worker.tp_rank, worker.tp_size, worker.dp_rank = 3, 4, 1
    attrs = worker_resource_attributes(worker, upstream.binding.layout)
    assert attrs["kvtrace.rank.tp"] == 3 and attrs["kvtrace.rank.tp_size"] == 4 and attrs["kvtrace.rank.dp"] == 1
    assert attrs["kvtrace.role"] == "kv_both"
    assert attrs["kvtrace.cfg.num_layers"] == 4 and attrs["kvtrace.cfg.prefetch_layers"] == 2
    assert attrs["kvtrace.cfg.buffer_reuse"] is False
    assert attrs["kvtrace.cfg.label"].startswith(f"{upstream.binding.layout} gva N=4 ")


def test_main_reuse_layout_is_described_as_upstream_builds_it(upstream: Upstream) -> None:
    pw = importlib.import_module(upstream.binding.modules["pool_worker"])
    build = getattr(pw, "build_layerwise_cache_layout", None)
    if build is None:  # 0.23: no buffer reuse at all; the worker has no such fields
        assert not upstream.binding.flags["recv_save_npu_sync"]
        worker = pool_worker(upstream, 8, 1, FakeBackend())
        attrs = worker_resource_attributes(worker, upstream.binding.layout)
        assert (attrs["kvtrace.cfg.num_shared_buffers"], attrs["kvtrace.cfg.independent_layers"]) == (8, "")
        return
    extra = {"layerwise_num_shared_buffers": 2, "layerwise_prefetch_layers": 4, "layerwise_independent_layers": [0, 4]}
    layout = build(8, extra)  # upstream's own function, as KVPoolWorker.__init__ calls it
    worker = pool_worker(upstream, 8, layout.num_prefetch_layers, FakeBackend())
    worker._extra_config = extra
    worker._layerwise_reuse_layout = None
    worker.layerwise_offload = layout.has_layer_reuse
    worker.independent_layers = layout.independent_layers
    worker.prefetch_layer_map = layout.prefetch_layer_map
    attrs = worker_resource_attributes(worker, "main")
    assert attrs["kvtrace.cfg.num_shared_buffers"] == 2
    assert attrs["kvtrace.cfg.prefetch_layers"] == 4
    assert attrs["kvtrace.cfg.independent_layers"] == "0,4"
    assert attrs["kvtrace.cfg.buffer_reuse"] is True
    assert attrs["kvtrace.cfg.label"] == "main gva N=8 B=2 P=4 indep=0,4"
    worker._extra_config = {}  # no explicit B: main's default applies (B = N, so no reuse)
    default_b = build(8, {}).num_shared_buffers
    assert worker_resource_attributes(worker, "main")["kvtrace.cfg.num_shared_buffers"] == default_b
