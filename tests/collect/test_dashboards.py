"""Every Grafana query asks for a metric the configured stack produces, with label values our spans carry.

Metric names are derived from the spanmetrics connector config (namespace, histogram unit) the way the
Collector's Prometheus exporter renders them (dots -> underscores, unit suffix, `_total` on counters,
`_bucket/_sum/_count` on histograms); span names and attribute values come from docs/schema.md.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from otel_kvtrace.resources.probe import FIELDS as RESOURCE_FIELDS
from otel_kvtrace.resources.sampler import metric_name

from tests.collect.stack_config import (
    all_panels,
    collector_config,
    compose,
    dashboards,
    schema_attributes,
    schema_child_spans,
    schema_exporter_counter,
    schema_paths,
    schema_root_span,
    schema_root_spans,
)

_UNIT_SUFFIX = {"ms": "milliseconds", "s": "seconds"}
_BASE_LABELS = {"job", "instance", "le"}
# The Collector's own telemetry (service.telemetry.metrics, level normal) that the drop panels read.
# These names are not derivable from our config; they are the Collector's documented internal metrics.
COLLECTOR_INTERNAL = {
    "otelcol_exporter_send_failed_spans_total": {"exporter"},
    "otelcol_exporter_enqueue_failed_spans_total": {"exporter"},
    "otelcol_exporter_sent_spans_total": {"exporter"},
    "otelcol_receiver_refused_spans_total": {"receiver", "transport"},
    "otelcol_receiver_accepted_spans_total": {"receiver", "transport"},
}


def _prom_name(otel_name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_:]", "_", otel_name)


def spanmetrics_series() -> dict[str, set[str]]:
    """Prometheus metric name -> label names, for what the configured spanmetrics connector produces."""
    sm = collector_config()["connectors"]["spanmetrics"]
    namespace = sm["namespace"]  # set explicitly: the connector's default has changed across versions
    labels = {"service_name", "span_name", "span_kind", "status_code"} - {
        _prom_name(d) for d in sm.get("exclude_dimensions", [])
    }
    labels |= {_prom_name(d["name"]) for d in sm.get("dimensions", [])}
    series = {f"{_prom_name(namespace + '.calls')}_total": labels | _BASE_LABELS}
    histogram = sm.get("histogram", {})
    if not histogram.get("disable", False):
        assert "exponential" not in histogram, "exponential histograms have no _bucket series in Prometheus"
        base = f"{_prom_name(namespace + '.duration')}_{_UNIT_SUFFIX[histogram.get('unit', 'ms')]}"
        for suffix in ("_bucket", "_sum", "_count"):
            series[base + suffix] = labels | _BASE_LABELS
    return series


def known_series() -> dict[str, set[str]]:
    cfg = collector_config()
    series = spanmetrics_series()
    # Worker metrics arrive over OTLP in the metrics pipeline (a counter: `_total`, braces unit dropped).
    assert "otlp" in cfg["service"]["pipelines"]["metrics"]["receivers"]
    series[f"{_prom_name(schema_exporter_counter())}_total"] = {"service_name", "job", "instance"}
    # Resource gauges (otel_kvtrace.resources): no `_total`; the exporter appends `_bytes` to unit By.
    for field in RESOURCE_FIELDS:
        name, unit = metric_name(field)
        series[_prom_name(name) + ("_bytes" if unit == "By" else "")] = {"service_name", "job", "instance"}
    assert cfg["service"]["telemetry"]["metrics"]["readers"], "Collector telemetry must be exposed for drop panels"
    series.update({k: v | _BASE_LABELS for k, v in COLLECTOR_INTERNAL.items()})
    return series


def _prom_targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (panel["title"], t["expr"])
        for panel in all_panels(dash)
        for t in panel.get("targets", [])
        if (t.get("datasource") or panel.get("datasource") or {}).get("type") == "prometheus"
    ]


def _variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash.get("templating", {}).get("list", [])}


def _expand(value: str, variables: dict[str, dict[str, Any]]) -> list[str] | None:
    """Concrete alternatives a matcher value stands for; None when it is open (query variable, wildcard)."""
    m = re.fullmatch(r"\$\{?(\w+)\}?", value)
    if m:
        var = variables[m.group(1)]
        if var["type"] != "custom":
            return None
        return [o.strip() for o in var["query"].split(",") if o.strip()]
    if any(ch in value for ch in ".*+?[]()"):
        return None if value in (".*", ".+") else [value]
    return value.split("|")


_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(?=\[|\{|\)|$|\s)")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "without", "avg", "max", "min", "count",
    "topk", "bottomk", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "vector",
    "le", "offset", "bool", "clamp_min", "clamp_max", "label_replace", "abs", "round",
}


def _metric_names(expr: str) -> list[str]:
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_ranges = re.sub(r"\[[^\]]*\]", "[]", no_strings)
    no_groupings = _GROUPING.sub("by ()", no_ranges)
    no_matchers = re.sub(r"\{[^}]*\}", "{}", no_groupings)
    names = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[)", no_matchers)
    bare = [w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", no_matchers) if w not in _PROMQL_WORDS]
    bare = [w for w in bare if not re.fullmatch(r"\d.*", w)]
    return sorted(set(names) | {w for w in bare if not re.search(rf"\b{w}\s*\(", no_matchers)})


def test_dashboard_files_are_valid_grafana_json() -> None:
    found = dashboards()
    assert found
    for name, dash in found.items():
        assert dash["uid"] and dash["title"] and dash["panels"], name
        ids = [p["id"] for p in all_panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        assert _prom_targets(dash), f"{name}: no Prometheus queries"


def test_metric_name_derivation_matches_prometheus_rendering() -> None:
    series = spanmetrics_series()
    assert "traces_span_metrics_calls_total" in series
    assert "traces_span_metrics_duration_seconds_bucket" in series
    assert "kvtrace_path" in series["traces_span_metrics_calls_total"]
    assert _metric_names('sum by (le, span_name) (rate(a_b_bucket{x="y"}[5m])) / sum(rate(c_total[1m]))') == [
        "a_b_bucket",
        "c_total",
    ]


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_every_query_uses_produced_metrics_labels_and_schema_values(name: str) -> None:
    dash = dashboards()[name]
    series, variables = known_series(), _variables(dash)
    stage_names = set(schema_child_spans()) | schema_root_spans()
    allowed_values = {
        "span_name": stage_names,
        "kvtrace_path": set(schema_paths()),
        "status_code": {"STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR"},
        "span_kind": {"SPAN_KIND_INTERNAL"},  # every kvtrace span is INTERNAL (schema)
    }
    for title, expr in _prom_targets(dash):
        metrics = _metric_names(expr)
        assert metrics, f"{title}: no metric in {expr!r}"
        unknown = [m for m in metrics if m not in series]
        assert not unknown, f"{title}: {unknown} is not produced by the configured stack"
        labels = set().union(*(series[m] for m in metrics))
        for group in _GROUPING.findall(expr):
            used = {g.strip() for g in group.split(",") if g.strip()}
            assert used <= labels, f"{title}: groups by {used - labels} which {metrics} do not carry"
        for label, op, value in _MATCHER.findall(expr):
            assert label in labels, f"{title}: matcher on {label!r} which {metrics} do not carry"
            if label in allowed_values and op in ("=", "=~"):
                alternatives = _expand(value, variables)
                if alternatives is not None:
                    bad = set(alternatives) - allowed_values[label]
                    assert not bad, f"{title}: {label} values {bad} never occur (docs/schema.md)"


def test_stage_and_path_variables_cover_exactly_the_schema() -> None:
    for name, dash in dashboards().items():
        variables = _variables(dash)
        assert _expand("$stage", variables) == schema_child_spans(), name
        assert sorted(_expand("$path", variables) or []) == sorted(schema_paths()), name


def test_panels_cover_percentiles_rates_errors_and_drops() -> None:
    exprs = [e for dash in dashboards().values() for _, e in _prom_targets(dash)]
    for q in ("0.5", "0.95", "0.99"):
        assert any(
            f"histogram_quantile({q}," in e and re.search(r"by \(le, span_name, kvtrace_path\)", e) for e in exprs
        ), f"no p{q} per stage and path"
    root = schema_root_span()
    assert any("rate(traces_span_metrics_calls_total" in e and f'span_name="{root}"' in e for e in exprs)
    assert any('status_code="STATUS_CODE_ERROR"' in e for e in exprs)
    assert any(f"{_prom_name(schema_exporter_counter())}_total" in e for e in exprs)
    assert any("otelcol_exporter_send_failed_spans_total" in e for e in exprs)


def test_a_panel_links_to_the_jaeger_search_for_the_task_correlation_id() -> None:
    assert "kvtrace.correlation_id" in schema_attributes()
    jaeger_ui = [p for p in compose()["services"]["jaeger"]["ports"] if p.endswith(":16686")]
    assert jaeger_ui
    for name, dash in dashboards().items():
        assert "correlation_id" in _variables(dash)
        links = [link["url"] for p in all_panels(dash) for link in p.get("links", [])]
        jaeger_links = [u for u in links if ":16686/search?" in u]
        assert jaeger_links, f"{name}: no panel link to the Jaeger search"
        for url in jaeger_links:
            assert "%22kvtrace.correlation_id%22%3A%22${correlation_id:percentencode}%22" in url, url
            assert "service=${service}" in url
        searches = [
            t for p in all_panels(dash) for t in p.get("targets", [])
            if t.get("datasource", {}).get("uid") == "jaeger"
        ]
        assert any(t["queryType"] == "search" and "kvtrace.correlation_id=" in t["tags"] for t in searches), name


def test_resource_panels_query_the_names_the_real_sampler_emits(tmp_path) -> None:
    """Names from the sampler's real OTLP output (SDK -> encode_metrics -> OTLP/JSON), rendered the way the
    Collector's Prometheus exporter does (dots -> underscores, unit By -> `_bytes`, braces units dropped)."""
    import orjson

    from otel_kvtrace.resources.sampler import ResourceSampler

    values = dict.fromkeys(RESOURCE_FIELDS, 5)
    sampler = ResourceSampler(None, tmp_path, "dash", poll_ms=1, probe=lambda: values, memory=lambda: values,
                              export_interval_ms=30).start()
    for step in range(3):
        sampler.notify_step(step)
        time.sleep(0.03)
    sampler.stop()
    emitted = set()
    for line in (tmp_path / "metrics" / "otlp-metrics-dash.jsonl").read_bytes().splitlines():
        for rm in orjson.loads(line)["resourceMetrics"]:
            for sm in rm["scopeMetrics"]:
                for metric in sm["metrics"]:
                    suffix = "_bytes" if metric.get("unit") == "By" else ""
                    emitted.add(_prom_name(metric["name"]) + suffix)
    queried = {m for dash in dashboards().values() for _, e in _prom_targets(dash) for m in _metric_names(e)
               if m.startswith("kvtrace_resource_")}
    assert queried, "no resource panels"
    assert queried <= emitted, f"panels query {queried - emitted}, never emitted ({sorted(emitted)})"
    assert {f"kvtrace_resource_{f}" for f in RESOURCE_FIELDS} <= queried, "a resource field has no panel"
