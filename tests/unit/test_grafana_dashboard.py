"""The Grafana dashboard (deploy/grafana/dashboards/switchyard.json) and its provisioning by docker-compose.

Every metric name a panel's PromQL (or a template variable's query) references must be one the gateway
exposes: the names are read from a real `GatewayMetrics` exposition with engine state attached. Names of
metrics still being built are listed in `EXPECTED_MISSING`, the one place to shrink as they land: a name
there that the gateway now exposes fails the test too, so the list never goes stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.domain import ClusterSnapshot, EngineId, EngineView
from gateway.observability.metrics import GatewayMetrics

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "switchyard.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "switchyard.yml"
COMPOSE = REPO / "docker-compose.yml"

# Panels whose metrics the gateway does not expose yet (none: every panel's metric exists); a name here that
# the gateway exposes fails the test too, so the set never goes stale.
EXPECTED_MISSING: frozenset[str] = frozenset()
METRIC_NAME = re.compile(r"\bswitchyard_[A-Za-z0-9_]+")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict)
    return doc


def panels() -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves left out."""
    out: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query template variable."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in panels() for t in p["targets"]]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']!r}", query))
    return found


def exposed_names() -> set[str]:
    """Every sample name the gateway's /metrics can carry, from a live exposition: HELP/TYPE lines cover the
    labelled families that have no sample yet, with their type's suffixes."""
    metrics = GatewayMetrics()
    engine = EngineView(engine_id=EngineId("agent-0:50051"), model="m", num_running=2, kv_blocks_total=10)
    metrics.attach_engine_state(lambda: ClusterSnapshot(taken_at_s=1.0, engines=(engine,)))
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def provisioned_datasource() -> dict[str, Any]:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert isinstance(source, dict)
    return source


def grafana_service() -> dict[str, Any]:
    service = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    assert isinstance(service, dict)
    return service


def mounts() -> dict[str, Path]:
    """Container path -> repository path of the grafana service's bind mounts (named volumes left out)."""
    out: dict[str, Path] = {}
    for volume in grafana_service()["volumes"]:
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            out[target] = REPO / source
    return out


def test_the_dashboard_parses_with_unique_panel_ids_and_a_query_per_target() -> None:
    doc = dashboard()
    assert doc["uid"] == "switchyard-gateway" and doc["title"]
    ids = [p["id"] for p in doc["panels"]] + [p["id"] for p in panels() if p not in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert METRIC_NAME.search(target["expr"]), (panel["title"], target["expr"])


def test_every_panel_names_the_provisioned_datasource_by_uid() -> None:
    source = provisioned_datasource()
    expected = {"type": "prometheus", "uid": source["uid"]}
    assert source["type"] == "prometheus"
    for panel in panels():
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]
    for var in dashboard()["templating"]["list"]:
        assert var["datasource"] == expected, var["name"]


def test_panels_reference_only_metrics_the_gateway_exposes() -> None:
    exposed = exposed_names()
    referenced: dict[str, list[str]] = {}
    for where, query in queries():
        for name in METRIC_NAME.findall(query):
            referenced.setdefault(name, []).append(where)
    unknown = {n: w for n, w in referenced.items() if n not in exposed and n not in EXPECTED_MISSING}
    assert not unknown, f"queries reference metrics the gateway does not expose: {unknown}"
    landed = EXPECTED_MISSING & exposed
    assert not landed, f"now exposed, delete from EXPECTED_MISSING: {sorted(landed)}"
    unused = EXPECTED_MISSING - referenced.keys()
    assert not unused, f"EXPECTED_MISSING names no panel references: {sorted(unused)}"


def test_the_exposition_names_cover_histograms_and_engine_state() -> None:
    """The name collection itself: histogram series, labelled counters without samples, engine gauges."""
    exposed = exposed_names()
    assert {
        "switchyard_time_to_first_token_seconds_bucket",
        "switchyard_routing_decision_seconds_bucket",  # labelled, no sample yet
        "switchyard_requests_total",  # labelled, no sample yet
        "switchyard_client_disconnects_total",
        "switchyard_engine_running_requests",
        "switchyard_engine_ready",
    } <= exposed
    assert "switchyard_time_to_first_token_seconds" not in {n for n in exposed if n.endswith("_total")}


def test_compose_provisions_grafana_from_paths_that_exist() -> None:
    service = grafana_service()
    assert "profiles" not in service  # starts with Prometheus, whatever the gpus-N profile
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", service["image"]), service["image"]
    assert service["ports"] == ["${SWITCHYARD_GRAFANA_PORT:-3000}:3000"]
    assert "prometheus" in service["depends_on"]

    bound = mounts()
    for target, source in bound.items():
        assert source.exists(), f"{target} is mounted from {source}, which does not exist"
    assert bound["/etc/grafana/provisioning/datasources"] == DATASOURCES.parent
    assert bound["/etc/grafana/provisioning/dashboards"] == PROVIDERS.parent

    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    dashboards_dir = bound[provider["options"]["path"]]
    assert (dashboards_dir / DASHBOARD.name).read_text() == DASHBOARD.read_text()

    env = service["environment"]
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


def test_grafana_is_read_only_without_a_password_literal() -> None:
    env = grafana_service()["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and env["GF_AUTH_BASIC_ENABLED"] == "false"
    for key, value in env.items():
        if "PASSWORD" in key:  # only ever from a secret file or the operator's environment
            assert key.endswith("__FILE") or str(value).startswith("${"), key


def test_the_datasource_is_the_compose_prometheus() -> None:
    source = provisioned_datasource()
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    match = re.fullmatch(r"http://(?P<host>[\w-]+):(?P<port>\d+)", source["url"])
    assert match is not None, source["url"]
    assert match["host"] in services and match["port"] == "9090"
    assert any(p.endswith(":9090") for p in services[match["host"]]["ports"])
