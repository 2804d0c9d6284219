"""The observability files under compose/observability: they parse, the dashboard's PromQL
names only metrics pagemesh exports, and every data source it uses is provisioned."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT / "compose" / "observability"
DASHBOARD = ROOT / "grafana" / "dashboards" / "pagemesh.json"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yml"

# The metrics pagemesh exports (the contract between pagemesh.runtime.metrics, `pagemesh top` and
# the dashboards), as sample names: counters with `_total`, histograms without a suffix.
CONTRACT = {
    # router
    "pagemesh:request_success_total",
    "pagemesh:prompt_tokens_total",
    "pagemesh:generation_tokens_total",
    "pagemesh:time_to_first_token_seconds",
    "pagemesh:inter_token_latency_seconds",
    "pagemesh:e2e_request_latency_seconds",
    "pagemesh:num_requests_in_flight",
    "pagemesh:request_resumes_total",
    "pagemesh:engine_groups_ready",
    # scheduler (label group)
    "pagemesh:num_requests_running",
    "pagemesh:num_requests_waiting",
    "pagemesh:num_requests_swapped",
    "pagemesh:kv_cache_usage_perc",
    "pagemesh:prefix_cache_queries_total",
    "pagemesh:prefix_cache_hits_total",
    "pagemesh:num_preemptions_total",
    "pagemesh:request_queue_time_seconds",
    "pagemesh:num_swap_outs_total",
    "pagemesh:num_swap_ins_total",
    "pagemesh:step_time_seconds",
    "pagemesh:scheduled_tokens_per_step",
    "pagemesh:engine_recoveries_total",
    "pagemesh:engine_group_ready",
    "pagemesh:checkpoint_writes_total",
    # worker (labels group, tp_rank, pp_rank)
    "pagemesh:worker_forward_time_seconds",
    "pagemesh:worker_steps_total",
    "pagemesh:worker_tp_collective_seconds_total",
    "pagemesh:worker_pp_send_seconds_total",
    "pagemesh:worker_pp_recv_seconds_total",
    # every service
    "pagemesh:heartbeat_age_seconds",
    "pagemesh:build_info",
}
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def metric_names(expr: str) -> set[str]:
    return {HISTOGRAM_SUFFIX.sub("", name) for name in re.findall(r"pagemesh:[a-z0-9_]+", expr)}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))  # a collapsed row holds its panels


def queries(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in all_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        yield query["query"] if isinstance(query, dict) else str(query or "")


def datasource_uids(node: Any) -> Iterator[str]:
    """Every `datasource: {uid: …}` anywhere in the dashboard."""
    if isinstance(node, dict):
        source = node.get("datasource")
        if isinstance(source, dict) and "uid" in source:
            yield source["uid"]
        for value in node.values():
            yield from datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasource_uids(value)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_file_parses() -> None:
    files = sorted(p for p in ROOT.rglob("*") if p.suffix in {".json", ".yml", ".yaml"})
    assert len(files) >= 5, files
    for path in files:
        document = (
            json.loads(path.read_text())
            if path.suffix == ".json"
            else yaml.safe_load(path.read_text())
        )
        assert document, path


def test_promql_names_only_contract_metrics(dashboard: dict[str, Any]) -> None:
    used: set[str] = set()
    for expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"no pagemesh metric in {expr!r}"
        assert names <= CONTRACT, f"{expr!r} uses {sorted(names - CONTRACT)}"
        used |= names
    # The panels the dashboard promises, by the metric each one needs.
    for needed in (
        "pagemesh:num_requests_running",
        "pagemesh:num_requests_waiting",
        "pagemesh:kv_cache_usage_perc",
        "pagemesh:prefix_cache_hits_total",
        "pagemesh:prefix_cache_queries_total",
        "pagemesh:num_preemptions_total",
        "pagemesh:generation_tokens_total",
        "pagemesh:request_success_total",
        "pagemesh:time_to_first_token_seconds",
        "pagemesh:inter_token_latency_seconds",
        "pagemesh:e2e_request_latency_seconds",
        "pagemesh:request_queue_time_seconds",
        "pagemesh:step_time_seconds",
        "pagemesh:worker_forward_time_seconds",
        "pagemesh:engine_recoveries_total",
        "pagemesh:request_resumes_total",
        "pagemesh:engine_group_ready",
        "pagemesh:heartbeat_age_seconds",
    ):
        assert needed in used, needed


def test_quantiles_are_taken_over_rates_of_buckets(dashboard: dict[str, Any]) -> None:
    for expr in queries(dashboard):
        if "histogram_quantile" in expr:
            assert re.search(r"rate\(pagemesh:[a-z0-9_]+_bucket", expr), expr
            assert re.search(r"by \([^)]*\ble\b", expr), f"quantile without `by (le)`: {expr}"


def test_datasource_uids_are_provisioned(dashboard: dict[str, Any]) -> None:
    provisioned = {
        source["uid"]: source["type"]
        for source in yaml.safe_load(DATASOURCES.read_text())["datasources"]
    }
    assert set(provisioned.values()) >= {"prometheus", "jaeger"}
    used = set(datasource_uids(dashboard)) - {"-- Grafana --"}  # the built-in annotations
    assert used and used <= set(provisioned), used - set(provisioned)


def test_panel_ids_unique_and_inside_the_grid(dashboard: dict[str, Any]) -> None:
    panels = list(all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
    refs = [[t["refId"] for t in panel.get("targets", [])] for panel in panels]
    assert all(len(r) == len(set(r)) for r in refs)


def test_dashboard_provider_and_prometheus_scrape_config() -> None:
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    prometheus = yaml.safe_load((ROOT / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["pagemesh"]["file_sd_configs"][0]["files"] == ["/etc/prometheus/targets/*.json"]
    example = json.loads((ROOT / "prometheus/targets.example.json").read_text())
    addresses = [target for group in example for target in group["targets"]]
    assert addresses[:3] == ["router:9100", "scheduler:9101", "worker-0:9102"]
