"""The CPU image, built and run for real: `buildah build` of docker/Dockerfile on the local Debian
base (.ci/containers-setup.sh makes it), `podman run --network host` with a tiny exported QA model
mounted at /models and a read-only root filesystem (as the Kubernetes manifests run it). It must
get ready, answer a QA request exactly as the service does in-process, pass its HEALTHCHECK, hold
no torch, run as uid 10001, and on SIGTERM finish the request in flight and exit 0.

Skipped only where buildah/podman are missing (CI installs them, and there it must run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.deploy import stack
from tests.deploy.conftest import ROOT, require_tool
from tests.polling import until

BASE_IMAGE = "localhost/debian-python:bookworm"
IMAGE = "localhost/longdoc:ci"
QUESTION = "where does the river run"
DOCUMENT = stack.document(40, 3)


@pytest.fixture(scope="module")
def image() -> str:
    why = "run .ci/containers-setup.sh (installs podman, buildah, runc)"
    buildah, podman = require_tool("buildah", why), require_tool("podman", why)
    if subprocess.run([podman, "image", "exists", BASE_IMAGE]).returncode != 0:
        message = f"base image {BASE_IMAGE} missing: run .ci/containers-setup.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    # --format docker keeps the HEALTHCHECK (the OCI format has none); --layers reuses the
    # dependency layer between builds.
    cmd = [buildah, "build", "--isolation", "chroot", "--layers", "--format", "docker",
           "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-f", "docker/Dockerfile", "-t", IMAGE, "."]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return IMAGE


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([shutil.which("podman"), *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"podman {' '.join(args)}: {out.stdout}{out.stderr}"
    return out


def post_json(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def in_flight_requests(url: str) -> float:
    """longdoc_in_flight_requests, summed over endpoints, from the service's /metrics."""
    _, body = stack.get(url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("longdoc_in_flight_requests{"))


def test_image_is_torch_free_and_non_root(image):
    probe = ("import importlib.util as u, os, longdoc.service.app, onnxruntime, tokenizers; "
             "print(os.getuid(), u.find_spec('torch') is None, u.find_spec('transformers') is None)")
    out = podman("run", "--rm", "--network", "host", "--entrypoint", "python3", image, "-c", probe, timeout=120)
    assert out.stdout.split() == ["10001", "True", "True"], out.stdout + out.stderr
    inspect = json.loads(podman("image", "inspect", image).stdout)[0]
    assert inspect["Config"]["User"] == "10001:10001"
    assert inspect["Config"]["Entrypoint"] == ["longdoc", "serve"]
    assert inspect["Healthcheck"]["Test"][:2] == ["CMD", "python3"]


@pytest.fixture
def readable_model(tiny_qa_dir, tmp_path):
    """A copy of the tiny QA model that the image's user (uid 10001) can read."""
    model = tmp_path / "models" / "qa"
    shutil.copytree(tiny_qa_dir, model)
    for path in [tmp_path, tmp_path / "models", model, *model.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


def in_process_answer(model_dir) -> dict:
    from fastapi.testclient import TestClient

    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings

    with TestClient(create_app(Settings(models={"qa": model_dir}, threads=1))) as client:
        r = client.post("/v1/qa", json={"question": QUESTION, "document": DOCUMENT})
        assert r.status_code == 200, r.text
        return r.json()


def test_container_serves_qa_and_drains_on_sigterm(image, readable_model):
    port = stack.free_port()
    url = f"http://127.0.0.1:{port}"
    name = f"longdoc-ci-{os.getpid()}"
    podman("rm", "-f", name, check=False)
    podman(
        "run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
        "-v", f"{readable_model}:/models/qa:ro",
        "-e", 'LONGDOC_MODELS={"qa": "/models/qa"}', "-e", f"LONGDOC_PORT={port}", "-e", "LONGDOC_THREADS=1",
        # a lone request waits this long for company in the batcher: a request that is surely in
        # flight when SIGTERM comes
        "-e", "LONGDOC_MAX_WAIT_MS=2500", "-e", "LONGDOC_SHUTDOWN_GRACE_S=20",
        image,
    )
    try:
        def running() -> bool:
            return podman("inspect", "-f", "{{.State.Running}}", name, check=False).stdout.strip() == "true"

        try:
            stack.wait_for(url + "/readyz", 120, alive=running)
        except (TimeoutError, RuntimeError):
            pytest.fail("not ready: " + podman("logs", name, check=False).stderr[-3000:])
        assert podman("healthcheck", "run", name, check=False).returncode == 0

        status, body = post_json(url + "/v1/qa", {"question": QUESTION, "document": DOCUMENT})
        assert status == 200, body
        expected = in_process_answer(readable_model)
        (answer,), (want,) = body["results"][0]["answers"], expected["results"][0]["answers"]
        assert (answer["text"], answer["start"], answer["end"]) == (want["text"], want["start"], want["end"])
        assert answer["score"] == pytest.approx(want["score"], abs=1e-3)
        assert DOCUMENT[answer["start"]:answer["end"]] == answer["text"]

        # SIGTERM while a request is in flight: it is answered, nothing new is, the process exits 0
        in_flight: dict = {}
        client = threading.Thread(target=lambda: in_flight.update(
            result=post_json(url + "/v1/qa", {"question": QUESTION, "document": DOCUMENT})))
        client.start()
        # in flight: it then waits LONGDOC_MAX_WAIT_MS (2.5 s) in the batcher for company
        until(lambda: in_flight_requests(url) >= 1, "the request is in flight", timeout_s=30)
        sent = time.monotonic()
        podman("kill", "--signal", "TERM", name)

        def listener_closed() -> bool:
            try:
                stack.get(url + "/livez", timeout=2)
            except OSError:
                return True
            return False

        until(listener_closed, "SIGTERM closed the listener", timeout_s=10)
        with pytest.raises(OSError):  # the listener is closed (or the connection refused / reset)
            status, _ = post_json(url + "/v1/qa", {"question": QUESTION, "document": DOCUMENT}, timeout=10)
            if status == 503:  # accepted just before closing: refused by the draining service
                raise ConnectionRefusedError
        client.join(30)
        assert in_flight["result"][0] == 200, in_flight
        assert in_flight["result"][1]["results"][0]["answers"][0]["text"] == want["text"]
        exit_code = podman("wait", name, timeout=40).stdout.strip()
        assert exit_code == "0", podman("logs", name, check=False).stderr[-3000:]
        assert time.monotonic() - sent < 20
    finally:
        podman("rm", "-f", name, check=False)
