"""Where an export's time goes (issue 16): ONNX Runtime's profiler over one run, by op type. A script.

For each model directory (the exports bench/bench_export.py writes: ours-int8, ours-int8-attn, ...)
a session with the serving options (export/runtime.py: threads, memory pattern off) and
`SessionOptions.enable_profiling` runs one warm-up and one profiled run of a batch-1 input of
--length tokens. Only the kernels of the last run are counted (the profiler's `model_run` window).
Printed per model:

  - kernel time by op type after ONNX Runtime's graph fusions (MatMulIntegerToFloat,
    DynamicQuantizeMatMul, ...), % of the summed kernel time;
  - the same split into the dense layers (products with a constant weight, bias, Gelu, LayerNorm)
    and the attention (everything `export/sparse_attention.py` builds), by node name;
  - the GEMMs' achieved rate: dense-layer FLOPs / their MatMul kernel time, attention-product
    FLOPs / theirs, against the measured peaks (bench_export.matmul_peaks: 2048^3 MatMul, fp32 and
    dynamically quantized int8, best of 10; and the attention's own shape, 256 batched products
    of 64x64 by 64x512 and 64x512 by 512x64, fp32 and uint8 x int8 MatMulInteger, best of 10).

    .venv/bin/python bench/profile_ops.py /tmp/longdoc-bench/ours-int8-4096 /tmp/longdoc-bench/ours-int8-attn-4096
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench_export import BS, E, H, I, L, R, matmul_peaks  # bench/bench_export.py (the script's folder)

_GEMM_OPS = {"MatMul", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "FusedMatMul", "Gemm"}


def attention_gemm_flops(S: int) -> float:
    """Multiply-adds x 2 of the block-sparse attention's products (bench_export.model_flops)."""
    D, nb = E // H, S // BS
    sparse_rows = (nb - 2) * BS * (5 + R) * BS
    global_rows = 2 * BS * S
    return L * 2 * 2 * H * (sparse_rows + global_rows) * D


def dense_gemm_flops(S: int) -> float:
    return L * 2 * S * (4 * E * E + 2 * E * I) + 2 * S * (2 * E * I) + 2 * S * E * 2


