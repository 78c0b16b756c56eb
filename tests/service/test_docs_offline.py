"""/docs in a real browser with no internet: headless Chromium (Debian package `chromium`; .ci/run
installs it) resolves no host but the server's, and Swagger UI must still list the operations.
Run as a script, it also saves the screenshot docs/swagger-offline.png."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from longdoc.service.settings import Settings
from tests.deploy.conftest import require_tool
from tests.service.conftest import ThreadServer, fake_factory

ROOT = Path(__file__).resolve().parents[2]


def chromium(url: str, *args: str) -> subprocess.CompletedProcess:
    browser = require_tool("chromium", "opens /docs headless (Debian package chromium)")
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         # offline: every host name but the server's fails to resolve (a CDN link would break the page)
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--no-first-run",
         "--virtual-time-budget=15000", *args, url],
        capture_output=True, text=True, timeout=120)


def served(fn):
    settings = Settings(models={"qa": "qa", "cls": "classify", "sum": "summarize"}, warmup=False)
    with ThreadServer(settings, worker_factory=fake_factory()) as server:
        return fn(server.url)


def test_swagger_ui_lists_the_operations_offline():
    dom = served(lambda url: chromium(f"{url}/docs", "--dump-dom")).stdout
    # Swagger UI renders each operation as an opblock once its script ran and read /openapi.json
    for path in ("/v1/qa", "/v1/summarize", "/v1/classify", "/v1/models", "/readyz", "/metrics"):
        assert f'data-path="{path}"' in dom, path
    assert "Failed to load API definition" not in dom


if __name__ == "__main__":  # python -m tests.service.test_docs_offline: refresh the screenshot
    out = ROOT / "docs" / "swagger-offline.png"
    run = served(lambda url: chromium(f"{url}/docs", f"--screenshot={out}", "--window-size=1280,1400"))
    sys.exit(run.returncode)
