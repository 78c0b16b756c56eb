"""The GPU path, measured (issue 16, item 3). A script, not a test: it needs a CUDA GPU with
onnxruntime-gpu, torch and transformers (the dev machines have none; `--tiny --device cpu` runs
every phase on small shapes to check the script itself).

Random-init weights (transformers, seed 0) at transformers' default configurations:

    make      BigBirdConfig() QA checkpoint -> `export --dtype fp16`
    verify    `longdoc verify --device cuda --against transformers` of that export at 4096 tokens
    ours      the service's encoder path (CudaWorker's IoBindingEncoder, layout tables kept on the
              GPU) at 4096 tokens, batch 1/8/32: latency, docs/s, model FLOP utilization
    gathers   one head group's key-block gather at the largest batch: ONNX Gather as exported,
              against the same as a product with a one-hot table (exact): for the lowering
    hf        transformers BigBirdForQuestionAnswering fp16 on the same GPU (block-sparse, eval), same
              shapes; and the GPU's measured fp16 MatMul peak (torch, 8192^3)
    service   a real `longdoc serve --device cuda` on the fp16 export, 32 closed-loop clients sending
              4096-token QA documents: throughput and p50/p99, beside the offline batched rate (ours)
    pegasus   BigBirdPegasusConfig() (bigbird-pegasus-large shape) -> fp16 export; time per generated
              token at 4096 encoder tokens, greedy and beam 5: the one search (OnnxModel.generate) on
              the CUDA provider, the service's greedy step path (CudaWorker: KV cache on the GPU), and
              transformers fp16 generate() on the same GPU
    summarize a real `longdoc serve --device cuda` on the Pegasus-large fp16 export: 8 clients asking
              for 32-token greedy summaries of 4096-token documents, then beam-4 requests

Each phase runs in its own process (one CUDA context each). Progress goes to stderr, the table to
stdout, every number to --out/gpu.json.

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
PHASES = ("make", "verify", "ours", "encoder_opts", "kernels", "gathers", "hf", "service", "pegasus", "summarize")
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

def phase_make(work: str, task: str, tiny: bool) -> dict:
    import torch
    import transformers

    from longdoc.export.exporter import export_model
    from longdoc.testing.tiny_models import tiny_tokenizer

    ckpt, out = Path(work) / f"ckpt-{task}", Path(work) / f"fp16-{task}"
    torch.manual_seed(0)
    config = configs(tiny)[task]
    if task == "summarize":
        model = transformers.BigBirdPegasusForConditionalGeneration(transformers.BigBirdPegasusConfig(**config))
    else:
        model = transformers.BigBirdForQuestionAnswering(transformers.BigBirdConfig(**config))
    model.eval().save_pretrained(ckpt, safe_serialization=True)
    tiny_tokenizer().save(str(ckpt / "tokenizer.json"))  # ids < vocab: enough for random weights
    start = time.perf_counter()
    export_model(ckpt, out, task, dtype="fp16", progress=lambda m: log(f"  export: {m}"), overwrite=True)
    return {"params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "export_s": time.perf_counter() - start}


def phase_verify(work: str, device: str, tiny: bool) -> dict:
    from longdoc.export.verify import verify_model

    S = configs(tiny)["length"]
    report = verify_model(Path(work) / "fp16-qa", Path(work) / "ckpt-qa", against="transformers", lengths=[S],
                          device=device, progress=lambda m: log(f"  verify: {m}"))
    diffs = [c.max_abs_diff for c in report.checks if c.max_abs_diff is not None]
    return {"ok": report.ok, "checks": len(report.checks), "passed": sum(c.ok for c in report.checks),
            "max_abs_diff": max(diffs) if diffs else None}


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


def phase_kernels(work: str, device: str, tiny: bool) -> dict:
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
    model = OnnxModel(Path(work) / "fp16-qa", device=kind, device_id=device_id)
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


def phase_service(work: str, device: str, tiny: bool, clients: int, requests: int) -> dict:
    import load
    import tokenizers

    c = configs(tiny)
    model_dir = str(Path(work) / "fp16-qa")
    tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    docs = [load.make_document(tok, c["length"] - 16, seed) for seed in range(8)]
    budget = c["length"] * max(c["batches"])
    proc, url = load.start_server(model_dir, batching=True, threads=None,
                                  extra=["--device", device, "--max-batch-tokens", str(budget)])
    try:
        asyncio.run(load.sweep_point(url, "qa", docs, clients, clients * 2, 600))  # warm-up: every batch size
        point = asyncio.run(load.sweep_point(url, "qa", docs, clients, requests, 600))
    finally:
        proc.terminate()
        proc.wait(60)
    log(f"  service, {clients} clients: {point['throughput_rps']:.1f} docs/s, p50 {point['p50_ms']:.0f} ms, "
        f"p99 {point['p99_ms']:.0f} ms ({point['ok']}/{point['requests']} ok)")
    return point


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


def phase_summarize(work: str, device: str, tiny: bool) -> dict:
    import httpx
    import load
    import tokenizers

    c = configs(tiny)
    model_dir = str(Path(work) / "fp16-summarize")
    tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    docs = [load.make_document(tok, c["length"] - 1, seed) for seed in range(8)]
    proc, url = load.start_server(model_dir, batching=True, threads=None, extra=["--device", device])
    try:
        asyncio.run(load.sweep_point(url, "summarize", docs, 8, 8, 600))  # warm-up
        alone = asyncio.run(load.sweep_point(url, "summarize", docs, 1, 8, 600))
        greedy = asyncio.run(load.sweep_point(url, "summarize", docs, 8, 64, 600))
        many = asyncio.run(load.sweep_point(url, "summarize", docs, 32, 128, 600))
        beams = []
        for doc in docs[:4]:
            start = time.perf_counter()
            r = httpx.post(url + "/v1/summarize", json={"document": doc, "max_new_tokens": c["new_tokens"],
                                                        "num_beams": 4}, timeout=600)
            beams.append({"status": r.status_code, "seconds": time.perf_counter() - start})
    finally:
        proc.terminate()
        proc.wait(60)
    # the same without encoding newcomers beside the steps: what the overlap costs a lone request
    # and buys 8 clients (docs/gpu.md, issue 24)
    proc, url = load.start_server(model_dir, batching=True, threads=None,
                                  extra=["--device", device, "--no-overlap-encoding"])
    try:
        asyncio.run(load.sweep_point(url, "summarize", docs, 8, 8, 600))  # warm-up
        alone_serial = asyncio.run(load.sweep_point(url, "summarize", docs, 1, 8, 600))
        greedy_serial = asyncio.run(load.sweep_point(url, "summarize", docs, 8, 64, 600))
    finally:
        proc.terminate()
        proc.wait(60)
    log(f"  without the overlap: 1 client {alone_serial['throughput_rps']:.2f} req/s (with: "
        f"{alone['throughput_rps']:.2f}); 8 clients {greedy_serial['throughput_rps']:.1f} req/s (with: "
        f"{greedy['throughput_rps']:.1f})")
    log(f"  summarize greedy, 8 clients: {greedy['throughput_rps']:.1f} req/s, p50 {greedy['p50_ms']:.0f} ms, "
        f"p99 {greedy['p99_ms']:.0f} ms ({greedy['ok']}/{greedy['requests']} ok); beam 4: "
        f"{[b['status'] for b in beams]}, median {statistics.median(b['seconds'] for b in beams) * 1000:.0f} ms")
    log(f"  summarize greedy, 1 client: {alone['throughput_rps']:.1f} req/s; 32 clients: "
        f"{many['throughput_rps']:.1f} req/s, p50 {many['p50_ms']:.0f} ms ({many['ok']}/{many['requests']} ok)")
    return {"greedy": greedy, "alone": alone, "clients32": many, "beam4": beams,
            "no_overlap": {"alone": alone_serial, "greedy": greedy_serial}}


# --- report ------------------------------------------------------------------------------------

def table(r: dict) -> str:
    lines = []
    peak = r.get("hf", {}).get("matmul_peak_tflops")
    c = r["config"]
    if "ours" in r and "hf" in r:
        lines += [f"BigBird-base QA, fp16, {c['length']} tokens ({r['hf'].get('gpu', 'cpu')}; measured fp16 MatMul "
                  f"peak {peak or float('nan'):.0f} TFLOP/s, datasheet {H200_FP16_DENSE_TFLOPS:.0f})",
                  "| batch | ours ms | ours docs/s | ours TFLOP/s (% measured peak) | transformers ms | "
                  "transformers docs/s | speed-up |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for B in c["batches"]:
            o, h = r["ours"].get(str(B)), r["hf"].get(str(B))
            if o and h:
                share = f" ({100 * o['tflops'] / peak:.0f}%)" if peak else ""
                lines.append(f"| {B} | {o['latency_ms']:.1f} | {o['docs_per_s']:.1f} | {o['tflops']:.1f}{share} | "
                             f"{h['latency_ms']:.1f} | {h['docs_per_s']:.1f} | {h['latency_ms'] / o['latency_ms']:.2f}x |")
    if "gathers" in r and "gather_ms" in r["gathers"]:
        gt = r["gathers"]
        lines.append(f"\nkey-block gather, batch {gt['B']}, {gt['heads']} heads, {gt['gathered_mb']:.0f} MB gathered: "
                     f"Gather {gt['gather_ms']:.2f} ms, one-hot product {gt['onehot_ms']:.2f} ms "
                     f"(max |diff| {gt['max_abs_diff']:g})")
    if "service" in r and "ours" in r and "throughput_rps" in r["service"]:
        s, best = r["service"], max(v["docs_per_s"] for v in r["ours"].values())
        lines.append(f"\nservice, {s['concurrency']} clients: {s['throughput_rps']:.1f} docs/s "
                     f"({100 * s['throughput_rps'] / best:.0f}% of the offline best {best:.1f}), p50 "
                     f"{s['p50_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms, {s['ok']}/{s['requests']} ok")
    if "verify" in r:
        v = r["verify"]
        lines.append(f"\nverify --device {r['device']}: {v.get('passed')}/{v.get('checks')} checks, "
                     f"max|diff| {v.get('max_abs_diff')}, ok={v.get('ok')}")
    if "pegasus" in r and "error" not in r["pegasus"]:
        p = r["pegasus"]
        lines += [f"\nBigBird-Pegasus-large fp16, {c['length']} encoder tokens: ms per generated token",
                  "| search | ours (OnnxModel.generate) | service greedy step (KV on device) | transformers |",
                  "|---|---:|---:|---:|"]
        for beams in (1, 5):
            step = p.get(f"service-step_beam{beams}_ms_per_token")
            lines.append(f"| {'greedy' if beams == 1 else 'beam 5'} | {p[f'ours_beam{beams}_ms_per_token']:.2f} | "
                         f"{'-' if step is None else f'{step:.2f}'} | {p[f'transformers_beam{beams}_ms_per_token']:.2f} |")
    if "encoder_opts" in r:
        lines += [f"\nencoder settings, batch {max(c['batches'])} ({peak and f'measured peak {peak:.0f} TFLOP/s' or 'no peak'})",
                  "| variant | ms | docs/s | TFLOP/s (% measured peak) | max abs diff vs default |", "|---|---:|---:|---:|---:|"]
        for name, v in r["encoder_opts"].items():
            if "error" in v:
                lines.append(f"| {name} | {v['error'][:80]} | | | |")
            else:
                share = f" ({100 * v['tflops'] / peak:.0f}%)" if peak else ""
                lines.append(f"| {name} | {v['latency_ms']:.1f} | {v['docs_per_s']:.1f} | {v['tflops']:.1f}{share} | "
                             f"{v['max_abs_diff']:.1e} |")
    if "kernels" in r and "top" in r["kernels"]:
        k = r["kernels"]
        lines += [f"\nencoder kernels at batch {max(c['batches'])}: {k['total_ms']:.1f} ms per run",
                  "| kernel | ms per run | share |", "|---|---:|---:|"]
        lines += [f"| `{x['kernel'][:70]}` | {x['ms']:.2f} | {100 * x['ms'] / k['total_ms']:.0f}% |" for x in k["top"][:15]]
    if "summarize" in r and "greedy" in r["summarize"]:
        g, b = r["summarize"]["greedy"], r["summarize"]["beam4"]
        if "clients32" in r["summarize"]:
            a, m = r["summarize"]["alone"], r["summarize"]["clients32"]
            lines.append(f"\nservice, Pegasus-large summarize: 1 client {a['throughput_rps']:.2f} req/s; 32 clients "
                         f"{m['throughput_rps']:.2f} req/s, p50 {m['p50_ms']:.0f} ms, {m['ok']}/{m['requests']} ok")
        if "no_overlap" in r["summarize"]:
            a, n = r["summarize"]["alone"], r["summarize"]["no_overlap"]
            lines.append(f"\nservice, Pegasus-large summarize without --overlap-encoding: 1 client "
                         f"{n['alone']['throughput_rps']:.2f} req/s (with: {a['throughput_rps']:.2f}), 8 clients "
                         f"{n['greedy']['throughput_rps']:.2f} req/s (with: {g['throughput_rps']:.2f})")
        lines.append(f"\nservice, Pegasus-large summarize ({c['new_tokens']} new tokens): greedy, 8 clients "
                     f"{g['throughput_rps']:.2f} req/s, p50 {g['p50_ms']:.0f} ms, p99 {g['p99_ms']:.0f} ms, "
                     f"{g['ok']}/{g['requests']} ok; beam 4 one at a time: median "
                     f"{statistics.median(x['seconds'] for x in b) * 1000:.0f} ms, statuses {[x['status'] for x in b]}")
    for name, value in r.items():
        if isinstance(value, dict) and "error" in value:
            lines.append(f"\n{name}: {value['error']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-gpu"),
                   help="checkpoints and exports go here (default: /tmp/longdoc-gpu)")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu.json and gpu.md (default: none)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for the --tiny smoke run (default: cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 512 tokens (default: off, real sizes)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated (default: {','.join(PHASES)})")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients of the service phase (default: 32)")
    p.add_argument("--requests", type=int, default=256, help="requests of the service phase (default: 256)")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--args", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:
        print(json.dumps(globals()[f"phase_{a.phase}"](**json.loads(a.args))))
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    common = {"work": str(a.work), "tiny": a.tiny}
    results = {"device": a.device, "config": {k: v for k, v in configs(a.tiny).items() if k in ("length", "batches",
                                                                                                "new_tokens")}}
    for phase in a.phases.split(","):
        log(f"phase {phase}")
        start = time.perf_counter()
        if phase == "make":
            results["make"] = {t: child("make", task=t, **common) for t in ("qa", "summarize")}
        elif phase == "service":
            results[phase] = child(phase, device=a.device, clients=a.clients, requests=a.requests, **common)
        else:
            results[phase] = child(phase, device=a.device, **common)
        log(f"phase {phase} done in {time.perf_counter() - start:.0f} s")
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "gpu.json").write_text(json.dumps(results, indent=1))
    report = table(results)
    print(report)
    if a.out:
        (a.out / "gpu.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
