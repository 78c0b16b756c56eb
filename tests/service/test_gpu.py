"""On a real GPU: fp16 exports on ONNX Runtime's CUDA execution provider pass `verify` (the fp16
criteria: max |diff| <= 1e-2 and the same spans, labels and greedy/beam tokens as the PyTorch
reference), and the service's CUDA worker (I/O-binding encoder, KV cache on the GPU) answers as
the CPU worker does. Skipped where ONNX Runtime has no CUDA provider (CI, the development
machines); bench/gpu.py's docstring says how these ran on an H200."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from longdoc.export.runtime import OnnxModel
from longdoc.export.verify import TOLERANCE, _scaled, verify_model
from longdoc.service.workers import CudaWorker, EncoderBatch, OnnxWorker
from longdoc.testing.tiny_models import make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_export

pytestmark = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                reason="needs onnxruntime-gpu and a GPU")


# "bert2bert": the BigBird-RoBERTa encoder-decoder (transformers' EncoderDecoderModel, the default
# summarizer's architecture), exported as a summarize model like BigBird-Pegasus ("summarize")
MODELS = {"qa": "qa", "classify": "classify", "summarize": "summarize", "bert2bert": "summarize"}


@pytest.fixture(scope="module")
def fp16(tmp_path_factory):
    """model -> (fp16 export, its checkpoint, the fp32 export of the same checkpoint)."""
    out = {}
    for name, task in MODELS.items():
        root = tmp_path_factory.mktemp(f"gpu-{name}")
        ckpt = (make_tiny_encoder_decoder(root / "checkpoint") if name == "bert2bert"
                else make_tiny_checkpoint(root / "checkpoint", task))
        out[name] = (make_tiny_export(root / "fp16", task, "fp16", ckpt), ckpt,
                     make_tiny_export(root / "fp32", task, "fp32", ckpt))
    return out


@pytest.mark.parametrize("task", list(MODELS))
def test_fp16_export_passes_verify_on_cuda(fp16, task):
    model_dir, ckpt, _ = fp16[task]
    report = verify_model(model_dir, ckpt, device="cuda", progress=lambda _m: None)
    assert report.ok, report.summary()
    assert OnnxModel(model_dir, device="cuda").sessions["encoder"].get_providers()[0] == "CUDAExecutionProvider"


def test_cuda_worker_encoder_matches_the_cpu_worker(fp16):
    gpu_dir, _, cpu_dir = fp16["qa"]
    gpu, cpu = CudaWorker("qa", gpu_dir, "cuda"), OnnxWorker("qa", cpu_dir, "cpu", threads=1)
    rng = np.random.default_rng(0)
    for S in (40, 200, 512):  # full attention, block-sparse, the maximum
        ids = rng.integers(10, 400, (3, S))
        mask = np.ones_like(ids)
        mask[1, S // 2 :] = 0  # a padded row
        batch = EncoderBatch(ids, mask, np.zeros_like(ids))
        got, want = gpu.run(batch), cpu.run(batch)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=_scaled(TOLERANCE["fp16"], want[name], "fp16"), rtol=0)


@pytest.mark.parametrize("steps", ["dynamic", "captured"])
@pytest.mark.parametrize("model", ["summarize", "bert2bert"])
def test_cuda_worker_decoder_steps_match_the_cpu_worker(fp16, model, steps):
    """Greedy steps with the decode state on the GPU, a sequence joining mid-way (the batch
    assembled on the GPU), against the CPU worker's; dynamic steps, and fixed-shape steps
    replayed as CUDA graphs (capture accepted: the worker still captures at the end)."""
    gpu_dir, _, cpu_dir = fp16[model]
    gpu = CudaWorker("sum", gpu_dir, "cuda", decoder_steps=steps)
    cpu = OnnxWorker("sum", cpu_dir, "cpu", threads=1)
    start = gpu.info.special_tokens["decoder_start"]
    docs = [list(range(7, 307)), list(range(20, 120))]
    g_states, c_states = gpu.begin(docs[:1]), cpu.begin(docs[:1])
    tokens = [start]
    for step in range(8):
        if step == 3:  # a second sequence joins
            g_states += gpu.begin(docs[1:])
            c_states += cpu.begin(docs[1:])
            tokens.append(start)
        if step == 6:  # the first leaves
            g_states, c_states, tokens = g_states[1:], c_states[1:], tokens[1:]
        got, want = gpu.step(g_states, tokens), cpu.step(c_states, tokens)
        # verify's fp16 criterion: 1e-2 x max(1, max |reference|) (fp16 is computed as fp16 on a GPU)
        np.testing.assert_allclose(got, want, atol=_scaled(TOLERANCE["fp16"], want, "fp16"), rtol=0)
        tokens = [int(t) for t in want.argmax(axis=-1)]
    kinds = {"encoder_inputs", "masks", "step_inputs"} | ({"past"} if steps == "dynamic" else set())
    assert set(gpu.decoder.copied) == kinds  # no cross state
    assert gpu.decoder.regroups == 3 and gpu.decoder.regroup.moved > 0
    if steps == "captured":
        assert gpu.decoder.fixed.cuda_graph, "ONNX Runtime refused the capture (see the log)"


def test_captured_greedy_steps_choose_the_logits_argmax_on_cuda(fp16):
    """Greedy on the device (issue 36, item 2): a captured step's token ids are the first
    maximum of that step's own logits, left on the GPU, with a banned token removed."""
    from longdoc.model.search import StepConstraints

    gpu = CudaWorker("sum", fp16["summarize"][0], "cuda", decoder_steps="captured")
    dec = gpu.decoder
    states = gpu.begin([list(range(7, 307)), list(range(20, 120))])
    tokens = [gpu.info.special_tokens["decoder_start"]] * 2
    for step in range(20):  # past 16 positions: the cache grows once
        banned = [StepConstraints(), StepConstraints(banned=(tokens[1],))]
        chosen = gpu.step_greedy(states, tokens, banned)
        logits = dec.fixed.buffers("logits", [dec.capacity, 1, dec.vocab], np.float32)[0].numpy()[:, 0]
        logits[1, tokens[1]] = -np.inf
        assert chosen == [int(logits[0].argmax()), int(logits[1].argmax())], step
        tokens = chosen
    assert dec.fixed.cuda_graph and dec.fetched["logits"] == 0


