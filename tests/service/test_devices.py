"""Per-device defaults and GPU selection, without a GPU: the batch-token budget a worker gets for
its device, and what `cuda:N` hands to ONNX Runtime (InferenceSession is monkeypatched to record
its providers and then build the session on the CPU provider)."""

import numpy as np
import onnxruntime as ort
import pytest

from longdoc.export.runtime import OnnxModel, execution_providers
from longdoc.service.settings import CPU_MAX_BATCH_TOKENS, GPU_MAX_BATCH_TOKENS, Settings
from longdoc.export.runtime import parse_device
from tests.fake_cuda import claim_cuda
from longdoc.service.workers import CudaWorker, OnnxWorker, onnx_worker_factory


def test_batch_token_budget_defaults_per_device():
    s = Settings()
    assert s.max_batch_tokens is None
    assert s.batch_tokens_for("cpu") == CPU_MAX_BATCH_TOKENS
    assert s.batch_tokens_for("cuda") == s.batch_tokens_for("cuda:3") == GPU_MAX_BATCH_TOKENS
    assert CPU_MAX_BATCH_TOKENS < GPU_MAX_BATCH_TOKENS
    explicit = Settings(max_batch_tokens=5000)
    assert [explicit.batch_tokens_for(d) for d in ("cpu", "cuda", "cuda:1")] == [5000] * 3


def test_batch_token_budget_from_environment(monkeypatch):
    monkeypatch.setenv("LONGDOC_MAX_BATCH_TOKENS", "2048")
    assert Settings().batch_tokens_for("cpu") == Settings().batch_tokens_for("cuda") == 2048


def test_cpu_worker_gets_the_cpu_budget_and_still_batches_short_sequences(tiny_qa_dir):
    """The factory resolves the budget for the worker's device, with no floor at the model's
    maximum length: a sequence over the budget runs alone, shorter ones still share a batch."""
    from longdoc.service.batching import BatchingPolicy, Entry

    worker = onnx_worker_factory("qa", tiny_qa_dir, "cpu", Settings(threads=1))
    assert isinstance(worker, OnnxWorker) and worker.max_batch_tokens == CPU_MAX_BATCH_TOKENS
    policy = BatchingPolicy(max_batch_tokens=GPU_MAX_BATCH_TOKENS, max_batch_size=32, max_wait_s=0.0,
                            bucket_size=64)
    for length in (CPU_MAX_BATCH_TOKENS + 1, CPU_MAX_BATCH_TOKENS + 1):
        policy.append(Entry(length, 0.0))
    for _ in range(8):
        policy.append(Entry(200, 0.0))  # bucket 256
    sizes = []
    while (b := policy.next_batch(1.0, budget=worker.max_batch_tokens)) is not None:
        sizes.append((b.bucket_length, len(b.entries)))
    long_bucket = policy.bucket_of(CPU_MAX_BATCH_TOKENS + 1)
    per_batch = CPU_MAX_BATCH_TOKENS // 256
    assert per_batch >= 2  # short sequences are still batched on CPU
    short = [(256, min(per_batch, 8 - k)) for k in range(0, 8, per_batch)]
    assert sizes == [(long_bucket, 1), (long_bucket, 1)] + short


def test_parse_device():
    assert parse_device("cpu") == ("cpu", 0)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:0") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:1"):
        with pytest.raises(ValueError):
            parse_device(bad)


def test_execution_providers():
    assert execution_providers("cpu") == ["CPUExecutionProvider"]
    assert execution_providers("cuda") == [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    assert execution_providers("cuda", 2) == [("CUDAExecutionProvider", {"device_id": 2}), "CPUExecutionProvider"]
    for device, device_id in (("cpu", 1), ("cuda", -1), ("cuda", "1"), ("cuda", True), ("tpu", 0)):
        with pytest.raises(ValueError):
            execution_providers(device, device_id)


@pytest.fixture
def recorded_sessions(monkeypatch):
    """InferenceSession records its providers, then runs on CPU; CUDA claims to be available."""
    calls = []
    claim_cuda(ort, monkeypatch.setattr, record=calls)
    return calls


def test_onnx_model_passes_the_device_id(recorded_sessions, tiny_summarize_dir):
    m = OnnxModel(tiny_summarize_dir, device="cuda", threads=1, device_id=1)
    assert (m.device, m.device_id) == ("cuda", 1)
    assert len(recorded_sessions) == 2  # encoder and decoder, both on GPU 1
    for _, providers in recorded_sessions:
        assert providers == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]


