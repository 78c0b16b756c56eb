"""Every install line of README.md resolves to a working, minimal environment: the serve-only and
gpu-only sets hold exactly one ONNX Runtime and no torch, and wherever torch comes in it is the
pinned CPU build. Resolved against the package index (`pip install --dry-run --report`): nothing
is installed, and pip fetches only metadata."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# pip's messages when the index cannot be reached (as against a requirement it cannot satisfy)
UNREACHABLE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                         r"Network is unreachable|ConnectTimeout|ReadTimeout|Failed to establish a new connection")


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(extra: str) -> list[str]:
    """The core dependencies and the extra's, with longdoc[other] references expanded."""
    out = list(PYPROJECT["project"]["dependencies"])
    for r in EXTRAS[extra]:
        nested = re.fullmatch(r"longdoc\[(\w+)\]", r)
        out += requirements(nested.group(1)) if nested else [r]
    return out


def index_unreachable(detail: str) -> None:
    """Skipped, saying why (failed under CI, where the index must be reachable)."""
    message = f"the package index cannot be reached; this test resolves the extras against it:\n{detail}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def resolve(extra: str) -> dict[str, str]:
    """Distribution name -> version pip would install for `pip install longdoc[extra]` into an empty venv."""
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
             "--timeout", "20", "--retries", "1", *requirements(extra)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        index_unreachable("pip did not answer in 300 s")
    if run.returncode != 0:
        if UNREACHABLE.search(run.stderr):
            index_unreachable(run.stderr[-600:])
        pytest.fail(f"pip cannot resolve longdoc[{extra}]:\n{run.stderr[-2000:]}")
    report = json.loads(run.stdout)
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict[str, str]]:
    """All four sets at once (pip mostly waits on the index)."""
    from concurrent.futures import ThreadPoolExecutor

    extras = ("serve", "gpu", "torch", "models")
    with ThreadPoolExecutor(len(extras)) as pool:
        return dict(zip(extras, pool.map(resolve, extras)))


def test_gpu_is_serve_with_the_gpu_build_of_onnxruntime():
    swap = {"onnxruntime": "onnxruntime-gpu"}
    assert sorted(swap.get(name(r), name(r)) for r in EXTRAS["serve"]) == sorted(name(r) for r in EXTRAS["gpu"])


@pytest.mark.parametrize("extra", ["serve", "gpu"])
def test_serving_sets_hold_one_onnxruntime_and_no_torch(extra, resolved):
    installed = resolved[extra]
    runtimes = {"onnxruntime", "onnxruntime-gpu"} & set(installed)
    assert runtimes == {"onnxruntime" if extra == "serve" else "onnxruntime-gpu"}
    assert not {"torch", "transformers", "onnx", "onnxscript"} & set(installed)
    # a whole service: `longdoc serve` runs on this set alone
    assert {"fastapi", "uvicorn", "pydantic-settings", "prometheus-client", "fastapi-offline",
            "tokenizers"} <= set(installed)


@pytest.mark.parametrize("extra", ["torch", "models"])
def test_torch_is_always_the_pinned_cpu_build(extra, resolved):
    installed = resolved[extra]
    assert installed["torch"].split("+")[0] == "2.13.0"
    assert not [n for n in installed if n.startswith(("nvidia-", "triton"))], sorted(installed)
    assert "onnxscript" not in installed  # never imported
