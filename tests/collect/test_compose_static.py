"""The docker compose stack, checked without docker: it parses, its parts reference each other correctly,
it binds safely, and it writes files where `kvtrace report` can read them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.collect.stack_config import (
    bind_mounts,
    collector_config,
    collector_service,
    compose,
    host_path,
    interpolate,
    load_yaml,
    mounted_file,
)

SERVICES = ("otel-collector", "jaeger", "prometheus", "grafana")


def _components(cfg: dict[str, Any], kind: str) -> set[str]:
    return set((cfg.get(kind) or {}).keys())


def test_compose_has_the_stack_and_every_image_is_pinned() -> None:
    services = compose()["services"]
    assert set(SERVICES) <= set(services)
    for name, svc in services.items():
        image = interpolate(svc["image"])
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest" and re.match(r"v?\d+\.\d+", tag), f"{name}: image {image!r} is not pinned to a version"
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert "jaegertracing/jaeger:2." in services["jaeger"]["image"]  # Jaeger v2 (the OTel-Collector-based line)


@pytest.mark.parametrize("env", [{}, {"KVTRACE_UID": "1234"}])
def test_every_host_port_binds_loopback_by_default(env: dict[str, str]) -> None:
    published = 0
    for name, svc in compose()["services"].items():
        for spec in svc.get("ports", []):
            assert isinstance(spec, str), f"{name}: use the short 'ip:host:container' port syntax"
            parts = interpolate(spec, env).split(":")
            assert len(parts) == 3, f"{name}: port {spec!r} has no host IP, so docker binds 0.0.0.0"
            assert parts[0] == "127.0.0.1", f"{name}: port {spec!r} binds {parts[0]}"
            published += 1
    assert published >= 5  # 4317, 4318, 16686, 9090, 3000


def test_every_service_has_a_healthcheck_and_the_collector_is_probed_by_its_sidecar() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        if name == "otel-collector":
            continue  # FROM scratch image: nothing inside can run a probe
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
    health_port = collector_config()["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]
    probes = [
        " ".join(svc["healthcheck"]["test"])
        for svc in services.values()
        if "healthcheck" in svc
    ]
    assert any(f"http://otel-collector:{health_port}/" in p for p in probes)
    assert "health_check" in collector_config()["service"]["extensions"]


def test_collector_config_is_the_mounted_file_and_pipelines_reference_defined_components() -> None:
    cfg = collector_config()
    receivers, processors, exporters = (_components(cfg, k) for k in ("receivers", "processors", "exporters"))
    connectors, extensions = _components(cfg, "connectors"), _components(cfg, "extensions")
    used: set[str] = set()
    pipelines = cfg["service"]["pipelines"]
    connector_in: dict[str, set[str]] = {}
    connector_out: dict[str, set[str]] = {}
    for pipeline_id, p in pipelines.items():
        signal = pipeline_id.split("/")[0]
        assert signal in ("traces", "metrics", "logs"), pipeline_id
        for r in p["receivers"]:
            assert r in receivers | connectors, f"{pipeline_id}: receiver {r} is not defined"
            if r in connectors:
                connector_out.setdefault(r, set()).add(signal)
        for pr in p.get("processors", []):
            assert pr in processors, f"{pipeline_id}: processor {pr} is not defined"
        for e in p["exporters"]:
            assert e in exporters | connectors, f"{pipeline_id}: exporter {e} is not defined"
            if e in connectors:
                connector_in.setdefault(e, set()).add(signal)
        assert p.get("processors", [None])[0] == "memory_limiter", f"{pipeline_id}: memory_limiter must run first"
        assert "batch" in p["processors"], f"{pipeline_id}: no batch processor"
        used |= set(p["receivers"]) | set(p.get("processors", [])) | set(p["exporters"])
    assert used >= receivers | processors | exporters | connectors, "a component is defined but never used"
    assert set(cfg["service"]["extensions"]) <= extensions
    # A connector must be the exporter of one pipeline and the receiver of another (spanmetrics: traces -> metrics).
    assert connector_in.get("spanmetrics") == {"traces"} and connector_out.get("spanmetrics") == {"metrics"}
    traces = pipelines["traces"]
    assert {"otlp"} == set(traces["receivers"])
    assert any(e.split("/")[0] == "file" for e in traces["exporters"])
    assert any(e.split("/")[0] in ("otlp", "otlp_grpc") for e in traces["exporters"])


def test_otlp_receiver_listens_on_all_interfaces_inside_and_is_published() -> None:
    protocols = collector_config()["receivers"]["otlp"]["protocols"]
    container_ports = {p.split(":")[-1] for p in collector_service()["ports"]}
    for proto, port in (("grpc", "4317"), ("http", "4318")):
        host, _, bound = protocols[proto]["endpoint"].rpartition(":")
        assert host == "0.0.0.0", f"{proto} receiver binds {host!r}; the Collector's default localhost is unreachable"
        assert bound == port and port in container_ports


def test_jaeger_exporter_targets_the_jaeger_service_over_otlp() -> None:
    cfg, services = collector_config(), compose()["services"]
    (name,) = [e for e in cfg["exporters"] if e.split("/")[0] in ("otlp", "otlp_grpc")]
    host, _, port = cfg["exporters"][name]["endpoint"].rpartition(":")
    assert host == "jaeger" and port == "4317" and host in services
    assert cfg["exporters"][name]["tls"]["insecure"] is True
    assert interpolate(services["jaeger"]["environment"]["JAEGER_LISTEN_HOST"]) == "0.0.0.0"
    assert any(p.endswith(":16686") for p in services["jaeger"]["ports"])


def test_file_exporter_writes_json_lines_onto_a_writable_host_volume_that_survives_restarts() -> None:
    cfg, svc = collector_config(), collector_service()
    file_exporters = {k: v for k, v in cfg["exporters"].items() if k.split("/")[0] == "file"}
    assert file_exporters
    for name, fx in file_exporters.items():
        path = fx["path"]
        assert path.endswith(".jsonl"), f"{name}: OTLP file-exporter spec uses .jsonl"
        assert fx.get("format", "json") == "json" and "compression" not in fx and "encoding" not in fx
        mounts = [(s, t, ro) for s, t, ro in bind_mounts(svc) if path.startswith(t.rstrip("/") + "/")]
        assert mounts, f"{name}: {path} is not on a mounted volume (the image has no writable filesystem)"
        source, _, read_only = mounts[0]
        assert not read_only
        assert source.startswith("./kvtrace-data/")
        assert host_path(source).is_relative_to(Path(compose_dir()) / "kvtrace-data")
        # Restarts must not truncate: rotation (lumberjack) appends to an existing file; the Collector
        # rejects `append` together with `rotation`, so exactly one of them must be set.
        assert ("rotation" in fx) != bool(fx.get("append")), f"{name}: set rotation (or append), not both"
        assert "rotation" in fx and fx["rotation"]["max_megabytes"] > 0 and fx["rotation"]["max_backups"] > 0


def compose_dir() -> Path:
    from tests.collect.stack_config import COMPOSE

    return COMPOSE.parent


def test_prometheus_scrapes_the_collector_metric_endpoints() -> None:
    services = compose()["services"]
    prom_cfg = load_yaml(mounted_file(services["prometheus"], "/etc/prometheus/prometheus.yml"))
    targets = {t for job in prom_cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    cfg = collector_config()
    exporter_port = cfg["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    (reader,) = cfg["service"]["telemetry"]["metrics"]["readers"]
    telemetry = reader["pull"]["exporter"]["prometheus"]
    assert telemetry["host"] == "0.0.0.0"
    assert {f"otel-collector:{exporter_port}", f"otel-collector:{telemetry['port']}"} <= targets
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    assert cfg["exporters"]["prometheus"]["enable_open_metrics"] is True


def test_grafana_provisions_both_datasources_and_the_dashboards_directory() -> None:
    grafana = compose()["services"]["grafana"]
    ds_file = mounted_file(grafana, "/etc/grafana/provisioning/datasources/datasources.yaml")
    datasources = {d["uid"]: d for d in load_yaml(ds_file)["datasources"]}
    assert datasources["prometheus"]["type"] == "prometheus" and datasources["prometheus"]["url"] == "http://prometheus:9090"
    assert datasources["jaeger"]["type"] == "jaeger" and datasources["jaeger"]["url"] == "http://jaeger:16686"
    (dest,) = datasources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest["datasourceUid"] == "jaeger"
    dash_file = mounted_file(grafana, "/etc/grafana/provisioning/dashboards/dashboards.yaml")
    (provider,) = load_yaml(dash_file)["providers"]
    dash_dir = mounted_file(grafana, provider["options"]["path"])
    assert dash_dir == (compose_dir() / "dashboards").resolve()
    assert list(dash_dir.glob("*.json"))
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounted_file(grafana, home).is_file()


def test_spanmetrics_buckets_resolve_microsecond_stages() -> None:
    sm = collector_config()["connectors"]["spanmetrics"]
    buckets = [_go_duration_s(b) for b in sm["histogram"]["explicit"]["buckets"]]
    assert buckets == sorted(buckets) and len(set(buckets)) == len(buckets)
    assert buckets[0] <= 10e-6, "first bucket must resolve microsecond stages"
    assert sum(b < 1e-3 for b in buckets) >= 5, "need several buckets below 1 ms"
    assert buckets[-1] >= 1.0


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration_s(text: str) -> float:
    """Parse a Go time.Duration string (as the Collector does): e.g. 2500us, 1ms, 1s."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"not a Go duration: {text!r}"
    return sum(float(n) * _GO_UNITS[u] for n, u in parts)


def test_go_duration_parser_rejects_what_the_collector_would() -> None:
    assert _go_duration_s("2500us") == pytest.approx(2.5e-3)
    assert _go_duration_s("1m30s") == 90.0
    with pytest.raises(AssertionError):
        _go_duration_s("5 ms")


def test_spanmetrics_dimensions_are_schema_attributes_of_low_cardinality() -> None:
    from tests.collect.stack_config import schema_attributes

    per_task = {"kvtrace.correlation_id", "kvtrace.seq", "kvtrace.step", "kvtrace.layer_id", "kvtrace.request_ids",
                "kvtrace.queue", "kvtrace.group_ids", "kvtrace.bytes", "kvtrace.num_blocks"}
    dims = [d["name"] for d in collector_config()["connectors"]["spanmetrics"]["dimensions"]]
    assert "kvtrace.path" in dims
    for name in dims:
        assert name in schema_attributes(), f"{name} is not an attribute in docs/schema.md"
        assert name not in per_task and not name.startswith("kvtrace.ts."), f"{name} would create a series per task"
