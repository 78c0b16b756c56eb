"""The project's PromQL in one place: dashboard panels, alert rules and the autoscaling metric are
data here, and every file that holds PromQL is generated from it:

    deploy/base/grafana-dashboard.json       Grafana dashboard (also provisioned by docker/compose.yaml)
    deploy/base/prometheusrule.yaml          PrometheusRule (Prometheus Operator)
    docker/prometheus/rules.yml              the same rule groups as a plain rule file (compose, promtool)
    deploy/prometheus-adapter/values.yaml    prometheus-adapter rule serving the HPA's custom metric

    python3 deploy/monitoring/generate.py            # rewrite the files
    python3 deploy/monitoring/generate.py --check    # exit 1 if a file is not what this would write

tests/deploy/ checks that the files are current and that every expression returns data from a real
Prometheus scraping the service (metric names: service/metrics.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
JOB = 'job="longdoc"'
RATE = "$__rate_interval"  # Grafana picks it from the scrape interval; rules use fixed windows

# Latency objectives (p99, seconds) per endpoint, for the alert. Summarization decodes token by
# token, so its objective is looser. Values are for the CPU default; set them for your hardware.
P99_SLO_SECONDS = {"qa": 10.0, "classify": 10.0, "summarize": 60.0}
ERROR_RATIO_MAX = 0.05
QUEUE_SATURATION = 0.8  # share of LONGDOC_MAX_QUEUE_TOKENS over which the queue counts as saturated
# Server-side failures; validation / too_large / cancelled are the client's doing.
SERVER_FAILURES = "overloaded|timeout|unavailable|internal"
# HPA target: mean queue wait per request, per pod.
HPA_METRIC = "longdoc_queue_wait_seconds"
# Ready replicas as the service sees itself: longdoc_ready is 1 exactly when /readyz answers 200
# (loaded, warmed up, every worker healthy, not draining). A replica that is not scraped has no
# series, so with none left the sum is empty: `or vector(0)` makes that a 0.
READY_REPLICAS = f"sum(longdoc_ready{{{JOB}}}) or vector(0)"
# The Kubernetes view, kube-state-metrics' count of pods whose Ready condition holds (the readiness
# probe, so it lags /readyz by the probe period); where kube-state-metrics does not run (compose,
# the tests) it falls back to longdoc_ready. Dashboard only: the alert needs no kube-state-metrics.
READY_PODS_KUBERNETES = f'sum(kube_deployment_status_replicas_ready{{deployment="longdoc"}}) or {READY_REPLICAS}'



def max_queue_tokens() -> int:
    """LONGDOC_MAX_QUEUE_TOKENS from the base ConfigMap, so the saturation alert follows it."""
    for line in (ROOT / "deploy/base/longdoc.env").read_text().splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "LONGDOC_MAX_QUEUE_TOKENS":
            return int(value)
    raise ValueError("LONGDOC_MAX_QUEUE_TOKENS missing from deploy/base/longdoc.env")


def quantile(q: float, metric: str, by: str, window: str = RATE, where: str = JOB) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{where}}}[{window}])))"


def mean(metric: str, by: str, window: str = RATE, where: str = JOB) -> str:
    """Mean of a histogram's observations over the window (0 while nothing was observed)."""
    return (
        f"sum by ({by}) (rate({metric}_sum{{{where}}}[{window}]))"
        f" / clamp_min(sum by ({by}) (rate({metric}_count{{{where}}}[{window}])), 1e-9)"
    )


# ----------------------------------------------------------------------------------------------
# Dashboard


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id
    targets: tuple[tuple[str, str], ...]  # (legend format, PromQL)
    description: str = ""
    stack: bool = False


