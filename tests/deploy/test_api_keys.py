"""deploy/components/api-keys: an overlay with it mounts Secret longdoc-api-keys and points
LONGDOC_API_KEY_FILE at the file the service reads keys from; the example Secret is that file."""

from __future__ import annotations

import os
import subprocess

import kubernetes_validate
import yaml

from longdoc.service.access import read_key_file
from tests.deploy.conftest import ROOT, find, require_tool

COMPONENT = ROOT / "deploy" / "components" / "api-keys"


def test_api_keys_component_mounts_the_secret(tmp_path):
    kubectl = require_tool("kubectl", "kubectl renders the kustomizations")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes only relative paths to other kustomizations
        "resources": [os.path.relpath(ROOT / "deploy" / "overlays" / "cpu", tmp_path)],
        "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    out = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    deployment = find(docs, "Deployment", "longdoc")
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "longdoc-api-keys" and "optional" not in volume["secret"]
    assert mount["readOnly"] and env["LONGDOC_API_KEY_FILE"] == mount["mountPath"] + "/keys"
    assert {m["name"] for m in c["volumeMounts"]} >= {"models", "tmp", "api-keys"}  # merged, not replaced


def test_example_secret_is_a_key_file(tmp_path):
    secret = yaml.safe_load((COMPONENT / "secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, "1.30.0", strict=True)
    (tmp_path / "keys").write_text(secret["stringData"]["keys"])
    keys = read_key_file(tmp_path / "keys")
    assert len(keys) == 2 and all(k.startswith("REPLACE-WITH") for k in keys)
