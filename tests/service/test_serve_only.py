"""A serve-only install (the `serve` / `serve-gpu` images: onnxruntime, tokenizers, numpy, no
torch, transformers or onnx) can build every worker kind and run a request through each. A
subprocess installs a meta-path finder that refuses those imports, as if they were not installed;
the CUDA worker is built against an ONNX Runtime that claims CUDA but runs sessions on CPU, and
its I/O-binding encoder and decoder run on the CPU execution provider."""

import subprocess
import sys

CODE = r"""
import sys

BLOCKED = {"torch", "transformers", "onnx"}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (serve-only install)")
        return None


sys.meta_path.insert(0, NotInstalled())

import numpy as np
import onnxruntime as ort

from longdoc.model.search import resolve_settings
from longdoc.service.workers import (CudaWorker, DeviceDecoder, EncoderBatch, IoBindingEncoder, OnnxWorker,
                                     onnx_worker_factory)
from longdoc.service.settings import Settings
from tests.fake_cuda import claim_cuda, on_cpu

qa_dir, sum_dir = sys.argv[1], sys.argv[2]
ids = np.arange(7, 47, dtype=np.int64)[None]  # (1, 40)
batch = EncoderBatch(ids, np.ones_like(ids), np.zeros_like(ids))


def summarize_step(worker, step):
    states = worker.begin([list(range(7, 47))])
    return step(states, [worker.info.special_tokens["decoder_start"]])


cpu_qa = onnx_worker_factory("qa", qa_dir, "cpu", Settings(threads=1))
assert isinstance(cpu_qa, OnnxWorker) and not isinstance(cpu_qa, CudaWorker)
want = cpu_qa.run(batch)
cpu_sum = OnnxWorker("sum", sum_dir, "cpu", threads=1)
want_logits = summarize_step(cpu_sum, cpu_sum.step)
assert want_logits.shape[0] == 1
settings = resolve_settings(cpu_sum.info.generation, max_new_tokens=3, num_beams=2)
beam = cpu_sum.generate(list(range(7, 47)), settings)
assert len(beam) <= 3

got = IoBindingEncoder(cpu_qa.model, "cpu").run(batch)
for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
got_logits = summarize_step(cpu_sum, DeviceDecoder(cpu_sum.model, "cpu").step)
np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)

# the CUDA worker: ONNX Runtime claims CUDA, sessions run on CPU, I/O binding on the CPU provider
claim_cuda(ort)
for name, directory in (("qa", qa_dir), ("sum", sum_dir)):
    w = onnx_worker_factory(name, directory, "cuda:0", Settings(threads=1))
    assert isinstance(w, CudaWorker)
    on_cpu(w)
    if w.decoder is not None:
        np.testing.assert_allclose(summarize_step(w, w.step), want_logits, rtol=1e-4, atol=1e-4)
    else:
        got = w.run(batch)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
print("HEAVY", sorted(m for m in BLOCKED if m in sys.modules))
"""


def test_every_worker_kind_runs_in_a_serve_only_install(tiny_qa_dir, tiny_summarize_dir):
    out = subprocess.run([sys.executable, "-c", CODE, str(tiny_qa_dir), str(tiny_summarize_dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY []" in out.stdout, out.stdout
