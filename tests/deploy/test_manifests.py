"""Kubernetes manifests: every overlay renders with `kubectl kustomize`, validates against the
Kubernetes schemas (kubernetes-validate, strict), and is consistent with the service it deploys
(routes, settings, drain timing, the image's user, the HPA metric, the generated rules)."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import OVERLAYS, ROOT, find, load_monitoring, require_tool

# Oldest and newest Kubernetes the manifests are meant for (autoscaling/v2, policy/v1 need >= 1.23;
# 1.30 is the oldest minor still commonly supported).
K8S_VERSIONS = ("1.30.0", "1.37.0")
# Kinds from the Prometheus Operator: no schema in kubernetes-validate, checked field by field below.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
EXPECTED_KINDS = {
    "Namespace", "ServiceAccount", "ConfigMap", "Service", "PersistentVolumeClaim", "Deployment",
    "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor", "PrometheusRule",
}


def container(docs: list[dict]) -> dict:
    (c,) = find(docs, "Deployment", "longdoc")["spec"]["template"]["spec"]["containers"]
    return c


def config_env(docs: list[dict]) -> dict[str, str]:
    """LONGDOC_* settings the pod gets: the generated ConfigMap plus the container's env values."""
    c = container(docs)
    (ref,) = [e["configMapRef"]["name"] for e in c["envFrom"]]
    env = dict(find(docs, "ConfigMap", ref)["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def test_generated_files_are_current(monitoring):
    stale = [str(p.relative_to(ROOT)) for p, text in monitoring.outputs().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"run python3 deploy/monitoring/generate.py: {stale}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(rendered, overlay):
    docs = rendered[overlay]
    assert {d["kind"] for d in docs} == EXPECTED_KINDS
    for doc in docs:
        assert doc["metadata"].get("namespace", "longdoc") == "longdoc" or doc["kind"] == "Namespace"
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error


def test_validator_catches_a_broken_manifest(rendered):
    deployment = copy.deepcopy(find(rendered["cpu"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = copy.deepcopy(find(rendered["cpu"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/readyz"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def app_get_routes() -> set[str]:
    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings

    # the app's GET operations, as its OpenAPI document lists them: its routes live in routers
    # (service/tasks/, service/operations.py), which FastAPI >= 0.16x keeps nested in app.routes
    paths = create_app(Settings()).openapi()["paths"]
    return {path for path, operations in paths.items() if "get" in operations}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_scrape_point_at_routes_the_app_has(rendered, overlay):
    docs = rendered[overlay]
    routes = app_get_routes()
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["path"] == probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/livez"
    for name, probe in probes.items():
        assert probe["path"] in routes, f"{name} probes {probe['path']}, not a GET route of longdoc.service.app"
        assert probe["port"] in ports
    assert int(config_env(docs)["LONGDOC_PORT"]) == ports["http"]
    monitor = find(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] in routes
    service = find(docs, "Service", "longdoc")
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert all(p["targetPort"] in ports for p in service["spec"]["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_is_a_real_service_setting(rendered, overlay, monkeypatch):
    from longdoc.service.settings import Settings

    env = config_env(rendered[overlay])
    fields = set(Settings.model_fields)
    for name, value in env.items():
        assert name.startswith("LONGDOC_"), name
        assert name[len("LONGDOC_"):].lower() in fields, f"{name} is not a field of longdoc.service.settings.Settings"
        monkeypatch.setenv(name, value)
    settings = Settings()  # parses every value as the service will
    assert settings.port == 8000 and settings.host == "0.0.0.0"
    # the queue-saturation alert divides by the limit the pods really have
    assert settings.max_queue_tokens == load_monitoring().max_queue_tokens()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drain_fits_in_the_termination_grace_period(rendered, overlay):
    from longdoc.service.settings import Settings

    docs = rendered[overlay]
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    grace = float(config_env(docs).get("LONGDOC_SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default))
    pre_stop = container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep_s = float(pre_stop[1])
    # preStop runs before SIGTERM and counts against the grace period; then the service drains.
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + grace + 1
    # the endpoint is off the Service before SIGTERM: readiness would notice within this anyway
    readiness = container(docs)["readinessProbe"]
    assert sleep_s >= readiness["periodSeconds"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context_and_volumes(rendered, overlay):
    docs = rendered[overlay]
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in c["volumeMounts"]:
        volume = volumes[mount["name"]]
        # writable paths are emptyDirs; everything else is read-only
        assert "emptyDir" in volume or mount.get("readOnly") is True, mount
    models = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
    assert "persistentVolumeClaim" in volumes[models["name"]]
    # the image's user is the pod's user (docker/Dockerfile: USER uid:gid)
    users = re.findall(r"^USER (\d+):(\d+)$", (ROOT / "docker/Dockerfile").read_text(), re.M)
    assert users and all(int(u) == pod["securityContext"]["runAsUser"] for u, _ in users)
    # models named in the config live under the mounted volume
    for path in json.loads(config_env(docs)["LONGDOC_MODELS"]).values():
        assert path.startswith("/models/")


def test_gpu_overlay_asks_for_a_gpu_and_cpu_does_not(rendered):
    gpu, cpu = container(rendered["gpu"]), container(rendered["cpu"])
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in json.dumps(cpu["resources"])
    assert json.loads(config_env(rendered["gpu"])["LONGDOC_DEVICES"]) == ["cuda"]
    assert json.loads(config_env(rendered["cpu"])["LONGDOC_DEVICES"]) == ["cpu"]
    assert gpu["image"].endswith(":gpu") and cpu["image"].endswith(":cpu")
    # a CPU pod batches by the measured CPU default (docs/service.md), not a GPU-sized budget
    from longdoc.service.settings import CPU_MAX_BATCH_TOKENS, Settings

    cpu_budget = config_env(rendered["cpu"]).get("LONGDOC_MAX_BATCH_TOKENS")
    assert Settings(max_batch_tokens=cpu_budget).batch_tokens_for("cpu") == CPU_MAX_BATCH_TOKENS
    for c in (gpu, cpu):
        assert "memory" in c["resources"]["requests"] and "memory" in c["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_pods(rendered, overlay):
    docs = rendered[overlay]
    deployment = find(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    assert selects(deployment["spec"]["selector"]["matchLabels"])
    assert selects(find(docs, "Service")["spec"]["selector"])
    assert selects(find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    assert selects(find(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"])
    service_labels = find(docs, "Service")["metadata"]["labels"]
    assert all(service_labels.get(k) == v
               for k, v in find(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items())
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2  # the PDB can then always let one go
    pvc = find(docs, "PersistentVolumeClaim")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]


def test_rules_and_autoscaling_come_from_the_generator(rendered, monitoring):
    docs = rendered["cpu"]
    assert find(docs, "PrometheusRule")["spec"]["groups"] == monitoring.rule_groups()
    hpa = find(docs, "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == monitoring.HPA_METRIC
    values = yaml.safe_load((ROOT / "deploy/prometheus-adapter/values.yaml").read_text())
    assert [r["name"]["as"] for r in values["rules"]["custom"]] == [monitoring.HPA_METRIC]
    names = {r["alert"] for g in monitoring.rule_groups() for r in g["rules"]}
    assert {"LongdocLatencyP99OverSLO", "LongdocErrorRatioHigh", "LongdocQueueSaturated",
            "LongdocNoReadyPods"} <= names
    # the dashboard in the ConfigMap is the generated one
    board = json.loads(find(docs, "ConfigMap", "longdoc-dashboard")["data"]["longdoc-dashboard.json"])
    assert board == monitoring.dashboard()


def test_promtool_accepts_the_rules(tmp_path):
    promtool = require_tool("promtool", "Debian package prometheus")
    rules = ROOT / "docker/prometheus/rules.yml"
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # and rejects a broken one (the check can fail)
    broken = tmp_path / "broken.yml"
    broken.write_text(rules.read_text().replace("sum by (endpoint)", "sum by (endpoint", 1))
    out = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    # the compose Prometheus config loads with those rules
    config = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    config["rule_files"] = [str(rules)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_wires_the_generated_files():
    compose = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())
    mounts = [m.split(":")[0] for s in compose["services"].values() for m in s.get("volumes", [])]
    for mount in mounts:
        assert (ROOT / "docker" / mount).resolve().exists() or mount == "../models", mount
    assert "../deploy/base/grafana-dashboard.json" in mounts
    assert "./prometheus/rules.yml" in mounts
    assert compose["services"]["longdoc"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_serves_every_default_model():
    """Issue 38, item 9: compose.yaml served only qa. It names each shipped model (models/pyproject.toml)
    at its mount under /models, and the settings parse as the service reads them."""
    from longdoc.service.settings import Settings
    from tests.test_packaging import shipped_names

    service = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())["services"]["longdoc"]
    assert "../models:/models:ro" in service["volumes"]
    models = json.loads(service["environment"]["LONGDOC_MODELS"])
    assert models == {name: f"/models/{name}" for name in shipped_names()}
    assert set(Settings(models=models).models) == {"qa", "summarize", "classify", "embed"}


def test_dashboard_layout_and_variables(monitoring):
    board = json.loads((ROOT / "deploy/base/grafana-dashboard.json").read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & cell, f"{p['title']} overlaps another panel"
        cells |= cell
    variables = {v["name"] for v in board["templating"]["list"]} | {"__rate_interval"}
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            for used in re.findall(r"\$(\w+)", t["expr"]):
                assert used in variables, f"{p['title']}: ${used} is not a dashboard variable"
    # what the issue asks the dashboard to show, by metric
    exprs = " ".join(e for _, e in monitoring.dashboard_expressions())
    for metric in ("longdoc_request_duration_seconds_bucket", "longdoc_queue_duration_seconds",
                   "longdoc_inference_duration_seconds", "longdoc_batch_size", "longdoc_batch_tokens",
                   "longdoc_padding_waste_ratio", "longdoc_request_failures_total", "longdoc_in_flight_requests",
                   "longdoc_queue_depth_requests", "longdoc_queue_depth_tokens", "longdoc_ready",
                   "longdoc_input_tokens_total"):
        assert metric in exprs, metric
    assert 'by (le, length_bucket)' in exprs and 'by (le, endpoint)' in exprs
