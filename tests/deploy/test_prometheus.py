"""A real Prometheus (Debian's `prometheus`) scrapes the service (uvicorn, tiny exported models for
every task) during a bounded loopback load. Every PromQL expression of the dashboard, the alert
rules and the autoscaling rule must return data through the HTTP API; the rules must load and
evaluate; and the dashboard is rendered to a PNG from those queries.

Set LONGDOC_WRITE_DASHBOARD_PNG=1 to (re)write docs/dashboard.png from the run."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from datetime import datetime

import pytest

from tests.deploy import stack
from tests.deploy.conftest import ROOT, load_script, require_tool
from tests.polling import until

LOAD_SECONDS = 30
RATE_WINDOW = "15s"  # what $__rate_interval becomes at a 1 s scrape interval
LABELS = {"namespace": "longdoc-test", "pod": "longdoc-test-0"}  # as the ServiceMonitor's targets carry


@pytest.fixture(scope="module")
def scraped_load(tmp_path_factory, tiny_qa_dir, tiny_classify_dir, tiny_summarize_dir):
    """Service + Prometheus + load; yields (prometheus URL, load start, load end, statuses)."""
    binary = require_tool("prometheus", "Debian package prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    models = {"qa": tiny_qa_dir, "classify": tiny_classify_dir, "summarize": tiny_summarize_dir}
    with stack.service(models, work / "service.log", max_wait_ms=5) as url:
        target = url.removeprefix("http://")
        with stack.prometheus(binary, target, [ROOT / "docker/prometheus/rules.yml"], work, LABELS) as prom:
            # the target is up before the load starts
            until(lambda: stack.instant_query(prom, 'up{job="longdoc"} == 1'), "Prometheus scrapes the service")
            start = time.time()
            statuses = stack.load(url, LOAD_SECONDS)
            stop = time.time()
            until(lambda: scraped_and_evaluated_after(prom, stop + 1),
                  "a scrape and every rule group's evaluation after the load ended")
            yield prom, start, stop, statuses


def scraped_and_evaluated_after(prom: str, t: float) -> bool:
    """Prometheus has scraped the service, and evaluated every rule group, after time `t`."""
    if not stack.instant_query(prom, f'timestamp(up{{job="longdoc"}}) > {t:.3f}'):
        return False
    _, body = stack.get(f"{prom}/api/v1/rules", timeout=30)
    groups = json.loads(body)["data"]["groups"]

    def seconds(rfc3339: str) -> float:  # "2026-11-26T20:50:01.123456789Z": at most 6 fraction digits
        stamp = re.sub(r"(\.\d{6})\d*", r"\1", rfc3339).replace("Z", "+00:00")
        return datetime.fromisoformat(stamp).timestamp()

    return bool(groups) and all(seconds(g["lastEvaluation"]) > t for g in groups)


def test_load_was_served(scraped_load):
    _, _, _, statuses = scraped_load
    assert statuses.get(200, 0) >= 50, statuses
    assert statuses.get(422, 0) >= 1, statuses  # the deliberate invalid bodies
    assert set(statuses) <= {200, 422, 429}, statuses


def test_every_dashboard_expression_returns_data(scraped_load, monitoring):
    prom, start, stop, _ = scraped_load
    empty = []
    for title, expr in monitoring.dashboard_expressions(RATE_WINDOW):
        assert "$" not in expr, expr
        result = stack.instant_query(prom, expr, at=stop - 1)
        if not result:
            empty.append(f"{title}: {expr}")
    assert not empty, "no data:\n" + "\n".join(empty)


def test_every_alert_expression_returns_data_and_rules_evaluate(scraped_load, monitoring):
    prom, _, _, _ = scraped_load
    for alert in monitoring.alerts():
        assert stack.instant_query(prom, alert.value), f"{alert.name}: no data for {alert.value}"
        assert "$__" not in alert.expr
    # the rule file Prometheus loaded is the generated one, and every rule evaluates cleanly
    rules = json.loads(stack.get(f"{prom}/api/v1/rules")[1])["data"]["groups"]
    loaded = {r["name"]: r for g in rules for r in g["rules"]}
    assert set(loaded) == {a.name for a in monitoring.alerts()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    # and values are what this load implies: a replica up, nothing near saturation
    (up,) = stack.instant_query(prom, next(a.value for a in monitoring.alerts() if a.name == "LongdocNoReadyPods"))
    assert float(up["value"][1]) == 1.0
    assert loaded["LongdocNoReadyPods"]["state"] == "inactive"
    assert loaded["LongdocQueueSaturated"]["state"] == "inactive"


def test_input_tokens_are_the_unpadded_share_of_the_encoder_tokens(scraped_load):
    prom, _, stop, _ = scraped_load
    # qa and classify run encoder batches (summarize's encoder inputs are not batch_tokens)
    (real,) = stack.instant_query(prom, 'sum(longdoc_input_tokens_total{job="longdoc",endpoint!="summarize"})', at=stop)
    (padded,) = stack.instant_query(prom, 'sum(longdoc_batch_tokens_sum{job="longdoc"})', at=stop)
    real, padded = float(real["value"][1]), float(padded["value"][1])
    assert 0 < real < padded, (real, padded)  # the load mixes lengths: some padding is certain


def test_autoscaling_metric_returns_data_per_pod(scraped_load, monitoring):
    prom, _, stop, _ = scraped_load
    query = monitoring.adapter_query(LABELS["namespace"], LABELS["pod"])
    result = stack.instant_query(prom, query, at=stop - 1)
    assert [r["metric"] for r in result] == [{"pod": LABELS["pod"]}]
    wait = float(result[0]["value"][1])
    assert 0 <= wait < 30  # mean queue wait in seconds, under load
    # the series query the adapter discovers metrics with finds the pod's series
    rule = monitoring.adapter_rule()
    series = stack.instant_query(prom, rule["seriesQuery"])
    assert series and all(s["metric"]["pod"] == LABELS["pod"] for s in series)


def test_dashboard_renders_with_data_in_every_panel(scraped_load, monitoring, tmp_path):
    render = load_script("deploy/monitoring/render.py")
    prom, start, stop, _ = scraped_load
    out = tmp_path / "dashboard.png"
    counts = render.render(monitoring.dashboard(), prom, start, stop + 2, out, rate_interval=RATE_WINDOW,
                           step=1.0)
    assert out.stat().st_size > 50_000
    assert all(n > 0 for n in counts.values()), counts
    if os.environ.get("LONGDOC_WRITE_DASHBOARD_PNG"):
        shutil.copy(out, ROOT / "docs/dashboard.png")
