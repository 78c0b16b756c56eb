"""The GPU path, measured (issues 16, 24, 36). A script, not a test: it needs a CUDA GPU with
onnxruntime-gpu, torch and transformers (the dev machines have none; `--tiny --device cpu` runs
every phase on small shapes to check the script itself). bench/gpu_lease.sh runs it in a lease.

Random-init weights (transformers, seed 0) at transformers' default configurations:

    make      BigBirdConfig() QA checkpoint -> `export --dtype fp16`, once per --gathers variant
              (`--sparse-gather`: fp16-qa is the default "gather", fp16-qa-VARIANT the others);
              BigBirdPegasusConfig() (bigbird-pegasus-large shape) -> fp16 export
    verify    `longdoc verify --device cuda --against transformers` of each --gathers export at 4096 tokens
    ours      the service's encoder path (CudaWorker's IoBindingEncoder, layout tables kept on the
              GPU) at 4096 tokens, batch 1/8/32: latency, docs/s, model FLOP utilization
    variants  each --gathers export at the largest batch, as `ours`: latency, TFLOP/s, max |diff|
              against the default export's outputs (the same inputs)
    peak      the GPU's measured fp16 MatMul peak (torch, 8192^3): the encoder's share of it
    kernels   where the encoder's GPU time goes at the largest batch (CUPTI through torch.profiler),
              for each --kernel-gathers export
    gathers   one head group's key-block gather at the largest batch: ONNX Gather as exported,
              against the same as a product with a one-hot table (exact): for the lowering
    hf        transformers BigBirdForQuestionAnswering fp16 on the same GPU (block-sparse, eval), same
              shapes; and the measured peak
    service   a real `longdoc serve --device cuda` on the fp16 QA export, 32 closed-loop clients sending
              4096-token documents: throughput and p50/p99 (against the offline batched rate: `ours`);
              then answers alone against answers under load (`consistency`)
    steps     the service's greedy decode step of the Pegasus-large export at 4096 encoder tokens,
              batch 1 and 8, ms per token: the decode paths as served, and switched off (the baseline)
    pegasus   time per generated token, greedy and beam 5: the one search (OnnxModel.generate), the
              service's greedy step, and transformers fp16 generate() on the same GPU
    summarize a real `longdoc serve --device cuda` on the Pegasus-large export, 32-token greedy
              summaries of 4096-token documents: one client alone, 8 and 32 clients, and answers alone
              against answers under load; the decode paths as served, and switched off (the baseline)
    encoder_opts  ONNX Runtime's optimization levels and CUDA graphs on the encoder (issue 24)

"Switched off": `decode_switch` names the one setting that turns the decode paths of issue 36
(fixed-shape steps replayed as CUDA graphs, greedy on the device) off, so that the baseline is the
same code in the same run. Each phase runs in its own process (one CUDA context each). Progress
goes to stderr, the tables to stdout, every number to --out/NAME.json.

    python3 bench/gpu.py --work /tmp/gpu --out /tmp/gpu-out                    # on the GPU machine
    .venv/bin/python bench/gpu.py --tiny --device cpu --work /tmp/gpu-tiny --out /tmp/gpu-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import log, time_it

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("make", "verify", "ours", "variants", "peak", "encoder_opts", "kernels", "gathers", "hf", "service", "steps",
          "pegasus", "summarize")
CONSISTENCY_DOCS = 16  # documents sent alone, then under load (issue 40, item 5)
H200_FP16_DENSE_TFLOPS = 989.0  # vendor datasheet, dense fp16/bf16 tensor cores (SXM)



def child(phase: str, **kwargs) -> dict:
    """One phase in a fresh process; its JSON result."""
    cmd = [sys.executable, __file__, "--phase", phase, "--args", json.dumps(kwargs)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        return {"error": f"phase {phase} failed (exit {out.returncode}); see its output above"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def configs(tiny: bool) -> dict:
    if not tiny:
        return {"qa": {}, "summarize": {}, "length": 4096, "batches": [1, 8, 32], "new_tokens": 32}
    from longdoc.testing.tiny_models import tiny_config

    return {"qa": tiny_config("qa"), "summarize": tiny_config("summarize"), "length": 512, "batches": [1, 2],
            "new_tokens": 8}


def qa_batch(B: int, S: int, seed: int = 0):
    """B rows of [CLS] question [SEP] document [SEP] of exactly S tokens (ids of the tiny tokenizer)."""
    import numpy as np

    from longdoc.testing.tiny_models import CLS, SEP

    rng = np.random.default_rng(seed)
    ids = rng.integers(10, 400, (B, S)).astype(np.int64)
    ids[:, 0], ids[:, 9], ids[:, -1] = CLS, SEP, SEP
    types = np.zeros_like(ids)
    types[:, 10:] = 1
    return ids, np.ones_like(ids), types


# --- phases (child processes) ------------------------------------------------------------------

def qa_dir(work: str, gather: str = "gather") -> Path:
    """The fp16 QA export of one `--sparse-gather` variant (the default's keeps its old name)."""
    return Path(work) / ("fp16-qa" if gather == "gather" else f"fp16-qa-{gather}")


def phase_make(work: str, task: str, tiny: bool, gathers: list[str] = ("gather",)) -> dict:
    import torch
    import transformers

    from longdoc.export.exporter import export_model
    from longdoc.testing.tiny_models import tiny_tokenizer

    ckpt = Path(work) / f"ckpt-{task}"
    torch.manual_seed(0)
    config = configs(tiny)[task]
    if task == "summarize":
        model = transformers.BigBirdPegasusForConditionalGeneration(transformers.BigBirdPegasusConfig(**config))
    else:
        model = transformers.BigBirdForQuestionAnswering(transformers.BigBirdConfig(**config))
    model.eval().save_pretrained(ckpt, safe_serialization=True)
    tiny_tokenizer().save(str(ckpt / "tokenizer.json"))  # ids < vocab: enough for random weights
    result = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "export_s": {}}
    for gather in (gathers if task == "qa" else ["gather"]):
        start = time.perf_counter()
        out = qa_dir(work, gather) if task == "qa" else Path(work) / f"fp16-{task}"
        export_model(ckpt, out, task, dtype="fp16", progress=lambda m: log(f"  export: {m}"), overwrite=True,
                     sparse_gather=gather)
        result["export_s"][gather] = time.perf_counter() - start
    return result