REQ = "longdoc_request_duration_seconds"
EP = f'{JOB},endpoint=~"$endpoint"'  # request-level series, filtered by the dashboard's endpoint variable

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Latency", (
        Panel("Request latency per endpoint (p50 / p95 / p99)", "s", tuple(
            (f"{{{{endpoint}}}} p{int(q * 100)}", quantile(q, REQ, "endpoint", where=EP)) for q in (0.5, 0.95, 0.99)
        ), "Whole request, received to answered."),
        *(Panel(f"p{int(q * 100)} latency per document length", "s", (
            ("{{length_bucket}}", quantile(q, REQ, "length_bucket", where=EP)),
        ), "Length bucket: tokens of the request's longest document, le_N = at most N "
           "(block size doubling up to the model maximum), gt_N = longer than the model (windows).")
          for q in (0.5, 0.95, 0.99)),
    )),
    ("Where the time goes", (
        Panel("Mean time per request by stage", "s", (
            ("tokenize", mean("longdoc_tokenize_duration_seconds", "job", where=EP)),
            ("queue", mean("longdoc_queue_duration_seconds", "job", where=EP)),
            ("inference", mean("longdoc_inference_duration_seconds", "job", where=EP)),
        ), "Queue time growing while inference time stays flat means too few replicas.", stack=True),
        Panel("Queue vs inference (p95)", "s", (
            ("queue p95", quantile(0.95, "longdoc_queue_duration_seconds", "job", where=EP)),
            ("inference p95", quantile(0.95, "longdoc_inference_duration_seconds", "job", where=EP)),
        )),
        Panel("Windows per request", "short", (
            ("{{endpoint}} mean", mean("longdoc_windows_per_request", "endpoint", where=EP)),
        ), "Documents longer than the model are split into overlapping windows."),
        Panel("Time to first token, streamed summaries (p50 / p95)", "s", tuple(
            (f"{{{{model}}}} p{int(q * 100)}", quantile(q, "longdoc_time_to_first_token_seconds", "model"))
            for q in (0.5, 0.95)
        ), "Received to the first token event: tokenization, queue, encoder and the first decoder step "
           "(a beam search sends its tokens when it ends)."),
    )),
    ("Batching", (
        Panel("Batch size (sequences per batch)", "short", (
            ("{{model}} mean", mean("longdoc_batch_size", "model")),
            ("{{model}} p95", quantile(0.95, "longdoc_batch_size", "model")),
        )),
        Panel("Batch tokens (padded)", "short", (
            ("{{model}} mean", mean("longdoc_batch_tokens", "model")),
            ("{{model}} p95", quantile(0.95, "longdoc_batch_tokens", "model")),
        ), "Padded cost of a batch: longest sequence x sequences."),
        Panel("Padding waste", "percentunit", (
            ("{{model}} mean", mean("longdoc_padding_waste_ratio", "model")),
        ), "Share of the padded tokens that are padding; length buckets keep it low."),
    )),
    ("Throughput", (
        Panel("Requests per second", "reqps", (
            ("{{endpoint}}", f"sum by (endpoint) (rate({REQ}_count{{{EP}}}[{RATE}]))"),
        ), "Requests answered (a request may carry several documents)."),
        Panel("Input tokens per second (encoder, unpadded)", "short", (
            ("{{model}}", f"sum by (model) (rate(longdoc_input_tokens_total{{{EP}}}[{RATE}]))"),
        ), "Real tokens run through the encoder: every window (overlaps, question and special tokens "
           "included), the encoder input of each summary; padding excluded (see Padding waste)."),
        Panel("Windows and generated tokens per second", "short", (
            ("{{model}} windows/s", f"sum by (model) (rate(longdoc_windows_per_request_sum{{{EP}}}[{RATE}]))"),
            ("{{model}} generated tokens/s", f"sum by (model) (rate(longdoc_generated_tokens_total{{{JOB}}}[{RATE}]))"),
        )),
    )),
    ("Errors and availability", (
        Panel("Errors by reason", "reqps", (
            ("{{reason}}", f"sum by (reason) (rate(longdoc_request_failures_total{{{EP}}}[{RATE}]))"),
        ), "validation 422, too_large 413, overloaded 429, timeout 504, unavailable 503, "
           "cancelled (client gone), internal 500.", stack=True),
        Panel("Server error ratio", "percentunit", (
            ("{{endpoint}}",
             f"sum by (endpoint) (rate(longdoc_request_failures_total{{{EP},reason=~\"{SERVER_FAILURES}\"}}[{RATE}]))"
             f" / clamp_min(sum by (endpoint) (rate({REQ}_count{{{EP}}}[{RATE}])), 1e-9)"),
        ), f"Failures for reasons {SERVER_FAILURES.replace('|', ', ')} per request answered."),
        Panel("Ready replicas", "short", (
            ("ready (longdoc_ready)", READY_REPLICAS),
            ("ready pods (Kubernetes)", READY_PODS_KUBERNETES),
        ), "longdoc_ready: replicas whose /readyz answers 200 (models loaded and warmed up, every worker "
           "healthy, not draining). Kubernetes: kube-state-metrics' ready pods of the Deployment (the "
           "readiness probe, a few seconds behind); without kube-state-metrics, the same as longdoc_ready."),
    )),
    ("Saturation", (
        Panel("In-flight requests", "short", (
            ("{{endpoint}}", f"sum by (endpoint) (longdoc_in_flight_requests{{{EP}}})"),
        )),
        Panel("Queue depth (sequences)", "short", (
            ("{{model}}", f"sum by (model) (longdoc_queue_depth_requests{{{JOB}}})"),
        )),
        Panel("Queue depth (tokens)", "short", (
            ("{{model}}", f"sum by (model) (longdoc_queue_depth_tokens{{{JOB}}})"),
        ), "Over LONGDOC_MAX_QUEUE_TOKENS a model answers 429."),
    )),
)