def test_cuda_worker_for_cuda_n(recorded_sessions, tiny_qa_dir):
    w = CudaWorker("qa", tiny_qa_dir, "cuda:2", threads=1)
    assert w.device == "cuda:2" and w.model.device_id == 2
    assert (w.encoder.device_type, w.encoder.device_id) == ("cuda", 2)
    assert recorded_sessions[-1][1] == [("CUDAExecutionProvider", {"device_id": 2}), "CPUExecutionProvider"]
    w = onnx_worker_factory("qa", tiny_qa_dir, "cuda", Settings(threads=1))
    assert isinstance(w, CudaWorker) and w.model.device_id == 0 and w.max_batch_tokens == GPU_MAX_BATCH_TOKENS
    assert recorded_sessions[-1][1][0] == ("CUDAExecutionProvider", {"device_id": 0})
    with pytest.raises(ValueError, match="cuda"):
        CudaWorker("qa", tiny_qa_dir, "cpu")


def test_cuda_worker_decodes_through_io_binding_on_its_gpu(recorded_sessions, tiny_summarize_dir):
    w = CudaWorker("sum", tiny_summarize_dir, "cuda:1", threads=1)
    assert (w.decoder.device_type, w.decoder.device_id) == ("cuda", 1)
    assert all(p == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
               for _, p in recorded_sessions)


def test_a_cuda_provider_that_does_not_load_is_an_error(monkeypatch, tiny_qa_dir):
    """ONNX Runtime lists CUDA, but the session falls back to the CPU (its CUDA libraries did not
    load, which ONNX Runtime only logs): a GPU worker must not serve at CPU speed without a word."""
    real = ort.InferenceSession
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", lambda path, options=None, providers=None, **kw: real(
        path, options, providers=["CPUExecutionProvider"]))
    with pytest.raises(RuntimeError, match="CUDA execution provider did not load"):
        OnnxModel(tiny_qa_dir, device="cuda", threads=1)
    with pytest.raises(RuntimeError, match="CUDA execution provider did not load"):
        CudaWorker("qa", tiny_qa_dir, "cuda", threads=1)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_the_search_uploads_the_encoder_state_once(recorded_sessions, monkeypatch, tiny_summarize_dir, num_beams):
    """On a GPU the cross-attention keys/values are most of a decoder step's input (268 MB per row
    for BigBird-Pegasus-large at 4096 tokens): OnnxModel.generate, the one search (also the service's
    beam path), uploads them once per request, not at every step, and still decodes the same tokens."""
    want = OnnxModel(tiny_summarize_dir, threads=1).generate(np.arange(7, 47)[None], max_new_tokens=6, num_beams=num_beams)
    model = OnnxModel(tiny_summarize_dir, device="cuda", threads=1)
    model.device = "cpu"  # the device copies go to the CPU: no GPU here
    uploads = []
    real = ort.OrtValue.ortvalue_from_numpy
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", lambda a, *args: uploads.append(a.shape) or real(a, *args))
    got = model.generate(np.arange(7, 47)[None], max_new_tokens=6, num_beams=num_beams)
    assert got == want and len(got[0]) > 3
    L = model.manifest.decoder["num_layers"]
    assert len(uploads) == 2 * L + 1  # cross key and value per layer, the encoder mask: once


def test_overlap_encoding_is_the_devices_default_unless_set(recorded_sessions, tiny_summarize_dir):
    """Issue 24: whether a summarizer encodes newcomers beside the decode steps can be switched
    (`--overlap-encoding` / `--no-overlap-encoding`), so that its cost to a lone request can be
    measured; unset, a CUDA worker overlaps and a CPU worker does not."""
    from longdoc.service.cli import add_commands

    assert onnx_worker_factory("s", tiny_summarize_dir, "cuda", Settings(threads=1)).overlaps_encoding is True
    assert onnx_worker_factory("s", tiny_summarize_dir, "cpu", Settings(threads=1)).overlaps_encoding is False
    off = onnx_worker_factory("s", tiny_summarize_dir, "cuda", Settings(threads=1, overlap_encoding=False))
    on = onnx_worker_factory("s", tiny_summarize_dir, "cpu", Settings(threads=1, overlap_encoding=True))
    assert off.overlaps_encoding is False and on.overlaps_encoding is True
    import argparse

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--no-overlap-encoding"])
    assert args.overlap_encoding is False


def test_the_worker_protocol_names_what_the_batcher_reads():
    """`overlaps_encoding` is part of the Worker protocol (the decode scheduler reads it on every
    worker), and CudaWorker's docstring is its docstring (it followed a class attribute)."""
    from longdoc.service.workers import CudaWorker, OnnxWorker, Worker
    from longdoc.testing.fake_worker import FakeWorker

    assert "overlaps_encoding" in Worker.__annotations__
    assert [cls.overlaps_encoding for cls in (OnnxWorker, CudaWorker, FakeWorker)] == [False, True, False]
    assert CudaWorker.__doc__.startswith("One GPU")