def phase_verify(work: str, device: str, tiny: bool, gathers: list[str] = ("gather",)) -> dict:
    """`verify --device DEVICE --against transformers` of each variant's export at the full length."""
    from longdoc.export.verify import verify_model

    S, result = configs(tiny)["length"], {}
    for gather in gathers:
        report = verify_model(qa_dir(work, gather), Path(work) / "ckpt-qa", against="transformers", lengths=[S],
                              device=device, progress=lambda m: log(f"  verify {gather}: {m}"))
        diffs = [c.max_abs_diff for c in report.checks if c.max_abs_diff is not None]
        result[gather] = {"ok": report.ok, "checks": len(report.checks), "passed": sum(c.ok for c in report.checks),
                          "max_abs_diff": max(diffs) if diffs else None}
    return result


def phase_ours(work: str, device: str, tiny: bool) -> dict:
    from bench_export import model_flops
    from longdoc.export.runtime import OnnxModel, parse_device
    from longdoc.service.workers import EncoderBatch, IoBindingEncoder

    c = configs(tiny)
    kind, device_id = parse_device(device)
    model = OnnxModel(Path(work) / "fp16-qa", device=kind, device_id=device_id)
    encoder = IoBindingEncoder(model, kind, device_id)
    S, result = c["length"], {}
    for B in c["batches"]:
        batch = EncoderBatch(*qa_batch(B, S))
        seconds = time_it(lambda: encoder.run(batch), reps=20 if B == 1 else 8)
        result[B] = {"latency_ms": seconds * 1000, "docs_per_s": B / seconds,
                     "tflops": model_flops(S, full=False) * B / seconds / 1e12}
        log(f"  ours fp16 batch {B}: {seconds * 1000:.1f} ms, {B / seconds:.1f} docs/s, "
            f"{result[B]['tflops']:.1f} TFLOP/s")
    return result


def phase_variants(work: str, device: str, tiny: bool, gathers: list[str] = ("gather",)) -> dict:
    """Each `--sparse-gather` export at the largest batch through the service's encoder path, the
    default ("gather") first: latency, TFLOP/s, and max |diff| of its outputs against the default's."""
    import numpy as np

    from bench_export import model_flops
    from longdoc.export.runtime import OnnxModel, parse_device
    from longdoc.service.workers import EncoderBatch, IoBindingEncoder

    c = configs(tiny)
    kind, device_id = parse_device(device)
    S, B = c["length"], max(c["batches"])
    batch = EncoderBatch(*qa_batch(B, S))
    result, reference = {}, None
    for gather in ["gather"] + [v for v in gathers if v != "gather"]:
        model = OnnxModel(qa_dir(work, gather), device=kind, device_id=device_id)
        encoder = IoBindingEncoder(model, kind, device_id)
        got = encoder.run(batch)
        seconds = time_it(lambda: encoder.run(batch), reps=8)
        reference = got if reference is None else reference
        diff = max(float(np.abs(np.asarray(got[n], np.float32) - np.asarray(reference[n], np.float32)).max())
                   for n in reference)
        result[gather] = {"latency_ms": seconds * 1000, "docs_per_s": B / seconds, "max_abs_diff": diff,
                          "tflops": model_flops(S, full=False) * B / seconds / 1e12}
        log(f"  encoder --sparse-gather {gather}, batch {B}: {seconds * 1000:.1f} ms, "
            f"{result[gather]['tflops']:.1f} TFLOP/s, max |diff| vs gather {diff:.2e}")
        del encoder, model
    return {"batch": B, **result}


def phase_peak(work: str, device: str, tiny: bool) -> dict:
    """The measured ceiling: a large fp16 MatMul (torch; the CPU dry run: a small fp32 one)."""
    import torch

    cuda = device.startswith("cuda")
    n, dtype = (8192, torch.float16) if cuda else (256, torch.float32)
    dev = torch.device(device)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    seconds = time_it(lambda: (a @ b, sync()), reps=20)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    log(f"  {dtype} MatMul {n}^3: {2 * n**3 / seconds / 1e12:.1f} TFLOP/s on {name}")
    return {"matmul_peak_tflops": 2 * n**3 / seconds / 1e12, "n": n, "gpu": name}


