"""The serving path imports neither torch nor transformers nor the onnx package (docs/DESIGN.md, import rules):
a subprocess loads a real exported model, serves one request, then looks at sys.modules."""

import subprocess
import sys

CODE = """
import asyncio, sys
import httpx
import longdoc.service.app, longdoc.service.workers, longdoc.service.batcher, longdoc.service.batching, longdoc.service.cli, longdoc.service.metrics
from longdoc.service.settings import Settings

async def main(model_dir):
    app = longdoc.service.app.create_app(Settings(models={"qa": model_dir}, threads=1))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/qa", json={"question": "where", "document": "the gold is here"})
            assert r.status_code == 200, r.text

asyncio.run(main(sys.argv[1]))
print("HEAVY", sorted(m for m in ("torch", "transformers", "onnx") if m in sys.modules))
"""


def test_serving_path_imports_no_torch(tiny_qa_dir):
    out = subprocess.run([sys.executable, "-c", CODE, str(tiny_qa_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


FAKE_CODE = """
import sys
import numpy as np
import longdoc.testing, longdoc.testing.fake_worker, longdoc.testing.tiny_models
from longdoc.service.workers import EncoderBatch
from longdoc.testing.fake_worker import FakeWorker
w = FakeWorker(task="qa")
ids = w.tokenizer.encode("where is the gold").ids
out = w.run(EncoderBatch(np.array([ids]), np.ones((1, len(ids)), np.int64), None))
assert out["start_logits"].max() == 10.0, out
print("HEAVY", sorted(m for m in ("torch", "transformers", "onnx") if m in sys.modules))
"""


def test_longdoc_testing_imports_no_torch():
    """bench/slow_clients.py serves FakeWorker on a serve-only install: the
    fake worker, and the tiny-model builders until one is called, import no torch (issue 26)."""
    out = subprocess.run([sys.executable, "-c", FAKE_CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
