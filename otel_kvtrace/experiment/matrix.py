"""``MATRIX.yaml`` -> the cells of an experiment (one server configuration each) and how to run them.

Schema (every key but ``server.command`` and ``factors`` is optional)::

    name: replica-b-x-p
    runs: 3                      # load runs per cell, each against a freshly started server (>= 3)
    environment: {tp: 1, cp: 1, pp: 1, dp: 1, hardware: "..."}   # copied into the report
    server:
      command: "kvtrace serve-replica --port {port} --data-dir {data_dir} --run-id {run_id}
                --kv-transfer-config '{kv_transfer_config}' --max-num-seqs {concurrency}"
      env: {OTEL_KVTRACE_SCHEDULER: "{scheduler}"}
      health_path: /health
      startup_timeout_s: 120
    kv_transfer_config: {kv_connector: AscendStoreConnector, kv_role: kv_both, kv_connector_extra_config: {}}
    factors:                     # the grid: every combination is a cell
      num_shared_buffers: [2, 4]
      prefetch_layers: [2, 4]
      buffer_reuse: [true]
      independent_layers: [[0, 4]]
      concurrency: [4]
      path: [gva]
      scheduler: [fifo]
    load: {num_requests: 24, prompt_len: 1024, output_len: 8, request_rate: inf, endpoint: /v1/completions}

A factor value ``null`` leaves the key out (the server's default, e.g. upstream's default P). The layerwise
factors go into ``kv_connector_extra_config`` under vLLM-Ascend's names; ``scheduler`` reaches the server as
``{scheduler}`` in the template (and ``OTEL_KVTRACE_SCHEDULER`` when ``server.env`` says so).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FACTORS = ("num_shared_buffers", "prefetch_layers", "buffer_reuse", "independent_layers", "concurrency", "path",
           "scheduler")
EXTRA_KEYS = {
    "num_shared_buffers": "layerwise_num_shared_buffers",
    "prefetch_layers": "layerwise_prefetch_layers",
    "independent_layers": "layerwise_independent_layers",
    "buffer_reuse": "replica_buffer_reuse",
    "path": "replica_path",
}
SHORT = {"num_shared_buffers": "B", "prefetch_layers": "P", "buffer_reuse": "reuse", "independent_layers": "ind",
         "concurrency": "c", "path": "", "scheduler": ""}
LOAD_KEYS = ("num_requests", "prompt_len", "output_len", "request_rate", "endpoint", "timeout_s", "seed")


class MatrixError(ValueError):
    """The matrix file is wrong; the message names the file and the key."""


@dataclass(slots=True, frozen=True)
class Cell:
    """One configuration of the grid."""

    values: tuple[tuple[str, Any], ...]

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def cell_id(self) -> str:
        parts = []
        for name, value in self.values:
            if value is None:
                text = "default"
            elif isinstance(value, bool):
                text = "on" if value else "off"
            elif isinstance(value, list | tuple):
                text = "_".join(str(v) for v in value)
            else:
                text = str(value)
            parts.append(f"{SHORT[name]}{text}")
        return re.sub(r"[^A-Za-z0-9_.=-]", "_", "-".join(parts))


@dataclass(slots=True)
class Matrix:
    name: str
    path: Path
    command: str
    cells: list[Cell]
    runs: int = 3
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 120.0
    kv_transfer_config: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    def kv_config_json(self, cell: Cell) -> str:
        """vLLM's ``--kv-transfer-config`` for the cell: the base with the cell's layerwise keys merged in."""
        base = json.loads(json.dumps(self.kv_transfer_config))
        extra = base.setdefault("kv_connector_extra_config", {})
        for name, value in cell.values:
            if name in EXTRA_KEYS and value is not None:
                extra[EXTRA_KEYS[name]] = list(value) if isinstance(value, tuple) else value
        return json.dumps(base, separators=(",", ":"))

    def concurrency(self, cell: Cell) -> int:
        return int(cell.config.get("concurrency") or self.load.get("concurrency", 4))


def read_matrix(path: str | Path) -> Matrix:
    """Parse and check ``path``; ``MatrixError`` names the problem."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise MatrixError(f"{p}: cannot read the matrix ({exc})") from None
    if not isinstance(doc, dict):
        raise MatrixError(f"{p}: must be a YAML mapping with 'server' and 'factors'")
    server = _mapping(p, doc, "server")
    command = server.get("command")
    if not isinstance(command, str) or not command.strip():
        raise MatrixError(f"{p}: server.command must be a command template string")
    factors = _mapping(p, doc, "factors")
    unknown = sorted(set(factors) - set(FACTORS))
    if unknown:
        raise MatrixError(f"{p}: factors: unknown {unknown}; known: {list(FACTORS)}")
    grid = []
    for name in (n for n in FACTORS if n in factors):  # factors not listed keep the server's default
        values = factors[name]
        if not isinstance(values, list) or not values:
            raise MatrixError(f"{p}: factors.{name} must be a non-empty list of values")
        for v in values:
            _check_level(p, name, v)
        grid.append([(name, tuple(v) if isinstance(v, list) else v) for v in values])
    cells = [Cell(tuple(combo)) for combo in itertools.product(*grid)]
    runs = doc.get("runs", 3)
    if not isinstance(runs, int) or runs < 1:
        raise MatrixError(f"{p}: runs must be an integer >= 1, got {runs!r}")
    load = doc.get("load") or {}
    if not isinstance(load, dict):
        raise MatrixError(f"{p}: load must be a mapping")
    if set(load) - set(LOAD_KEYS) - {"concurrency"}:
        raise MatrixError(f"{p}: load: unknown keys {sorted(set(load) - set(LOAD_KEYS) - {'concurrency'})}")
    if str(load.get("request_rate", "inf")) == "inf":
        load["request_rate"] = math.inf
    for key, minimum in _LOAD_INTS.items():
        if key in load:
            load[key] = _number(p, f"load.{key}", load[key], int, minimum)
    for key in ("request_rate", "timeout_s"):
        if key in load:
            load[key] = _number(p, f"load.{key}", load[key], float, 0.0, exclusive=True)
    if "endpoint" in load and (not isinstance(load["endpoint"], str) or not load["endpoint"].startswith("/")):
        raise MatrixError(f"{p}: load.endpoint must be a path such as /v1/completions, got {load['endpoint']!r}")
    env = server.get("env") or {}
    if not isinstance(env, dict):
        raise MatrixError(f"{p}: server.env must be a mapping")
    startup = _number(p, "server.startup_timeout_s", server.get("startup_timeout_s", 120), float, 0.0, exclusive=True)
    kv = doc.get("kv_transfer_config") or {}
    if not isinstance(kv, dict) or not isinstance(kv.get("kv_connector_extra_config", {}), dict):
        raise MatrixError(f"{p}: kv_transfer_config must be a mapping (kv_connector_extra_config a mapping)")
    environment = doc.get("environment") or {}
    if not isinstance(environment, dict):
        raise MatrixError(f"{p}: environment must be a mapping")
    return Matrix(str(doc.get("name") or p.stem), p, command, cells, runs, {str(k): str(v) for k, v in env.items()},
                  str(server.get("health_path", "/health")), startup, kv, load, environment)