def phase_encoder_opts(work: str, device: str, tiny: bool) -> dict:
    """Item 3 of issue 24: the encoder at the largest batch under ONNX Runtime's settings that
    leave the file standard ONNX: graph optimization levels, and CUDA graphs (one captured graph
    per input shape: inputs and outputs bound at fixed device addresses). Each variant's outputs
    are compared with the default session's (max |diff|), and timed (median of 8)."""
    import numpy as np
    import onnxruntime as ort

    from bench_export import model_flops
    from longdoc.export.runtime import OnnxModel, execution_providers, parse_device

    c = configs(tiny)
    kind, device_id = parse_device(device)
    S, B = c["length"], max(c["batches"])
    model_dir = Path(work) / "fp16-qa"
    model = OnnxModel(model_dir, device=kind, device_id=device_id)
    feed, _ = model.encoder_feed(*qa_batch(B, S))
    names = [o.name for o in model.sessions["encoder"].get_outputs()]
    path = str(model.manifest.path_of(model_dir, model.manifest.graphs["encoder"]))
    result, reference = {}, None
    variants = [("default", {}, {}), ("basic", {"level": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}, {}),
                ("extended", {"level": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED}, {}),
                ("all", {"level": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}, {})]
    if kind == "cuda":
        variants.append(("cuda-graph", {}, {"enable_cuda_graph": "1"}))
    for name, opts, provider_options in variants:
        try:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.enable_mem_pattern = False
            if "level" in opts:
                options.graph_optimization_level = opts["level"]
            providers = execution_providers(kind, device_id)
            if provider_options:
                providers = [(providers[0][0], {**providers[0][1], **provider_options})] + providers[1:]
            session = ort.InferenceSession(path, options, providers=providers)
            inputs = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), kind, device_id)
                      for k, v in feed.items()}
            binding = session.io_binding()
            for k, v in inputs.items():
                binding.bind_ortvalue_input(k, v)
            if provider_options:  # a captured graph replays into the same output buffers
                probe = model.sessions["encoder"].run(names, feed)
                outs = [ort.OrtValue.ortvalue_from_shape_and_type(list(p.shape), p.dtype.type, kind, device_id)
                        for p in probe]
                for n, o in zip(names, outs):
                    binding.bind_ortvalue_output(n, o)
            else:
                for n in names:
                    binding.bind_output(n, kind, device_id)

            def run():
                session.run_with_iobinding(binding)
                return [o.numpy() for o in binding.get_outputs()]

            got = run()
            seconds = time_it(run, reps=8)
            if reference is None:
                reference = got
            diff = max(float(np.abs(g.astype(np.float32) - r.astype(np.float32)).max()) for g, r in zip(got, reference))
            result[name] = {"latency_ms": seconds * 1000, "docs_per_s": B / seconds, "max_abs_diff": diff,
                            "tflops": model_flops(S, full=False) * B / seconds / 1e12}
            log(f"  encoder {name}, batch {B}: {seconds * 1000:.1f} ms, {result[name]['tflops']:.1f} TFLOP/s, "
                f"max|diff| vs default {diff:.2e}")
        except Exception as exc:  # noqa: BLE001 - a variant ONNX Runtime refuses is a result too
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log(f"  encoder {name}: {result[name]['error']}")
    return result


def phase_kernels(work: str, device: str, tiny: bool, gathers: list[str] = ("gather",)) -> dict:
    """phase_kernels_of for each `--sparse-gather` export in `gathers`."""
    return {gather: kernels_of(qa_dir(work, gather), device, tiny) for gather in gathers}