def dashboard() -> dict:
    panels, panel_id, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": panel_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        width = 24 // len(row_panels)
        for i, p in enumerate(row_panels):
            x = i * width
            panels.append({
                "type": "timeseries",
                "title": p.title,
                "description": p.description,
                "id": panel_id,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": width, "x": x, "y": y},
                "fieldConfig": {
                    "defaults": {
                        "unit": p.unit,
                        "custom": {"fillOpacity": 10, "showPoints": "never",
                                   "stacking": {"mode": "normal" if p.stack else "none"}},
                    },
                    "overrides": [],
                },
                "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [
                    {"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for k, (legend, expr) in enumerate(p.targets)
                ],
            })
            panel_id += 1
        y += 8
    return {
        "uid": "longdoc",
        "title": "longdoc: long-document serving",
        "tags": ["longdoc"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
             "current": {}, "hide": 0},
            {"name": "endpoint", "type": "query", "label": "Endpoint", "hide": 0,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": f"label_values({REQ}_count{{{JOB}}}, endpoint)", "refId": "endpoint"},
             "definition": f"label_values({REQ}_count{{{JOB}}}, endpoint)",
             "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
             "current": {"selected": True, "text": ["All"], "value": ["$__all"]}},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def dashboard_expressions(rate_interval: str | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the dashboard; with `rate_interval`, the Grafana
    variables are filled in as Grafana would ($endpoint = All)."""
    out = [(p.title, expr) for _, row in ROWS for p in row for _, expr in p.targets]
    if rate_interval:
        out = [(t, fill_variables(e, rate_interval)) for t, e in out]
    return out


def fill_variables(expr: str, rate_interval: str) -> str:
    return expr.replace(RATE, rate_interval).replace("$endpoint", ".*")


# ----------------------------------------------------------------------------------------------
# Alerts


@dataclass(frozen=True)
class Alert:
    name: str
    value: str  # the watched quantity; returns data whenever the service is scraped
    condition: str  # appended to `value` to make the alert expression
    for_: str
    severity: str
    summary: str
    description: str

    @property
    def expr(self) -> str:
        return f"({self.value}) {self.condition}"


def _p99_over_slo() -> str:
    # p99 per endpoint divided by that endpoint's objective: > 1 means over it.
    slo = " or ".join(f'label_replace(vector({s}), "endpoint", "{e}", "", "")' for e, s in P99_SLO_SECONDS.items())
    return f"{quantile(0.99, REQ, 'endpoint', '5m')} / on (endpoint) ({slo})"


def alerts() -> tuple[Alert, ...]:
    limit = max_queue_tokens()
    return (
        Alert(
            "LongdocLatencyP99OverSLO", _p99_over_slo(), "> 1", "10m", "warning",
            "longdoc {{ $labels.endpoint }}: p99 latency over its objective",
            "p99 request latency of {{ $labels.endpoint }} is {{ $value | humanizePercentage }} of its "
            "objective (" + ", ".join(f"{e} {s:g} s" for e, s in P99_SLO_SECONDS.items()) + ") over 5 minutes.",
        ),
        Alert(
            "LongdocErrorRatioHigh",
            f"sum by (endpoint) (rate(longdoc_request_failures_total{{{JOB},reason=~\"{SERVER_FAILURES}\"}}[5m]))"
            f" / clamp_min(sum by (endpoint) (rate({REQ}_count{{{JOB}}}[5m])), 1e-9)",
            f"> {ERROR_RATIO_MAX}", "5m", "critical",
            "longdoc {{ $labels.endpoint }}: server errors over " + f"{ERROR_RATIO_MAX:.0%}",
            "{{ $value | humanizePercentage }} of {{ $labels.endpoint }} requests failed on the server side "
            f"({SERVER_FAILURES.replace('|', ', ')}) over 5 minutes.",
        ),
        Alert(
            "LongdocQueueSaturated",
            f"max by (pod, model) (max_over_time(longdoc_queue_depth_tokens{{{JOB}}}[5m])) / {limit}",
            f"> {QUEUE_SATURATION}", "5m", "warning",
            "longdoc {{ $labels.model }}: batcher queue near its limit",
            "The queue of {{ $labels.model }} on {{ $labels.pod }} held {{ $value | humanizePercentage }} of "
            f"LONGDOC_MAX_QUEUE_TOKENS ({limit}); beyond it requests get 429. Add replicas or check the HPA.",
        ),
        Alert(
            "LongdocRejectingOverload",
            f"sum by (endpoint) (rate(longdoc_request_failures_total{{{JOB},reason=\"overloaded\"}}[5m]))",
            "> 0", "5m", "warning",
            "longdoc {{ $labels.endpoint }}: answering 429 (queue full)",
            "{{ $value | humanize }} requests/s of {{ $labels.endpoint }} are turned away with 429.",
        ),
        Alert(
            "LongdocNoReadyPods",
            READY_REPLICAS,
            "== 0", "2m", "critical",
            "longdoc: no ready replica",
            "No longdoc replica reports longdoc_ready 1 (or none is scraped): the service answers nothing.",
        ),
    )


def rule_groups() -> list[dict]:
    return [{
        "name": "longdoc.alerts",
        "rules": [
            {"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
             "annotations": {"summary": a.summary, "description": a.description}}
            for a in alerts()
        ],
    }]


# ----------------------------------------------------------------------------------------------
# Autoscaling: prometheus-adapter rule for the HPA's Pods metric


def adapter_rule() -> dict:
    series = "longdoc_queue_duration_seconds"
    window = "2m"
    return {
        "seriesQuery": f'{series}_count{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{series}_count$", "as": HPA_METRIC},
        # mean queue wait per request over the window, per pod (0 while idle)
        "metricsQuery": (
            f"sum by (<<.GroupBy>>) (rate({series}_sum{{<<.LabelMatchers>>}}[{window}]))"
            f" / clamp_min(sum by (<<.GroupBy>>) (rate({series}_count{{<<.LabelMatchers>>}}[{window}])), 1e-9)"
        ),
    }


def adapter_query(namespace: str, pod: str) -> str:
    """The adapter's query for one pod, as prometheus-adapter expands the template."""
    q = adapter_rule()["metricsQuery"]
    return q.replace("<<.GroupBy>>", "pod").replace("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~"{pod}"')


# ----------------------------------------------------------------------------------------------
# Files

HEADER = "# Generated by deploy/monitoring/generate.py: edit that file, then run it.\n"


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True)


def outputs() -> dict[Path, str]:
    prometheus_rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "longdoc", "labels": {"release": "prometheus"}},
        "spec": {"groups": rule_groups()},
    }
    adapter_values = {"rules": {"default": False, "custom": [adapter_rule()]}}
    return {
        ROOT / "deploy/base/grafana-dashboard.json": json.dumps(dashboard(), indent=2) + "\n",
        ROOT / "deploy/base/prometheusrule.yaml": HEADER + _yaml(prometheus_rule),
        ROOT / "docker/prometheus/rules.yml": HEADER + _yaml({"groups": rule_groups()}),
        ROOT / "deploy/prometheus-adapter/values.yaml": (
            HEADER + "# Helm values for the prometheus-community/prometheus-adapter chart: serves the\n"
            f"# custom metric {HPA_METRIC} (mean queue wait per request, per pod) to the HPA.\n"
            + _yaml(adapter_values)
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Generate the dashboard, alert rules and adapter rule.")
    parser.add_argument("--check", action="store_true", help="only check that the files are current")
    args = parser.parse_args()
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("stale (run python3 deploy/monitoring/generate.py):", *stale, file=sys.stderr)
        return 1
    for path in stale:
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
