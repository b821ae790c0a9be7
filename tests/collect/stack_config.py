"""Readers for the compose stack's files and for the names docs/schema.md fixes (used by the static tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "docs" / "schema.md"

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def load_yaml(path: Path) -> Any:
    with path.open() as fh:
        return yaml.safe_load(fh)


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` substitution, with ``env`` (default: nothing set)."""
    env = env or {}
    return _INTERPOLATION.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


def host_path(source: str) -> Path:
    """A bind-mount source resolved against the compose file's directory."""
    return (COMPOSE.parent / interpolate(source)).resolve()


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(host source, container target, read_only) for each short-syntax volume of a service."""
    mounts = []
    for spec in service.get("volumes", []):
        parts = interpolate(spec).split(":")
        mounts.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return mounts


def mounted_file(service: dict[str, Any], container_path: str) -> Path:
    """The host file behind ``container_path`` in ``service`` (through a bind mount of it or a parent dir)."""
    for source, target, _ in bind_mounts(service):
        if container_path == target:
            return host_path(source)
        if container_path.startswith(target.rstrip("/") + "/"):
            return host_path(source) / container_path[len(target.rstrip("/")) + 1 :]
    raise AssertionError(f"{container_path} is not on any volume of the service")


def collector_service() -> dict[str, Any]:
    return compose()["services"]["otel-collector"]


def collector_config() -> dict[str, Any]:
    """The Collector config that the compose service actually mounts and passes with --config."""
    svc = collector_service()
    (config_arg,) = [a for a in svc["command"] if a.startswith("--config=")]
    return load_yaml(mounted_file(svc, config_arg.split("=", 1)[1]))


# --- docs/schema.md ---------------------------------------------------------------------------


def _schema_text() -> str:
    return SCHEMA.read_text()


def schema_root_span() -> str:
    return re.search(r"### Root span `([^`]+)`", _schema_text()).group(1)  # type: ignore[union-attr]


def schema_root_spans() -> set[str]:
    """Every root span name (recv tasks, producer save tasks)."""
    return set(re.findall(r"### (?:Root span|.*root) `(kvtrace\.[a-z.]+)`", _schema_text()))


def schema_child_spans() -> list[str]:
    text = _schema_text()
    section = text[text.index("### Child spans") :]
    section = section[: section.index("\n### ", 5)]
    return re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.MULTILINE)


def schema_paths() -> list[str]:
    return re.findall(r"`([a-z]+)`", re.search(r"`path`: (`\w+` or `\w+`)", _schema_text()).group(1))  # type: ignore[union-attr]


def schema_attributes() -> set[str]:
    return set(re.findall(r"`(kvtrace\.[a-z_.]+)`", _schema_text()))


def schema_exporter_counter() -> str:
    """The exporter's drop counter as docs/schema.md names it (the one the dashboards chart)."""
    return re.search(r"OTel counters?\b.*?`(kvtrace\.exporter\.dropped_records)`", _schema_text(),
                     re.S).group(1)  # type: ignore[union-attr]


# --- dashboards -------------------------------------------------------------------------------


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out
