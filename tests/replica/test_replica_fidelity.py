"""Fidelity to upstream points a reviewer checked against the real sources (0.23.0.post1 and main)."""

from __future__ import annotations

from otel_kvtrace.record.model import NO_TIME
from otel_kvtrace.replica.config import ReplicaConfig
from otel_kvtrace.replica.simulate import simulate
from otel_kvtrace.replica.threaded import run_threaded

KEY = ReplicaConfig(path="key", num_layers=4, prefetch_layers=2, steps=2)


def test_key_path_never_releases_leases_in_either_engine() -> None:
    """Upstream's ``KVCacheStoreKeyLayerRecvingThread`` has no ``batch_remove_lease`` call."""
    assert run_threaded(KEY).lease_releases == []
    res = simulate(KEY)
    assert [s.lease_release_ns for s in res.steps] == [NO_TIME] * KEY.steps
    final = [r for r in res.recv if r.final_layer]
    assert final and all(r.t_complete == r.t_backend_return for r in final)
    # the GVA path still releases them once per step, after the final layer's copy
    gva = simulate(KEY.with_(path="gva"))
    assert all(s.lease_release_ns > 0 for s in gva.steps)