_LOAD_INTS = {"num_requests": 1, "prompt_len": 1, "output_len": 1, "seed": 0, "concurrency": 1}
_SCALAR_FACTORS = {"num_shared_buffers": int, "prefetch_layers": int, "concurrency": int, "buffer_reuse": bool,
                   "path": str, "scheduler": str}


def _number(p: Path, key: str, value: Any, kind: type, minimum: float, *, exclusive: bool = False) -> Any:
    """``value`` as ``kind`` (int or float) >= ``minimum`` (> when ``exclusive``), else ``MatrixError``."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and (kind is float or float(value).is_integer())
    if ok:
        value = kind(value)
        ok = value > minimum if exclusive else value >= minimum
    if not ok:
        what = "an integer" if kind is int else "a number"
        raise MatrixError(f"{p}: {key} must be {what} {'>' if exclusive else '>='} {minimum:g}, got {value!r}")
    return value


def _check_level(p: Path, name: str, value: Any) -> None:
    """One level of a factor: ``null`` (the default) or the factor's type (a list of ints for independent_layers)."""
    if value is None:
        return
    if name == "independent_layers":
        ok = isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    else:
        kind = _SCALAR_FACTORS[name]
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise MatrixError(f"{p}: factors.{name}: level {value!r} is not "
                          f"{'a list of layer numbers' if name == 'independent_layers' else _SCALAR_FACTORS[name].__name__}")


def _mapping(p: Path, doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise MatrixError(f"{p}: '{key}' must be a mapping")
    return value
