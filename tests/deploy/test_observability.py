"""Prometheus configs and alert rules parse, their PromQL parses, and every metric they and the
Grafana dashboard read is one the gateway exports (its own metrics registry, read now: a renamed
metric fails here) or one the engines define (deploy/engines/*.metrics). Scrape targets are the
stacks' services; every alert has its runbook section; every gateway metric is documented."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.deploy import support
from tests.deploy.support import DEPLOY, ROOT, known_series, load_compose, load_json, promql_metrics

PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pd-gateway.json"
STACK_CONFIG = {"emulator": "emulator.yml", "sglang-gpu": "sglang-gpu.yml", "vllm-gpu": "vllm-gpu.yml"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    dash = load_json(DASHBOARD)
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], support.grafana_to_promql(t["expr"])))
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+), *\w+\)", var["definition"])
        assert m, var["definition"]
        out.append((f"variable {var['name']}", m[1]))
    return out


@pytest.mark.parametrize("profile", sorted(STACK_CONFIG))
def test_prometheus_scrapes_the_gateway_and_every_engine_of_its_stack(profile: str) -> None:
    compose = load_compose()
    cfg = yaml.safe_load((PROM / STACK_CONFIG[profile]).read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in cfg["scrape_configs"]
    }
    svcs = {n: s for n, s in compose["services"].items() if profile in s["profiles"]}
    prom = next(s for s in svcs.values() if s["image"].startswith("prom/prometheus:"))
    assert f"./deploy/prometheus/{STACK_CONFIG[profile]}:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    # every engine and gateway of the stack is a target, and every target is one of them
    expected: set[str] = set()
    for name, svc in svcs.items():
        cmd = svc.get("command", [])
        if not cmd or svc["image"].startswith(("prom/", "grafana/")):
            continue
        if cmd[0] == "serve":
            port = "8000"
        else:
            port = cmd[cmd.index("--port") + 1]
        host = "127.0.0.1" if svc.get("network_mode") == "host" else name
        expected.add(f"{host}:{port}")
    assert {t for ts in targets.values() for t in ts} == expected
    assert "pd-gateway" in targets


def test_alert_rules_parse_and_read_known_metrics() -> None:
    known = known_series()
    names = set()
    for rule in rules():
        assert rule["alert"] not in names
        names.add(rule["alert"])
        for metric in promql_metrics(rule["expr"]):
            assert metric in known, f"alert {rule['alert']} reads {metric}, which nothing exports"
        assert rule["labels"]["severity"] in ("critical", "warning", "info")


def test_every_alert_has_its_runbook_section() -> None:
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    for rule in rules():
        link = rule["annotations"]["runbook"]
        assert link == f"docs/runbook.md#{rule['alert'].lower()}", link
        assert rule["alert"].lower() in anchors, f"docs/runbook.md has no section {rule['alert']}"


def test_dashboard_is_valid_and_reads_only_exported_metrics() -> None:
    dash = load_json(DASHBOARD)
    assert dash["uid"] == "pd-gateway" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    known = known_series()
    queries = dashboard_queries()
    assert len(queries) > 20
    for title, expr in queries:
        for metric in promql_metrics(expr):
            assert metric in known, f"panel {title!r} reads {metric}, which nothing exports"
    for panel in dash["panels"]:
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == uid


def test_dashboard_covers_what_operators_ask_for() -> None:
    read = {m for _, expr in dashboard_queries() for m in promql_metrics(expr)}
    for metric in (
        "pdgw_requests_total",  # rate, errors, P/D vs colocated share (plan)
        "pdgw_time_to_first_token_seconds_bucket",
        "pdgw_inter_token_latency_seconds_bucket",
        "pdgw_fallbacks_total",
        "pdgw_guard_failures_total",
        "pdgw_worker_inflight",
        "pdgw_worker_healthy",
        "pdgw_pair_breaker_open",
        "sglang:cache_hit_rate",
        "vllm:prefix_cache_hits_total",
    ):
        assert metric in read, metric
    titles = [p["title"] for p in load_json(DASHBOARD)["panels"]]
    assert any("Reserved" in t for t in titles)  # room for the cache-aware metrics still to come


def test_a_renamed_metric_fails() -> None:
    """The check reads the gateway's registry: a name it no longer has is refused."""
    known = known_series()
    assert "pdgw_requests_total" in known and "pdgw_requests_totl" not in known
    assert "sglang:num_queue_reqs" in known and "sglang:num_queued_reqs" not in known
    with pytest.raises(ValueError):
        promql_metrics("sum(rate(pdgw_requests_total[5m])")  # unbalanced


def test_every_gateway_metric_is_in_the_metrics_reference() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for name, kind in support.gateway_metric_families().items():
        shown = name + "_total" if kind == "counter" else name
        assert f"`{shown}`" in doc, f"docs/metrics.md does not describe {shown}"
