"""``--kv-transfer-config`` JSON (vLLM's flag) -> the replica's ``ReplicaConfig``.

The layerwise keys are read from ``kv_connector_extra_config`` under vLLM-Ascend's names
(``layerwise_prefetch_layers`` P, ``layerwise_num_shared_buffers`` B, ``layerwise_independent_layers``),
so one matrix template renders the command of the real server and of the stand-in. Upstream has no
buffer-reuse switch (reuse follows from B < N on the GVA path); the replica's switch is the extra key
``replica_buffer_reuse``, and ``replica_path`` (``gva``/``key``) and ``replica_behaviour`` pick the
replica's path and upstream version.
"""

from __future__ import annotations

from typing import Any

import orjson

from otel_kvtrace.replica.config import ReplicaConfig, ReplicaConfigError

_KEYS = {
    "layerwise_prefetch_layers": "prefetch_layers",
    "layerwise_num_shared_buffers": "num_shared_buffers",
    "layerwise_independent_layers": "independent_layers",
    "replica_buffer_reuse": "buffer_reuse",
    "replica_path": "path",
    "replica_behaviour": "behaviour",
}


def parse_kv_transfer_config(text: str | None, base: ReplicaConfig) -> ReplicaConfig:
    """Apply the layerwise keys of ``text`` to ``base``; ``ReplicaConfigError`` names a bad key."""
    if not text:
        return base.validate()
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ReplicaConfigError(f"--kv-transfer-config: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ReplicaConfigError("--kv-transfer-config: must be a JSON object")
    extra = doc.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ReplicaConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    changes: dict[str, Any] = {}
    for key, field_name in _KEYS.items():
        if key in extra:
            changes[field_name] = _coerce(key, extra[key])
    return base.with_(**changes)


def _coerce(key: str, value: Any) -> Any:
    if key == "layerwise_independent_layers":
        if value == "all":
            return "all"
        if isinstance(value, list):
            return tuple(value)
        raise ReplicaConfigError(f"{key}: must be a list of layer indices or 'all', got {value!r}")
    if key == "replica_buffer_reuse":
        if not isinstance(value, bool):
            raise ReplicaConfigError(f"{key}: must be true or false, got {value!r}")
        return value
    if key in ("layerwise_prefetch_layers", "layerwise_num_shared_buffers"):
        if isinstance(value, str) and value.isdigit():  # upstream reads these with int(...)
            return int(value)
    return value