def test_full_attention_query_chunks_run_on_cuda(tmp_path, monkeypatch):
    """ModernBERT's full layers run their queries in chunks sized in the graph, most of them empty
    at short lengths (export/sparse_attention.py `query_chunk_sizes`): the CUDA provider takes the
    zero-row Split outputs, MatMuls and Softmaxes, and answers as the CPU does (fp16 criterion) at
    every position a user can get an answer from: the real tokens (export/windows.py `best_spans`
    reads document tokens only; `verify` compares real positions only).

    Padding positions need not agree, and did not on an H200 (6 of 200 start logits, by up to 0.054,
    all past the mask): a padding query whose band holds only padding keys has every score at
    s + NEG_INF (-10000). fp16 rounds that sum in steps of 8, so its softmax is uniform over those
    keys, while fp32 keeps the score differences (steps of 0.001): the row's output differs by
    construction, and nothing reads it."""
    from longdoc.export import sparse_attention
    from longdoc.export.exporter import export_model
    from longdoc.testing.tiny_models import make_tiny_modernbert

    monkeypatch.setattr(sparse_attention, "QUERY_CHUNKS", 4)
    monkeypatch.setattr(sparse_attention, "QUERY_CHUNK_ROWS", 16)
    ckpt = make_tiny_modernbert(tmp_path / "checkpoint", "qa")
    for dtype in ("fp16", "fp32"):
        export_model(ckpt, tmp_path / dtype, "qa", dtype=dtype, progress=lambda _m: None)
    gpu, cpu = OnnxModel(tmp_path / "fp16", device="cuda"), OnnxModel(tmp_path / "fp32", threads=1)
    rng = np.random.default_rng(0)
    for S in (1, 20, 100, 512):  # empty chunks, uneven ones, the maximum
        ids = rng.integers(10, 400, (2, S))
        mask = np.ones_like(ids)
        mask[1, max(1, S // 2):] = 0
        got, want = gpu.run_encoder(ids, mask), cpu.run_encoder(ids, mask)
        real = mask.astype(bool)  # (2, S): the positions an answer can come from
        for name in want:
            assert want[name].shape == mask.shape, name  # start/end logits, one per token
            g, w = got[name][real], want[name][real]
            np.testing.assert_allclose(g, w, atol=_scaled(TOLERANCE["fp16"], w, "fp16"), rtol=0,
                                       err_msg=f"{name} at {S} tokens, real positions")
