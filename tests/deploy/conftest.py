"""Shared helpers for the deployment tests: the repository root, the monitoring generator (the one
source of the project's PromQL) and external tools that CI installs (.ci/run)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")


def load_script(relpath: str):
    """A script of deploy/ as a module (deploy/ is not a package)."""
    name = "longdoc_" + relpath.removesuffix(".py").replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_monitoring():
    """deploy/monitoring/generate.py: the dashboard, rules and adapter rule as data."""
    return load_script("deploy/monitoring/generate.py")


def require_tool(name: str, why: str) -> str:
    """Path of an external tool. Missing: the test fails under CI (where .ci/run installs it) and is
    skipped elsewhere, saying what to install."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found ({why})"
        if os.environ.get("CI"):
            pytest.fail(message + "; .ci/run should have installed it")
        pytest.skip(message)
    return path


def render_overlay(overlay: str) -> list[dict]:
    kubectl = require_tool("kubectl", "renders the Kustomize overlays with `kubectl kustomize`")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/overlays" / overlay)],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def monitoring():
    return load_monitoring()


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render_overlay(overlay) for overlay in OVERLAYS}


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]
