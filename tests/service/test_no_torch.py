"""The serving path imports neither torch nor transformers (docs/DESIGN.md, import rules)."""

import subprocess
import sys

CODE = """
import sys
import service.app, service.workers, service.batcher, service.batching, service.cli, service.metrics
import export.runtime, export.manifest
app = service.app.create_app(service.settings.Settings())
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_serving_path_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
