"""ONNX Runtime that claims CUDA and runs on the CPU, for the GPU code paths (CudaWorker, the
I/O-binding encoder and decoder, the decoder state kept on the device) on machines without a GPU.
NumPy and onnxruntime only (tests/service/test_serve_only.py imports it with torch blocked).

    claim_cuda(ort, monkeypatch.setattr)   # get_available_providers lists CUDA; every
                                           # InferenceSession runs on CPU, reports what it was asked
    on_cpu(worker)                         # its OrtValues go to the CPU instead of the GPU
"""

from __future__ import annotations


class ClaimedCudaSession:
    """A CPU session that reports the providers it was asked for (as a CUDA session that loaded would)."""

    def __init__(self, real, path, options=None, providers=None, **kwargs):
        self._session = real(path, options, providers=["CPUExecutionProvider"])
        self.requested = providers
        self._claimed = [p[0] if isinstance(p, tuple) else p for p in providers or ["CPUExecutionProvider"]]

    def get_providers(self) -> list[str]:
        return list(self._claimed)

    def __getattr__(self, name):
        return getattr(self._session, name)


def claim_cuda(ort, set_attr=setattr, record: list | None = None) -> None:
    """Patch `ort` (with `set_attr`: monkeypatch.setattr in tests, plain setattr in scripts)."""
    real = ort.InferenceSession

    def session(path, options=None, providers=None, **kwargs):
        if record is not None:
            record.append((path, providers))
        return ClaimedCudaSession(real, path, options, providers, **kwargs)

    set_attr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    set_attr(ort, "InferenceSession", session)


def on_cpu(worker):
    """Point a CudaWorker's device copies (model, I/O-binding encoder and decoder) at the CPU."""
    worker.model.device = "cpu"
    worker.encoder.device_type = "cpu"
    if worker.decoder is not None:
        decoder = worker.decoder
        decoder.device_type = decoder.encoder.device_type = decoder.regroup.device_type = "cpu"
        if decoder.fixed is not None:  # the CPU provider captures nothing: fixed shapes, replayed as runs
            decoder.fixed.cuda_graph = False
    return worker
