"""docs/collector.md matches what ships: the options, variables, images and ports it names exist."""

from __future__ import annotations

import re

from otel_kvtrace.collect.cli import collect_command
from tests.collect.stack_config import COMPOSE, ROOT, compose, interpolate

DOC = (ROOT / "docs" / "collector.md").read_text()


def test_every_collect_option_in_the_doc_exists_and_every_option_is_documented() -> None:
    options = {opt for p in collect_command.params for opt in p.opts if opt.startswith("--")}
    mentioned = set(re.findall(r"(--[a-z][a-z-]+)", DOC)) - {"--config"}
    assert mentioned <= options, mentioned - options
    assert options - {"--help"} <= mentioned | {"--status-interval", "--host"}


def test_images_and_variables_in_the_doc_are_the_compose_ones() -> None:
    images = {interpolate(s["image"]) for s in compose()["services"].values()}
    for image in images:
        assert f"`{image}`" in DOC, f"docs/collector.md does not name {image}"
    for variable in set(re.findall(r"\b(KVTRACE_[A-Z]+)\b", DOC)):
        assert variable in COMPOSE.read_text(), f"{variable} is documented but compose does not use it"


def test_documented_host_ports_are_published() -> None:
    published = {p.rsplit(":", 2)[-2] for s in compose()["services"].values() for p in s.get("ports", [])}
    for port in ("4317", "4318", "16686", "9090", "3000"):
        assert port in published and f"127.0.0.1:{port}" in DOC