def attention_shape_peaks(threads: int, reps: int = 10) -> dict[str, float]:
    """fp32 MatMul and uint8 x int8 MatMulInteger at the attention's shapes (4 heads, 64 query
    blocks: 256 products per call), GOP/s, best of `reps`."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def session(a_type, b_type, out_type, op):
        vi = helper.make_tensor_value_info
        graph = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], "p",
                                  [vi("a", a_type, None), vi("b", b_type, None)], [vi("y", out_type, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.log_severity_level = 3
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(0)
    rates = {}
    for what, (M, K, N) in (("QK", (64, 64, 512)), ("PV", (64, 512, 64))):
        cases = {
            "fp32": (session(TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.FLOAT, "MatMul"),
                     rng.standard_normal((1, 4, 64, M, K)).astype(np.float32),
                     rng.standard_normal((1, 4, 64, K, N)).astype(np.float32)),
            "u8s8": (session(TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32, "MatMulInteger"),
                     rng.integers(0, 256, (1, 4, 64, M, K), dtype=np.uint8),
                     rng.integers(-127, 128, (1, 4, 64, K, N), dtype=np.int8)),
            "u8u8": (session(TensorProto.UINT8, TensorProto.UINT8, TensorProto.INT32, "MatMulInteger"),
                     rng.integers(0, 256, (1, 4, 64, M, K), dtype=np.uint8),
                     rng.integers(0, 256, (1, 4, 64, K, N), dtype=np.uint8)),
        }
        for name, (s, a, b) in cases.items():
            s.run(None, {"a": a, "b": b})
            best = min(_timed(lambda: s.run(None, {"a": a, "b": b})) for _ in range(reps))
            rates[f"{what} {name}"] = 2 * 256 * M * K * N / best / 1e9
    del onnx
    return rates


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def profile(model_dir: Path, S: int, threads: int) -> list[dict]:
    """The kernel events of one run (after a warm-up): [{name, op, us}]."""
    import onnxruntime as ort

    from longdoc.export.runtime import OnnxModel

    m = OnnxModel(model_dir, threads=threads)
    ids = np.random.default_rng(0).integers(100, 30000, (1, S))
    feed, _ = m.encoder_feed(ids, np.ones_like(ids))
    del m
    options = ort.SessionOptions()  # the serving options (export/runtime.py) plus the profiler
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    options.enable_mem_pattern = False
    with tempfile.TemporaryDirectory() as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(model_dir / "encoder.onnx"), options, providers=["CPUExecutionProvider"])
        for _ in range(2):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    start, end = runs[-1]["ts"], runs[-1]["ts"] + runs[-1]["dur"]
    return [{"name": e["name"].removesuffix("_kernel_time"), "op": e["args"]["op_name"], "us": e["dur"]}
            for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
            and start <= e["ts"] <= end]


def is_dense(event: dict) -> bool:
    """A dense-layer node (or the embeddings/head), not the attention's: export/sparse_attention.py
    names its nodes `layerN/attn/...`, and ONNX Runtime's fused nodes keep the first node's name."""
    return "/attn/" not in event["name"]


def report(model_dir: Path, events: list[dict], S: int, peaks: dict, shape_peaks: dict) -> dict:
    total = sum(e["us"] for e in events) / 1e6
    by_op = defaultdict(float)
    by_part = defaultdict(lambda: defaultdict(float))
    for e in events:
        by_op[e["op"]] += e["us"] / 1e6
        by_part["dense" if is_dense(e) else "attention"][e["op"]] += e["us"] / 1e6
    print(f"\n{model_dir.name}: {S} tokens, one run, summed kernel time {total:.2f} s ({len(events)} kernels)")
    print(f"  {'op type':28} {'s':>7} {'%':>6}")
    for op, t in sorted(by_op.items(), key=lambda kv: -kv[1]):
        print(f"  {op:28} {t:7.3f} {100 * t / total:5.1f}%")
    out = {"model": model_dir.name, "total_s": total, "by_op": dict(by_op)}
    for part, ops in by_part.items():
        part_total = sum(ops.values())
        gemm = sum(t for op, t in ops.items() if op in _GEMM_OPS)
        flops = dense_gemm_flops(S) if part == "dense" else attention_gemm_flops(S)
        top = ", ".join(f"{op} {t:.3f}" for op, t in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
        int8 = any(op in ops for op in ("MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"))
        if part == "dense":
            peak, against = peaks["int8" if int8 else "fp32"], f"2048^3 {'int8' if int8 else 'fp32'}"
        else:  # the attention's own shapes, the mean of its two products' peaks
            kind = "u8s8" if int8 else "fp32"
            peak, against = (shape_peaks[f"QK {kind}"] + shape_peaks[f"PV {kind}"]) / 2, f"its shapes, {kind}"
        rate = flops / gemm / 1e9
        print(f"  {part}: {part_total:.3f} s ({100 * part_total / total:.0f}%); its products {gemm:.3f} s for "
              f"{flops / 1e9:.0f} GFLOP = {rate:.0f} GOP/s, {100 * rate / peak:.0f}% of the peak ({against} "
              f"{peak:.0f}); top: {top}")
        out[part] = {"s": part_total, "gemm_s": gemm, "gflop": flops / 1e9, "gops": rate, "peak_gops": peak,
                     "ops": dict(ops)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dirs", nargs="+", type=Path, help="exported model directories (BigBird-base QA shape)")
    p.add_argument("--length", type=int, default=4096, help="tokens of the batch-1 input (default: 4096)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default: 2)")
    p.add_argument("--json", type=Path, default=None, help="also write the breakdowns here (default: none)")
    args = p.parse_args()
    peaks = matmul_peaks(args.threads)
    shape_peaks = attention_shape_peaks(args.threads)
    print(f"peaks ({args.threads} threads, best of 10): 2048^3 MatMul fp32 {peaks['fp32']:.0f} GFLOP/s, dynamically "
          f"quantized int8 {peaks['int8']:.0f} GOP/s; attention shapes (256 x): "
          + ", ".join(f"{k} {v:.0f}" for k, v in shape_peaks.items()) + " GOP/s")
    results = [report(d, profile(d, args.length, args.threads), args.length, peaks, shape_peaks)
               for d in args.model_dirs]
    if args.json:
        args.json.write_text(json.dumps({"peaks": peaks, "attention_shape_peaks": shape_peaks, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
