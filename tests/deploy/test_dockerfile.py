"""Static checks of docker/: what the Dockerfile must hold to build both here and for real users,
and the requirements the serving images install (no torch, no transformers)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.deploy.conftest import ROOT, load_script

DOCKERFILE = (ROOT / "docker/Dockerfile").read_text()


def instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_base_image_is_an_argument_and_commands_call_python3():
    lines = instructions()
    assert lines[0] == "ARG BASE_IMAGE=python:3.12-slim"
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms and all(f.startswith("FROM ${BASE_IMAGE} AS ") or " AS " in f for f in froms)
    assert sum(f.startswith("FROM ${BASE_IMAGE}") for f in froms) >= 3
    for line in lines:
        if line.startswith(("RUN", "CMD", "HEALTHCHECK", "ENTRYPOINT")):
            assert not re.search(r"(^|[\s\"\[/])python(\s|\"|$)", line), f"bare python: {line}"


def test_no_ca_handling_and_no_root_at_run_time():
    lowered = DOCKERFILE.lower()
    for word in ("ca-certificates", "update-ca", "pip_cert", "ssl_cert", "--trusted-host", "cert="):
        assert word not in lowered, word
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    final_users = {}
    for stage in stages:
        name = stage.split()[2] if " AS " in stage.splitlines()[0] else "?"
        users = re.findall(r"^USER (\S+)", stage, re.M)
        final_users[name] = users[-1] if users else None
    # every image people run ends as the non-root user (serve inherits it from runtime)
    assert final_users["runtime"] == final_users["serve-gpu"] == final_users["tools"] == "10001:10001"
    assert final_users["serve"] is None
    assert "HEALTHCHECK" in DOCKERFILE and "/livez" in DOCKERFILE


def test_serving_requirements_hold_no_torch():
    requirements = load_script("docker/requirements.py")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = lambda reqs: {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in reqs}  # noqa: E731
    cpu = names(requirements.serve_requirements(pyproject))
    assert {"onnxruntime", "tokenizers", "fastapi", "uvicorn"} <= cpu
    assert not {"torch", "transformers"} & cpu
    gpu = requirements.serve_requirements(pyproject, "onnxruntime-gpu[cuda,cudnn]==1.31.1")
    assert "onnxruntime" not in names(gpu) and "onnxruntime-gpu[cuda,cudnn]==1.31.1" in gpu
    out = subprocess.run([sys.executable, "docker/requirements.py", "--extra", "torch"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    assert "torch" in names(out)