def kernels_of(model_dir: Path, device: str, tiny: bool) -> dict:
    """Where the encoder's GPU time goes at the largest batch: every CUDA kernel of two runs of the
    service's encoder path, timed by CUPTI through torch.profiler (it sees the whole process's
    kernels, ONNX Runtime's included), summed by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from longdoc.export.runtime import OnnxModel, parse_device
    from longdoc.service.workers import EncoderBatch, IoBindingEncoder

    c = configs(tiny)
    kind, device_id = parse_device(device)
    S, B = c["length"], max(c["batches"])
    model = OnnxModel(model_dir, device=kind, device_id=device_id)
    encoder = IoBindingEncoder(model, kind, device_id)
    batch = EncoderBatch(*qa_batch(B, S))
    encoder.run(batch), encoder.run(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            encoder.run(batch)
        if kind == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) if kind == "cuda" else e.self_cpu_time_total
        if t > 0 and (kind != "cuda" or e.device_type.name == "CUDA"):
            rows.append({"kernel": e.key[:120], "ms": t / 1000 / 2, "calls": e.count // 2})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    log(f"  kernels of {model_dir.name}: {total:.1f} ms per run")
    for r in rows[:25]:
        log(f"  {r['ms']:8.2f} ms {100 * r['ms'] / max(total, 1e-9):5.1f}%  x{r['calls']:<5} {r['kernel']}")
    return {"total_ms": total, "top": rows[:40]}


def phase_gathers(work: str, device: str, tiny: bool) -> dict:
    """The sparse attention's key-block gather of one head group at the largest batch, as the
    export lowers it (Gather of (B, h*nb, bs, Dk) by (h, nb, K) block ids: ONNX Runtime's generic
    Gather kernel took 30% of the encoder's GPU time, docs/gpu.md) against the same gather as a
    product with a one-hot table ((h, nb*K, nb) x (B, h, nb, bs*Dk): a GEMM; exact, since every
    output is one product by 1 plus products by 0). Which of the two a GPU lowering should use
    (issue 24, item 3)."""
    import numpy as np
    from onnx import TensorProto, helper

    import onnxruntime as ort
    from longdoc.export.runtime import execution_providers, parse_device

    c = configs(tiny)
    kind, device_id = parse_device(device)
    B, h, bs, Dk, K = max(c["batches"]), (2 if tiny else 4), (16 if tiny else 64), 65, 8
    nb = c["length"] // bs
    dtype, onnx_type = (np.float32, TensorProto.FLOAT) if kind == "cpu" else (np.float16, TensorProto.FLOAT16)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, h * nb, bs, Dk)).astype(dtype)
    blocks = rng.integers(0, nb, (h, nb, K))
    ids = (blocks + (np.arange(h) * nb)[:, None, None]).astype(np.int64)  # (h, nb, K) into h*nb
    onehot = np.zeros((h, nb * K, nb), dtype)
    onehot[np.arange(h)[:, None], np.arange(nb * K)[None, :], blocks.reshape(h, -1)] = 1

    def session(nodes, inputs):
        graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", onnx_type, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return ort.InferenceSession(model.SerializeToString(), providers=execution_providers(kind, device_id))

    x_info = helper.make_tensor_value_info("x", onnx_type, ["B", "N", bs, Dk])
    gather = session([helper.make_node("Gather", ["x", "ids"], ["y"], axis=1)],
                     [x_info, helper.make_tensor_value_info("ids", TensorProto.INT64, [h, nb, K])])
    product = session([helper.make_node("Reshape", ["x", "shape"], ["xr"]),
                       helper.make_node("MatMul", ["onehot", "xr"], ["y"])],
                      [x_info, helper.make_tensor_value_info("onehot", onnx_type, [h, nb * K, nb]),
                       helper.make_tensor_value_info("shape", TensorProto.INT64, [4])])
    on_device = lambda a: ort.OrtValue.ortvalue_from_numpy(a, kind, device_id)  # noqa: E731
    feeds = {"gather": (gather, {"x": on_device(x), "ids": on_device(ids)}),
             "onehot": (product, {"x": on_device(x), "onehot": on_device(onehot),
                                  "shape": on_device(np.array([B, h, nb, bs * Dk], np.int64))})}
    out, times = {}, {}
    for name, (sess, feed) in feeds.items():
        def run(sess=sess, feed=feed):
            binding = sess.io_binding()
            for k, v in feed.items():
                binding.bind_ortvalue_input(k, v)
            binding.bind_output("y", kind, device_id)
            sess.run_with_iobinding(binding)
            return binding.get_outputs()[0]
        times[name] = time_it(run, reps=10) * 1000
        out[name] = run().numpy().reshape(B, h, nb, K, bs, Dk)
    diff = float(np.abs(out["gather"].astype(np.float32) - out["onehot"].astype(np.float32)).max())
    log(f"  gather {times['gather']:.2f} ms, one-hot product {times['onehot']:.2f} ms, max |diff| {diff}")
    return {"B": B, "heads": h, "blocks": nb, "K": K, "block": bs, "Dk": Dk, "gather_ms": times["gather"],
            "onehot_ms": times["onehot"], "max_abs_diff": diff,
            "gathered_mb": B * h * nb * K * bs * Dk * np.dtype(dtype).itemsize / 2**20}


def phase_hf(work: str, device: str, tiny: bool) -> dict:
    import torch
    import transformers

    from bench_export import model_flops

    c = configs(tiny)
    cuda = device.startswith("cuda")
    dev = torch.device(device)
    dtype = torch.float16 if cuda else torch.float32  # the CPU smoke run: fp16 BigBird is not a CPU path
    model = transformers.BigBirdForQuestionAnswering.from_pretrained(str(Path(work) / "ckpt-qa"), dtype=dtype)
    model = model.to(dev).eval()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    S, result = c["length"], {}
    for B in c["batches"]:
        ids, mask, types = (torch.from_numpy(a).to(dev) for a in qa_batch(B, S))

        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, token_type_ids=types)
            sync()

        seconds = time_it(run, reps=20 if B == 1 else 8)
        result[B] = {"latency_ms": seconds * 1000, "docs_per_s": B / seconds,
                     "tflops": model_flops(S, full=False) * B / seconds / 1e12}
        log(f"  transformers {dtype} batch {B}: {seconds * 1000:.1f} ms, {B / seconds:.1f} docs/s")
    if cuda:  # the measured ceiling: a large fp16 MatMul
        n = 8192
        a, b = (torch.randn(n, n, device=dev, dtype=torch.float16) for _ in range(2))
        seconds = time_it(lambda: (a @ b, sync()), reps=20)
        result["matmul_peak_tflops"] = 2 * n**3 / seconds / 1e12
        result["gpu"] = torch.cuda.get_device_name(dev)
        log(f"  fp16 MatMul {n}^3: {result['matmul_peak_tflops']:.0f} TFLOP/s on {result['gpu']}")
    return result


def phase_service(work: str, device: str, tiny: bool, clients: int, requests: int, consistency_docs: int) -> dict:
    import load
    import tokenizers

    c = configs(tiny)
    model_dir = str(qa_dir(work))
    tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    docs = [load.make_document(tok, c["length"] - 16, seed) for seed in range(8)]
    budget = c["length"] * max(c["batches"])
    proc, url = load.start_server(model_dir, batching=True, threads=None,
                                  extra=["--device", device, "--max-batch-tokens", str(budget)])
    try:
        asyncio.run(load.sweep_point(url, "qa", docs, clients, clients * 2, 600))  # warm-up: every batch size
        point = asyncio.run(load.sweep_point(url, "qa", docs, clients, requests, 600))
        same = guarded(lambda: asyncio.run(consistency(url, "qa", tok, c["length"] - 16, consistency_docs, clients)))
    finally:
        proc.terminate()
        proc.wait(60)
    log(f"  service, {clients} clients: {point['throughput_rps']:.1f} docs/s, p50 {point['p50_ms']:.0f} ms, "
        f"p99 {point['p99_ms']:.0f} ms ({point['ok']}/{point['requests']} ok)")
    return {**point, "consistency": same}


def guarded(measure) -> dict:
    """A measurement that may fail without losing the phase's others: its result, or {"error": ...}."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported in the results file, the phase goes on
        log(f"  failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


async def consistency(url: str, task: str, tok, n_tokens: int, n_docs: int, clients: int) -> dict:
    """Issue 40, item 5: does an answer depend on the load? n_docs documents (n_tokens each) sent
    one at a time, then all at once among fillers (other documents of other lengths, `clients`
    requests in all), so that the batcher groups them with rows of other lengths. Counted: answers
    that changed (a QA answer: its spans, (start, end) of each; a summary: its text), and the largest
    change of a QA score."""
    import httpx
    import load

    docs = [load.make_document(tok, n_tokens, 1000 + i) for i in range(n_docs)]
    fillers = [load.make_document(tok, max(16, n_tokens // (2 + i % 3)), 2000 + i)
               for i in range(max(0, clients - n_docs))]

    def answer(r) -> object:
        if r.status_code != 200:
            return {"status": r.status_code}
        result = r.json()["results"][0]
        return result["summary"] if task == "summarize" else [(a["start"], a["end"], a["score"])
                                                             for a in result["answers"]]

    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=clients + n_docs)) as client:
        async def post(doc: str):
            path, body = load.request_for(task, doc)
            return answer(await client.post(path, json=body))

        alone = [await post(d) for d in docs]
        loaded = (await asyncio.gather(*(post(d) for d in docs), *(post(f) for f in fillers)))[:n_docs]
    if task == "summarize":
        changed = sum(a != b for a, b in zip(alone, loaded))
        return {"documents": n_docs, "requests_under_load": n_docs + len(fillers), "changed": changed}
    spans = lambda a: [x[:2] for x in a] if isinstance(a, list) else a  # noqa: E731
    changed = sum(spans(a) != spans(b) for a, b in zip(alone, loaded))
    scores = [abs(x[2] - y[2]) for a, b in zip(alone, loaded) if isinstance(a, list) and spans(a) == spans(b)
              for x, y in zip(a, b)]
    return {"documents": n_docs, "requests_under_load": n_docs + len(fillers), "changed": changed,
            "scores_changed": sum(a != b for a, b in zip(alone, loaded)) - changed,
            "max_score_change": max(scores, default=0.0)}


def decode_switch() -> dict[str, str]:
    """SWITCH: the environment that turns issue 36's decode paths (fixed-shape steps replayed as
    CUDA graphs, greedy chosen on the device) off, for the baseline of the same run: the setting
    `decoder_steps` (service/settings.py) set to "dynamic", each step at the batch's own lengths as
    before. {} while the setting does not exist (then the baseline is the same as the new path, and
    the results say so: "switch": {})."""
    from longdoc.service.settings import Settings

    return {"LONGDOC_DECODER_STEPS": "dynamic"} if "decoder_steps" in Settings.model_fields else {}


def phase_steps(work: str, device: str, tiny: bool) -> dict:
    """Per-token time of the service's greedy decode step (worker.begin, then worker.step per token,
    as the scheduler drives it), Pegasus-large at the full encoder length, batch 1 and 8:
    (t(1 + N tokens) - t(1 token)) / N, best of 3, so the encoder cancels out. The worker comes from
    the service's own factory and settings: as served, and with `decode_switch` (the baseline)."""
    import os

    import numpy as np

    from longdoc.service.settings import Settings
    from longdoc.service.workers import onnx_worker_factory

    c = configs(tiny)
    S, N = c["length"], c["new_tokens"]
    model_dir = Path(work) / "fp16-summarize"
    rng = np.random.default_rng(0)
    result = {"switch": decode_switch(), "new_tokens": N}
    for variant, env in (("new", {}), ("baseline", decode_switch())):
        os.environ.update(env)
        worker = onnx_worker_factory("bench", model_dir, device, Settings())
        for name in env:
            del os.environ[name]
        start_token = worker.info.special_tokens["decoder_start"]

        def step(states, tokens: list[int]) -> list[int]:
            """The scheduler's greedy step: chosen on the device where the worker can (`step_greedy`,
            no logits processors), else the logits' argmax on the host."""
            if hasattr(worker, "step_greedy"):
                from longdoc.model.search import StepConstraints

                return [int(t) for t in worker.step_greedy(states, tokens, [StepConstraints()] * len(states))]
            return [int(t) for t in np.asarray(worker.step(states, tokens)).argmax(-1)]

        def run(B: int, n: int) -> float:
            docs = [rng.integers(10, 400, S).tolist() for _ in range(B)]
            t = time.perf_counter()
            states, tokens = worker.begin(docs), [start_token] * B
            for _ in range(n):
                tokens = step(states, tokens)
            worker.release()
            return time.perf_counter() - t

        for B in (1, 8):
            run(B, N)  # warm-up: sessions, shapes, captured graphs
            t1, tn = (min(run(B, n) for _ in range(3)) for n in (1, 1 + N))
            result[f"{variant}_batch{B}_ms_per_token"] = (tn - t1) / N * 1000
            log(f"  greedy step ({variant}), batch {B}: {(tn - t1) / N * 1000:.2f} ms per token")
        worker.close()
    return result


def phase_pegasus(work: str, device: str, tiny: bool) -> dict:
    import numpy as np
    import torch
    import transformers

    from longdoc.export.runtime import OnnxModel, parse_device
    from longdoc.service.workers import CudaWorker, OnnxWorker

    c = configs(tiny)
    kind, device_id = parse_device(device)
    S, N = c["length"], c["new_tokens"]
    ids = np.random.default_rng(0).integers(10, 400, (1, S)).astype(np.int64)
    mask = np.ones_like(ids)
    model_dir, ckpt = Path(work) / "fp16-summarize", Path(work) / "ckpt-summarize"
    ours = OnnxModel(model_dir, device=kind, device_id=device_id)
    worker = (CudaWorker if kind == "cuda" else OnnxWorker)("pegasus", model_dir, device)
    start_token = worker.info.special_tokens["decoder_start"]
    cuda = kind == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    theirs = transformers.BigBirdPegasusForConditionalGeneration.from_pretrained(str(ckpt), dtype=dtype)
    theirs = theirs.to(torch.device(device)).eval()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def run(name: str, beams: int, n: int) -> tuple[float, int]:
        start = time.perf_counter()
        if name == "ours":
            made = len(ours.generate(ids, mask, max_new_tokens=n, num_beams=beams, min_length=n + 1,
                                     early_stopping=False)[0])
        elif name == "service-step":  # the batcher's greedy path: begin, then one step per token
            states, tokens = worker.begin([ids[0].tolist()]), [start_token]
            for _ in range(n):
                tokens = [int(worker.step(states, tokens)[0].argmax())]
            worker.release()
            made = n
        else:
            t = {k: torch.from_numpy(v).to(theirs.device) for k, v in (("input_ids", ids), ("attention_mask", mask))}
            with torch.no_grad():
                made = theirs.generate(**t, max_new_tokens=n, min_new_tokens=n, num_beams=beams,
                                       do_sample=False).shape[1]
            sync()
        return time.perf_counter() - start, made

    result = {}
    for name, beams in (("ours", 1), ("service-step", 1), ("transformers", 1), ("ours", 5), ("transformers", 5)):
        run(name, beams, N)  # warm-up: sessions, layouts, allocator
        (t1, m1), (tn, mn) = (min(run(name, beams, n) for _ in range(3)) for n in (1, N))
        per_token = (tn - t1) / max(mn - m1, 1)
        result[f"{name}_beam{beams}_ms_per_token"] = per_token * 1000
        result[f"{name}_beam{beams}_first_ms"] = t1 * 1000
        log(f"  generate {name} beams {beams}: {per_token * 1000:.2f} ms/token, first token {t1 * 1000:.0f} ms "
            f"({mn} vs {m1} tokens)")
    return result


def phase_summarize(work: str, device: str, tiny: bool, consistency_docs: int) -> dict:
    """A real `longdoc serve` on the Pegasus-large export: one client alone (8 summaries), 8 clients
    (64) and 32 clients (128), 32-token greedy summaries, then `consistency`; the decode paths as
    served, and with `decode_switch` (the baseline), one server after the other."""
    import os

    import load
    import tokenizers

    c = configs(tiny)
    model_dir = str(Path(work) / "fp16-summarize")
    tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    docs = [load.make_document(tok, c["length"] - 1, seed) for seed in range(8)]
    result = {"switch": decode_switch()}
    for variant, env in (("new", {}), ("baseline", decode_switch())):
        os.environ.update(env)  # the server inherits it
        try:
            proc, url = load.start_server(model_dir, batching=True, threads=None, extra=["--device", device])
        finally:
            for name in env:
                del os.environ[name]
        try:
            asyncio.run(load.sweep_point(url, "summarize", docs, 8, 8, 600))  # warm-up
            r = {"alone": asyncio.run(load.sweep_point(url, "summarize", docs, 1, 8, 600)),
                 "clients8": asyncio.run(load.sweep_point(url, "summarize", docs, 8, 64, 600)),
                 "clients32": asyncio.run(load.sweep_point(url, "summarize", docs, 32, 128, 600)),
                 "consistency": guarded(lambda: asyncio.run(consistency(url, "summarize", tok, c["length"] - 1,
                                                                        consistency_docs, 32)))}
        finally:
            proc.terminate()
            proc.wait(60)
        result[variant] = r
        log(f"  summarize ({variant}): 1 client {r['alone']['throughput_rps']:.2f} req/s "
            f"({r['alone']['p50_ms']:.0f} ms each), 8 clients {r['clients8']['throughput_rps']:.1f}, 32 clients "
            f"{r['clients32']['throughput_rps']:.1f}; summaries changed under load: "
            f"{r['consistency'].get('changed', '-')} of {r['consistency'].get('documents', '-')}")
    return result


# --- report ------------------------------------------------------------------------------------

def table(r: dict) -> str:
    """The results as markdown lines (docs/gpu.md's tables are filled from the results files)."""
    lines = []
    peak = r.get("peak", {}).get("matmul_peak_tflops") or r.get("hf", {}).get("matmul_peak_tflops")
    c = r["config"]
    share = lambda tflops: f" ({100 * tflops / peak:.0f}%)" if peak else ""  # noqa: E731
    if "ours" in r and "error" not in r["ours"]:
        lines += [f"BigBird-base QA, fp16, {c['length']} tokens, the service's encoder path (measured fp16 MatMul "
                  f"peak {peak or float('nan'):.0f} TFLOP/s)",
                  "| batch | ms | docs/s | TFLOP/s (% of measured peak) |", "|---:|---:|---:|---:|"]
        lines += [f"| {B} | {o['latency_ms']:.1f} | {o['docs_per_s']:.1f} | {o['tflops']:.1f}{share(o['tflops'])} |"
                  for B, o in r["ours"].items()]
    if "variants" in r and "error" not in r["variants"]:
        v = r["variants"]
        lines += [f"\nencoder by `--sparse-gather`, batch {v['batch']}",
                  "| variant | ms | TFLOP/s (% of measured peak) | max abs diff vs gather | verify |",
                  "|---|---:|---:|---:|---|"]
        for name, x in v.items():
            if isinstance(x, dict):
                ok = r.get("verify", {}).get(name, {})
                check = f"{ok.get('passed')}/{ok.get('checks')}" if ok else "-"
                lines.append(f"| {name} | {x['latency_ms']:.1f} | {x['tflops']:.1f}{share(x['tflops'])} | "
                             f"{x['max_abs_diff']:.1e} | {check} |")
    elif "verify" in r and "error" not in r["verify"]:
        for name, v in r["verify"].items():
            lines.append(f"verify --device {r['device']} ({name}): {v['passed']}/{v['checks']} checks, "
                         f"max|diff| {v['max_abs_diff']}, ok={v['ok']}")
    if "kernels" in r and "error" not in r["kernels"]:
        for name, k in r["kernels"].items():
            lines += [f"\nencoder kernels ({name}) at batch {max(c['batches'])}: {k['total_ms']:.1f} ms per run",
                      "| kernel | ms per run | share |", "|---|---:|---:|"]
            lines += [f"| `{x['kernel'][:70]}` | {x['ms']:.2f} | {100 * x['ms'] / k['total_ms']:.0f}% |"
                      for x in k["top"][:12]]
    if "gathers" in r and "gather_ms" in r["gathers"]:
        gt = r["gathers"]
        lines.append(f"\nkey-block gather, batch {gt['B']}, {gt['heads']} heads, {gt['gathered_mb']:.0f} MB gathered: "
                     f"Gather {gt['gather_ms']:.2f} ms, one-hot product {gt['onehot_ms']:.2f} ms "
                     f"(max |diff| {gt['max_abs_diff']:g})")
    if "service" in r and "throughput_rps" in r["service"]:
        s, same = r["service"], r["service"]["consistency"]
        offline = r.get("ours", {}).get(str(max(c["batches"])), {}).get("docs_per_s")
        of = f" ({100 * s['throughput_rps'] / offline:.0f}% of the offline {offline:.1f})" if offline else ""
        lines.append(f"\nQA service, {s['concurrency']} clients: {s['throughput_rps']:.1f} docs/s{of}, p50 "
                     f"{s['p50_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms, {s['ok']}/{s['requests']} ok; answers "
                     f"changed under load: {same.get('changed', '-')} of {same.get('documents', '-')} (scores "
                     f"moved in {same.get('scores_changed', '-')}, by up to {same.get('max_score_change', '-')})")
    if "steps" in r and "error" not in r["steps"]:
        st = r["steps"]
        lines += ["\nPegasus-large greedy decode step, ms per token (switch: "
                  f"{st['switch'] or 'none yet: baseline = new'})", "| batch | new | baseline |", "|---:|---:|---:|"]
        lines += [f"| {B} | {st[f'new_batch{B}_ms_per_token']:.2f} | {st[f'baseline_batch{B}_ms_per_token']:.2f} |"
                  for B in (1, 8)]
    if "summarize" in r and "new" in r["summarize"]:
        sm = r["summarize"]
        lines += [f"\nPegasus-large summaries ({c['new_tokens']} tokens), requests/s", "| | 1 client (s each) | "
                  "8 clients | 32 clients | changed under load |", "|---|---:|---:|---:|---:|"]
        for variant in ("new", "baseline"):
            x = sm.get(variant)
            if x:
                lines.append(f"| {variant} | {x['alone']['throughput_rps']:.2f} ({x['alone']['p50_ms'] / 1000:.2f}) | "
                             f"{x['clients8']['throughput_rps']:.1f} | {x['clients32']['throughput_rps']:.1f} | "
                             f"{x['consistency'].get('changed', '-')} of {x['consistency'].get('documents', '-')} |")
    if "pegasus" in r and "error" not in r["pegasus"]:
        p = r["pegasus"]
        lines += [f"\nBigBird-Pegasus-large fp16, {c['length']} encoder tokens: ms per generated token",
                  "| search | ours (OnnxModel.generate) | service greedy step | transformers |", "|---|---:|---:|---:|"]
        for beams in (1, 5):
            step = p.get(f"service-step_beam{beams}_ms_per_token")
            lines.append(f"| {'greedy' if beams == 1 else 'beam 5'} | {p[f'ours_beam{beams}_ms_per_token']:.2f} | "
                         f"{'-' if step is None else f'{step:.2f}'} | {p[f'transformers_beam{beams}_ms_per_token']:.2f} |")
    if "encoder_opts" in r:
        lines += [f"\nencoder settings, batch {max(c['batches'])}",
                  "| variant | ms | TFLOP/s (% measured peak) | max abs diff vs default |", "|---|---:|---:|---:|"]
        for name, v in r["encoder_opts"].items():
            lines.append(f"| {name} | {v['error'][:80]} | | |" if "error" in v else
                         f"| {name} | {v['latency_ms']:.1f} | {v['tflops']:.1f}{share(v['tflops'])} | "
                         f"{v['max_abs_diff']:.1e} |")
    for name, value in r.items():
        if isinstance(value, dict) and "error" in value:
            lines.append(f"\n{name}: {value['error']}")
    return "\n".join(lines)


def lease_report(out: Path) -> str:
    """The goals of issue 36 (and issues 37, 40) against one lease's results files (bench/gpu_lease.sh
    writes them to $OUT): the table docs/gpu.md shows, a "-" where a file or a figure is missing."""
    def read(name: str) -> dict:
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def get(d, *keys):
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    def fmt(x, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    enc, qa, steps, summ, host = read("encoder"), read("qa_service"), read("steps"), read("summarize"), read("host_path")
    peak = get(enc, "peak", "matmul_peak_tflops")
    B = str(max(get(enc, "config", "batches") or [32]))
    rows = [("| figure | goal | baseline (same run) | new | results file |"), "|---|---|---:|---:|---|"]
    for b, goal in ((1, "<= 1.5"), (8, "<= 2.5")):
        rows.append(f"| greedy step, Pegasus-large, batch {b}, ms per token | {goal} | "
                    f"{fmt(get(steps, 'steps', f'baseline_batch{b}_ms_per_token'))} | "
                    f"{fmt(get(steps, 'steps', f'new_batch{b}_ms_per_token'))} | steps.json |")
    alone = lambda v: None if get(summ, "summarize", v, "alone", "p50_ms") is None else (  # noqa: E731
        get(summ, "summarize", v, "alone", "p50_ms") / 1000)
    rows.append(f"| one 32-token summary alone, s | <= 0.12 | {fmt(alone('baseline'))} | {fmt(alone('new'))} | "
                "summarize.json |")
    for clients, goal in ((8, ">= 40"), (32, ">= 60")):
        rows.append(f"| {clients} clients, summaries per s | {goal} | "
                    f"{fmt(get(summ, 'summarize', 'baseline', f'clients{clients}', 'throughput_rps'), '.1f')} | "
                    f"{fmt(get(summ, 'summarize', 'new', f'clients{clients}', 'throughput_rps'), '.1f')} | summarize.json |")
    changed = lambda v: get(summ, "summarize", v, "consistency")  # noqa: E731
    of = lambda c: "-" if not c else f"{c['changed']} of {c['documents']}"  # noqa: E731
    rows.append(f"| greedy summaries changed under load (issue 40) | 0 | {of(changed('baseline'))} | "
                f"{of(changed('new'))} | summarize.json |")
    variants = {k: v for k, v in (get(enc, "variants") or {}).items() if isinstance(v, dict)}
    for name, v in variants.items() if peak else ():
        rows.append(f"| encoder at batch {B}, `--sparse-gather {name}`, % of the measured fp16 MatMul peak "
                    f"({peak:.0f} TFLOP/s) | >= 30% | | {100 * v['tflops'] / peak:.0f}% ({v['latency_ms']:.1f} ms) "
                    "| encoder.json |")
    if not (variants and peak):
        rows.append(f"| encoder at batch {B}, each `--sparse-gather`, % of the measured fp16 MatMul peak | >= 30% | | "
                    "- | encoder.json |")
    offline = get(enc, "ours", B, "docs_per_s")
    service = get(qa, "service", "throughput_rps")
    share = None if not (offline and service) else 100 * service / offline
    rows.append(f"| QA service, 32 clients, % of the offline batch-{B} rate | >= 90% | | "
                f"{'-' if share is None else f'{share:.0f}% ({service:.1f} of {offline:.1f} docs/s)'} | "
                "qa_service.json, encoder.json |")
    rows.append(f"| QA answers changed under load (issue 40) | 0 | | {of(get(qa, 'service', 'consistency'))} | "
                "qa_service.json |")
    for point in host.get("summary", []):
        rows.append(f"| host path, null engine, {point.get('mode')} on {point.get('cores')} cores, docs/s (issue 37) | "
                    f">= 450 | | {fmt(point.get('docs_per_s'), '.1f')} | host_path.json |")
    if not host.get("summary"):
        rows.append("| host path, null engine, 15 cores, docs/s (issue 37) | >= 450 | | - | host_path.json |")
    return "\n".join(rows)


def main() -> int:
    from longdoc.export.manifest import SPARSE_GATHER

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-gpu"),
                   help="checkpoints and exports go here (default: /tmp/longdoc-gpu)")
    p.add_argument("--out", type=Path, default=None, help="folder for the results file NAME.json (default: none)")
    p.add_argument("--name", default="gpu", help="the results file's name, without .json (default: gpu)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for the --tiny smoke run (default: cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 512 tokens (default: off, real sizes)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated (default: {','.join(PHASES)})")
    p.add_argument("--gathers", default=",".join(SPARSE_GATHER),
                   help="`longdoc export --sparse-gather` variants that make, verify and variants cover "
                        f"(default: {','.join(SPARSE_GATHER)})")
    p.add_argument("--kernel-gathers", default="gather,window",
                   help="the variants whose kernels the kernels phase profiles (default: gather,window)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients of the service phase (default: 32)")
    p.add_argument("--requests", type=int, default=256, help="requests of the service phase (default: 256)")
    p.add_argument("--consistency", type=int, default=CONSISTENCY_DOCS,
                   help=f"documents sent alone, then under load, by service and summarize (default: {CONSISTENCY_DOCS})")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="print the goals table of docs/gpu.md from a lease's results files in DIR and exit "
                        "(default: off)")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--args", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.report:
        print(lease_report(a.report))
        return 0
    if a.phase:
        print(json.dumps(globals()[f"phase_{a.phase}"](**json.loads(a.args))))
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    common = {"work": str(a.work), "tiny": a.tiny}
    gathers = a.gathers.split(",")
    results = {"device": a.device, "command": " ".join(["python3", "bench/gpu.py", *sys.argv[1:]]),
               "config": {k: v for k, v in configs(a.tiny).items() if k in ("length", "batches", "new_tokens")}}
    for phase in a.phases.split(","):
        log(f"phase {phase}")
        start = time.perf_counter()
        if phase == "make":
            results["make"] = {t: child("make", task=t, gathers=gathers, **common) for t in ("qa", "summarize")}
        elif phase in ("verify", "variants"):
            results[phase] = child(phase, device=a.device, gathers=gathers, **common)
        elif phase == "kernels":
            results[phase] = child(phase, device=a.device, gathers=a.kernel_gathers.split(","), **common)
        elif phase == "service":
            results[phase] = child(phase, device=a.device, clients=a.clients, requests=a.requests,
                                   consistency_docs=a.consistency, **common)
        elif phase == "summarize":
            results[phase] = child(phase, device=a.device, consistency_docs=a.consistency, **common)
        else:
            results[phase] = child(phase, device=a.device, **common)
        log(f"phase {phase} done in {time.perf_counter() - start:.0f} s")
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"{a.name}.json").write_text(json.dumps(results, indent=1))
    try:
        print(table(results))
    except Exception as exc:  # noqa: BLE001 - the results file is written; the table is a view of it
        log(f"no table: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
