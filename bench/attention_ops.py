"""What one full-attention head group costs in ONNX Runtime on this CPU, op by op and as the
fused kernels ONNX Runtime offers (issue 28: why ModernBERT's 8 full layers, not its 14 band
layers, set the int8 export's time at 8192 tokens). A script, not a test.

Random q, k, v (1, heads, S, 64) fp32 (seeded), a key-padding bias (1, 1, 1, S) with the last 1% of
keys masked; each variant is its own one-node (or few-node) ONNX graph in its own session, run
--reps times after a warm-up, in rounds that interleave the variants; the best time of each is
reported. Threads: --threads intra-op threads.

    qk           Q.K^T, fp32 MatMul (B, h, S, S) out
    qk+bias      Q.K^T then the bias Add (the dense layers' path before the bias was folded in)
    qk-folded    [q, 1].[k, bias]^T: the bias as one more column (the path the export writes)
    softmax      Softmax over (B, h, S, S)
    pv           P.V, fp32 MatMul
    pv-int8      P.V as MatMulInteger on already-quantized u8 x s8 inputs (int32 out)
    quantize-p   DynamicQuantizeLinear of P (what int8 P.V has to pay first)
    layer-folded the whole group as the export computed it until 2026-11-27: folded Q.K^T, Softmax, P.V
    layer-chunked the group as the export computes it now: the same, over up to QUERY_CHUNKS chunks of
                 query rows, one after another, so a chunk's scores are still in the cache when
                 Softmax and P.V read them
    (qk-folded, layer-folded and layer-chunked are built by export/sparse_attention.py's own code)
    attention-23 the same as ONNX's own Attention op (opset 23), as ONNX Runtime implements it
                 (its mask must cover every query row: a boolean (S, S))
    mha          ONNX Runtime's com.microsoft MultiHeadAttention with a key-padding mask (a contrib
                 op, not plain ONNX: for comparison only; (B, S, h*64) layout)

    .venv/bin/python bench/attention_ops.py --length 8192 --heads 4 --json docs/attention_ops.json

prints the table and writes the JSON (docs/modernbert.md, "Where the time goes").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from common import command_line, cpu_name, loadavg, log

D = 64


def graphs(h: int):
    """name -> (ModelProto, input names)"""
    from onnx import TensorProto as T
    from onnx import helper

    def f32(name, shape=None):
        return helper.make_tensor_value_info(name, T.FLOAT, shape)

    def model(nodes, inputs, out_type=T.FLOAT, opset=17, init=()):
        g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", out_type, None)],
                              initializer=list(init))
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid("com.microsoft", 1)])

    node = helper.make_node
    scale = helper.make_tensor("scale", T.FLOAT, [], [D ** -0.5])
    qkv = [f32("q"), f32("k"), f32("v")]
    u8, s8 = helper.make_tensor_value_info("pq", T.UINT8, None), helper.make_tensor_value_info("vq", T.INT8, None)
    return {
        "qk": (model([node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["y"])],
                     qkv[:2]), ("q", "k")),
        "qk+bias": (model([node("Mul", ["q", "scale"], ["qs"]), node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
                           node("MatMul", ["qs", "kt"], ["s"]), node("Add", ["s", "bias"], ["y"])],
                          qkv[:2] + [f32("bias")], init=[scale]), ("q", "k", "bias")),
        "qk-folded": (exported(h, "qk-folded"), ("q", "k", "bias")),
        "softmax": (model([node("Softmax", ["p"], ["y"], axis=-1)], [f32("p")]), ("p",)),
        "pv": (model([node("MatMul", ["p", "v"], ["y"])], [f32("p"), f32("v")]), ("p", "v")),
        "pv-int8": (model([node("MatMulInteger", ["pq", "vq"], ["y"])], [u8, s8], T.INT32), ("pq", "vq")),
        "quantize-p": (model([node("DynamicQuantizeLinear", ["p"], ["y", "ps", "pz"])], [f32("p")], T.UINT8),
                       ("p",)),
        "layer-folded": (exported(h, "layer-folded"), ("q", "k", "v", "bias")),
        "layer-chunked": (exported(h, "layer-chunked"), ("q", "k", "v", "bias")),
        "attention-23": (model([node("Attention", ["q", "k", "v", "allowed"], ["y"])],
                               qkv + [helper.make_tensor_value_info("allowed", T.BOOL, None)], opset=23),
                         ("q", "k", "v", "allowed")),
        "mha": (model([node("MultiHeadAttention", ["qb", "kb", "vb", "", "key_padding"], ["y"],
                            domain="com.microsoft", num_heads=h)],
                      [f32("qb"), f32("kb"), f32("vb"), helper.make_tensor_value_info("key_padding", T.INT32, None)]),
                ("qb", "kb", "vb", "key_padding")),
    }


def exported(h: int, variant: str):
    """One head group built by the export's own code (export/sparse_attention.py): "qk-folded" the
    scores' product with the key bias as a last feature (`with_key_bias_column`), "layer-folded"
    the whole group as `dense_attention` built it for full layers until 2026-11-27 (one chunk),
    "layer-chunked" as it builds it now (QUERY_CHUNKS)."""
    from onnx import TensorProto as T

    from longdoc.export.graph import GraphBuilder
    from longdoc.export.sparse_attention import QUERY_CHUNKS, dense_attention, with_key_bias_column

    g = GraphBuilder("group")
    for name in ("q", "k", "v") if variant != "qk-folded" else ("q", "k"):
        g.input(name, T.FLOAT, [1, h, "S", D])
    g.input("bias", T.FLOAT, [1, 1, 1, "S"])
    if variant == "qk-folded":
        q, k = with_key_bias_column(g, g.op("Mul", ["q", g.fconst(D ** -0.5)]), "k", "bias")
        y = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
        g.output(y, "y", None, [1, h, "S", "S"])
    else:
        chunks = QUERY_CHUNKS if variant == "layer-chunked" else 1
        y = dense_attention(g, "q", "k", "v", "bias", D ** -0.5, fold_key_bias=True, query_chunks=chunks)
        g.output(y, "y", None, [1, h, "S", D])
    return g.model()


def inputs(S: int, h: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, S, D), dtype=np.float32) for _ in range(3))
    bias = np.zeros((1, 1, 1, S), np.float32)
    bias[..., S - max(1, S // 100):] = -10000.0
    p = rng.random((1, h, S, S), dtype=np.float32)
    p /= p.sum(-1, keepdims=True)

    def bsd(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(1, S, h * D))

    real = bias[0, 0] == 0  # (1, S)
    return {"q": q, "k": k, "v": v, "bias": bias, "p": p,
            "allowed": np.broadcast_to(real, (S, S)).copy(),  # Attention-23's mask covers every query row
            "key_padding": real.astype(np.int32),
            "pq": rng.integers(0, 256, p.shape, dtype=np.uint8), "vq": rng.integers(-127, 128, v.shape, dtype=np.int8),
            "qb": bsd(q), "kb": bsd(k), "vb": bsd(v)}


def markdown_table(results: dict) -> str:
    """The table docs/modernbert.md shows, from a results file."""
    best, diff = results["best_s"], results["max_diff_vs_layer_folded"]
    lines = [f"| variant | best of {results['reps']} s | vs layer-folded | max \\|diff\\| vs layer-folded |",
             "|---|---|---|---|"]
    for name, t in best.items():
        lines.append(f"| {name} | {t:.3f} | {t / best['layer-folded']:.2f}x | "
                     f"{f'{diff[name]:.1e}' if name in diff else ''} |")
    lines += [f"| {name} | failed: {why} | | |" for name, why in results["failed"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192, help="tokens S (default: 8192)")
    p.add_argument("--heads", type=int, default=4,
                   help="heads in the group (default: 4, the export's HEADS_PER_GROUP)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default: 2)")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per variant (default: 3)")
    p.add_argument("--json", type=Path, default=None, help="write the results here (default: none)")
    a = p.parse_args(argv)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = a.threads, 1
    options.log_severity_level = 3
    feeds = inputs(a.length, a.heads)
    sessions, failed = {}, {}
    for name, (m, names) in graphs(a.heads).items():
        try:
            s = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
            s.run(None, {n: feeds[n] for n in names})  # warm-up
            sessions[name] = (s, names)
        except Exception as e:  # an op this ONNX Runtime does not implement on the CPU
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"{name}: {failed[name]}")
    times: dict[str, list[float]] = {n: [] for n in sessions}
    load_before = loadavg()
    for r in range(a.reps):
        for name, (s, names) in sessions.items():
            feed = {n: feeds[n] for n in names}
            t0 = time.perf_counter()
            s.run(None, feed)
            times[name].append(time.perf_counter() - t0)
        log(f"round {r + 1}/{a.reps}: " + ", ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()))
    best = {n: min(t) for n, t in times.items()}
    # the whole-attention variants compute the same thing: their largest difference from layer-folded
    outs = {n: sessions[n][0].run(None, {k: feeds[k] for k in sessions[n][1]})[0]
            for n in ("layer-folded", "layer-chunked", "attention-23", "mha") if n in sessions}
    if "mha" in outs:
        outs["mha"] = outs["mha"].reshape(1, a.length, a.heads, D).transpose(0, 2, 1, 3)
    diff = {n: float(np.abs(o - outs["layer-folded"]).max()) for n, o in outs.items()}
    results = {"command": command_line("attention_ops.py", argv),
               "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpu": cpu_name(), "cpus": os.cpu_count(),
               "onnxruntime": ort.__version__, "length": a.length, "heads": a.heads, "threads": a.threads,
               "reps": a.reps, "loadavg_before": load_before,
               "loadavg_after": loadavg(),
               "seconds": times, "best_s": best, "max_diff_vs_layer_folded": diff, "failed": failed}
    print(markdown_table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
