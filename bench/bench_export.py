"""Speed and memory of the exported BigBird (issue 3, "Speed and memory"). A script, not a test.

BigBird-base shape (12 layers, hidden 768, 12 heads, block 64, r 3), random-init weights
(transformers, seed 0), QA head, batch 1, 2 threads. Same weights, same run:

    ours-fp32     our export (block-sparse lowered to Gather/MatMul, one dynamic graph), fp32
    ours-int8     the same graph, ONNX Runtime dynamic int8 quantization of the dense MatMuls
    ours-int8-attn  ours-int8 with the attention's products in int8 too (`longdoc export
                  --int8-attention`, the mode given by --int8-attention)
    hf-torch      transformers PyTorch, attention_type=block_sparse (eval mode)
    hf-traced     transformers traced by torch.onnx.export at one fixed length (4096): what a user
                  can do today; it runs at the traced length only (tried at the others: fails)
    full-onnx     a full-attention export of the same weights (our builder, dense attention)

Every measurement runs in a fresh subprocess: "peak" = that process's peak RSS (VmHWM, i.e.
ru_maxrss without the fork+exec carry-over), "act" = peak minus the RSS once the model is
loaded (activations and workspace). Median of --reps runs after one
warm-up. Achieved GFLOP/s = model FLOPs (dense layers + the attention actually computed by
the block-sparse pattern; full attention for full-onnx) / median latency.

    .venv/bin/python bench/bench_export.py --work /tmp/longdoc-bench            # 1024..4096
    .venv/bin/python bench/bench_export.py --work /tmp/longdoc-bench --long     # + 8192, 16384
    .venv/bin/python bench/bench_export.py --interleave ...    # kinds alternate run by run

With --interleave, every kind at a length is loaded at once (one process each) and their runs
alternate round-robin, so a slow spell of the shared machine hits every kind alike and the
ratios hold; without it, each kind runs all its runs in turn.

Writes bench_export.md (the full table), bench_export.json and bench_export.png (log-log) into --out;
docs/benchmarks.md's table is `markdown_table` of docs/bench_export.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longdoc.export.manifest import INT8_ATTENTION, SPARSE_GATHER  # NumPy-free, no onnx

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("ours-fp32", "ours-int8", "ours-int8-attn", "hf-torch", "hf-traced", "full-onnx")
INT8_ATTENTION_DEFAULT = "per-row"  # the mode measured as ours-int8-attn (docs/notes/export-speed.md)
E, L, H, I, BS, R = 768, 12, 12, 3072, 64, 3
TRACED_LENGTH = 4096


# --- FLOPs -----------------------------------------------------------------------------------

def model_flops(S: int, full: bool) -> float:
    """Multiply-adds x 2 of one forward at length S (batch 1), QA head included."""
    dense = 2 * S * (4 * E * E + 2 * E * I)  # q, k, v, out; fc1, fc2
    D = E // H
    if full or S <= (5 + 2 * R) * BS:
        attn = 2 * 2 * H * S * S * D
    else:
        nb = S // BS
        sparse_rows = (nb - 2) * BS * (5 + R) * BS  # window 3 + 2 global + r random key blocks
        global_rows = 2 * BS * S
        attn = 2 * 2 * H * (sparse_rows + global_rows) * D
    head = 2 * S * (2 * E * I) + 2 * S * E * 2
    return L * (dense + attn) + head


# --- preparation (parent process) -------------------------------------------------------------

def prepare(work: Path, max_position: int, log, kinds=KINDS, int8_attention: str = INT8_ATTENTION_DEFAULT
            ) -> dict[str, Path]:
    """Random-init checkpoints (sparse and original_full, same weights) and the exports of `kinds`."""
    import torch
    import transformers

    from longdoc.export.exporter import export_model
    from longdoc.testing.tiny_models import tiny_tokenizer

    paths = {}
    ck = work / f"ckpt-{max_position}"
    if not (ck / "config.json").is_file():
        log(f"creating random-init BigBird-base QA checkpoint (max_position {max_position}) in {ck}")
        torch.manual_seed(0)
        config = transformers.BigBirdConfig(max_position_embeddings=max_position, block_size=BS,
                                            num_random_blocks=R, attention_type="block_sparse")
        transformers.BigBirdForQuestionAnswering(config).eval().save_pretrained(ck)
        tiny_tokenizer().save(str(ck / "tokenizer.json"))
    paths["ckpt"] = ck
    full_ck = work / f"ckpt-{max_position}-full"
    if not (full_ck / "config.json").is_file():
        full_ck.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "tokenizer.json"):
            dst = full_ck / name
            if not dst.exists():
                os.symlink(ck / name, dst)
        config = json.loads((ck / "config.json").read_text())
        (full_ck / "config.json").write_text(json.dumps({**config, "attention_type": "original_full"}))
    exports = {"ours-fp32": (ck, "fp32", "off"), "ours-int8": (ck, "int8", "off"),
               "ours-int8-attn": (ck, "int8", int8_attention), "full-onnx": (full_ck, "fp32", "off")}
    for kind in kinds:
        base, gather = split_kind(kind)
        if base not in exports:
            continue
        source, dtype, attention = exports[base]
        name = base if attention == "off" else f"{base}-{attention}"
        out = work / (f"{name}-{max_position}" if gather == "gather" else f"{name}-{gather}-{max_position}")
        if not (out / "manifest.json").is_file():
            log(f"exporting {kind} -> {out}")
            export_model(source, out, "qa", dtype=dtype, progress=lambda m: log("  " + m), int8_attention=attention,
                         sparse_gather=gather)
        paths[kind] = out
    return paths


def kind_order(kind: str) -> tuple[int, int]:
    base, gather = split_kind(kind)
    return KINDS.index(base), SPARSE_GATHER.index(gather)


def split_kind(kind: str) -> tuple[str, str]:
    """`ours-fp32@window` -> ("ours-fp32", "window"): an export kind with `longdoc export
    --sparse-gather` (SPARSE_GATHER); a bare kind gathers as the default ("gather")."""
    base, _, gather = kind.partition("@")
    if base not in KINDS or (gather and (gather not in SPARSE_GATHER or not base.startswith("ours-"))):
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}, an ours-* kind optionally "
                         f"with @{'|@'.join(SPARSE_GATHER)}")
    return base, gather or "gather"


def trace_export(ckpt: Path, out: Path, S: int, log) -> Path:
    """transformers traced by torch.onnx.export at a fixed length (TorchScript exporter)."""
    path = out / "model.onnx"
    if path.is_file():
        return path
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    model = transformers.BigBirdForQuestionAnswering.from_pretrained(str(ckpt)).eval()
    ids = torch.randint(100, 30000, (1, S))
    log(f"torch.onnx.export of transformers at fixed length {S} -> {path}")
    start = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(model, (ids, torch.ones_like(ids)), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["start_logits", "end_logits"], opset_version=17, dynamo=False)
    log(f"  traced in {time.perf_counter() - start:.0f} s")
    return path


# --- one measurement (child process) ------------------------------------------------------------

def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _peak_gib() -> float:
    """VmHWM: this process's peak RSS. (ru_maxrss is not used: after fork + exec Linux carries
    the forked parent's high-water mark over into the child's.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load(kind: str, path: str, S: int, threads: int, mem_cap_gib: float = 0):
    """The model of `kind`, ready to run on one batch-1 input of S tokens -> run()."""
    import numpy as np

    if mem_cap_gib:  # fail cleanly (allocation error) instead of running the machine out of memory
        cap = int(mem_cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    ids = np.random.default_rng(0).integers(100, 30000, (1, S)).astype(np.int64)
    mask = np.ones_like(ids)
    if kind == "hf-torch":
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.BigBirdForQuestionAnswering.from_pretrained(path).eval()
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)

        def run():
            model.bert.set_attention_type("block_sparse")
            with torch.no_grad():
                model(input_ids=t_ids, attention_mask=t_mask)
    elif kind == "hf-traced":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        # ORT's default session options; like ours (export/runtime.py), the heap freed while
        # loading goes back to the OS (not an ORT option: it applies to any session equally)
        from longdoc.export.runtime import _release_freed_heap

        _release_freed_heap()

        def run():
            session.run(None, {"input_ids": ids, "attention_mask": mask})
    else:
        from longdoc.export.runtime import OnnxModel

        model = OnnxModel(path, threads=threads)

        def run():
            model.run_encoder(ids, mask)
    return run


def timed(run) -> tuple[float, float]:
    """(wall s, CPU s of this process) of one run."""
    start, cpu_start = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - start, time.process_time() - cpu_start


def measure(kind: str, path: str, S: int, reps: int, threads: int, mem_cap_gib: float = 0) -> dict:
    """One child process, all runs of one kind back to back."""
    run = load(kind, path, S, threads, mem_cap_gib)
    rss_loaded = _rss_gib()
    warm = timed(run)[0]  # warm-up (and layout build)
    times, cpu = zip(*(timed(run) for _ in range(reps)))
    return summarize(kind, S, list(times), list(cpu), warm, rss_loaded)


def summarize(kind: str, S: int, times: list[float], cpu: list[float], warm: float, rss_loaded: float) -> dict:
    import numpy as np

    peak = _peak_gib()
    return {"kind": kind, "length": S, "times": times, "cpu": cpu, "median_cpu": float(np.median(cpu)),
            "warmup": warm, "median": float(np.median(times)),
            "peak_gib": peak, "loaded_gib": rss_loaded, "act_gib": peak - rss_loaded}


def run_child(kind: str, path: Path, S: int, reps: int, threads: int, timeout: float,
              mem_cap_gib: float = 0) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, "--path", str(path), "--length", str(S),
           "--reps", str(reps), "--threads", str(threads), "--mem-cap-gib", str(mem_cap_gib)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "length": S, "error": f"timeout after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"kind": kind, "length": S, "error": exit_error(proc.returncode, proc.stderr)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def exit_error(returncode: int, stderr: str) -> str:
    """One line for a failed measuring process: its exit status and the telling stderr line."""
    lines = stderr.strip().splitlines() or ["?"]
    tail = next((x for x in reversed(lines) if "invalid" in x.lower() or "Error" in x or "alloc" in x.lower()),
                lines[-1])
    return f"exit {returncode}: {tail[:200]}"


PROTOCOL = "@@bench "  # prefix of the lines a serving child writes for the parent


def serve(kind: str, path: str, S: int, threads: int, mem_cap_gib: float = 0) -> None:
    """Child side of --interleave: load and warm up, then one timed run per "run" line on stdin."""
    run = load(kind, path, S, threads, mem_cap_gib)
    rss_loaded = _rss_gib()
    warm = timed(run)[0]
    times, cpu = [], []
    print(PROTOCOL + "ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t, c = timed(run)
        times.append(t)
        cpu.append(c)
        print(PROTOCOL + "done", flush=True)
    print(PROTOCOL + json.dumps(summarize(kind, S, times, cpu, warm, rss_loaded)), flush=True)


class ServingChild:
    """A `serve` subprocess; every wait is bounded by `timeout` seconds (then it is killed)."""

    def __init__(self, kind: str, path: Path, S: int, threads: int, timeout: float, mem_cap_gib: float):
        self.kind, self.S, self.timeout, self.error = kind, S, timeout, None
        cmd = [sys.executable, __file__, "--serve", kind, "--path", str(path), "--length", str(S),
               "--threads", str(threads), "--mem-cap-gib", str(mem_cap_gib)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        # stderr to a file, not a pipe: a child that warns a lot must not block on a full pipe
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        self.expect("ready")

    def expect(self, what: str | None = None) -> str | None:
        """The next protocol line (None, with self.error set, if the child died or timed out)."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.timeout
        while self.error is None:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self.proc.kill()
                self.error = f"timeout after {self.timeout:.0f} s"
                break
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                self.stderr.seek(0)
                self.error = exit_error(self.proc.returncode, self.stderr.read())
                break
            if line.startswith(PROTOCOL):
                body = line[len(PROTOCOL):].strip()
                if what is None or body == what:
                    return body
        return None

    def run_once(self) -> None:
        if self.error is None:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
            self.expect("done")

    def finish(self) -> dict:
        if self.error is None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            body = self.expect()
            self.proc.wait()
            if body is not None:
                return json.loads(body)
        return {"kind": self.kind, "length": self.S, "error": self.error}


def run_interleaved(jobs: list[tuple[str, Path]], S: int, reps: int, threads: int, timeout: float,
                    mem_cap_gib: float, log) -> list[dict]:
    """All kinds loaded at once in their own processes (each idle while another runs), then
    round-robin: one run of each kind per round, the order rotated every round. A slow spell of
    the shared machine then hits every kind alike, so the ratios within the run hold."""
    children = []
    for kind, path in jobs:
        log(f"{kind} at {S} tokens: loading and warm-up")
        children.append(ServingChild(kind, path, S, threads, timeout, mem_cap_gib))
        if children[-1].error:
            log(f"  -> {children[-1].error}")
    for r in range(reps):
        order = children[r % len(children):] + children[:r % len(children)]
        for child in order:
            child.run_once()
        log(f"  round {r + 1}/{reps} done")
    return [child.finish() for child in children]


def layout_input_vs_constants(model_dir: Path, S: int, reps: int, threads: int) -> None:
    """docs/export.md's decision: the layout table as a graph input (cached per padded length)
    against the same graph with the table baked in as constants for one bucket."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from longdoc.export.runtime import OnnxModel
    from longdoc.model.layout import _build_layout

    m = OnnxModel(model_dir, threads=threads)
    _build_layout.cache_clear()
    start = time.perf_counter()
    layout = m.layout_inputs(S, "block_sparse")
    t_build = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(1000):
        m.layout_inputs(S, "block_sparse")
    t_hit = (time.perf_counter() - start) / 1000
    print(f"layout for {S} tokens: built in {t_build * 1e3:.1f} ms, cache hit {t_hit * 1e6:.1f} us, "
          f"{sum(a.nbytes for a in layout.values()) / 1024:.0f} KiB fed per call")
    graph = onnx.load(str(Path(model_dir) / "encoder.onnx"))
    graph.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in layout.items())
    inputs = [i for i in graph.graph.input if i.name not in layout]
    del graph.graph.input[:]
    graph.graph.input.extend(inputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    start = time.perf_counter()
    const = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    t_load = time.perf_counter() - start
    ids = np.random.default_rng(0).integers(100, 30000, (1, S))
    feed, _ = m.encoder_feed(ids, np.ones_like(ids))
    const_feed = {k: v for k, v in feed.items() if k not in layout}
    as_input, as_const = [], []
    for _ in range(reps):
        start = time.perf_counter()
        a = m.sessions["encoder"].run(None, feed)
        as_input.append(time.perf_counter() - start)
        start = time.perf_counter()
        b = const.run(None, const_feed)
        as_const.append(time.perf_counter() - start)
    diff = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    print(f"run at {S}: input median {np.median(as_input):.3f} s {[round(t, 3) for t in as_input]}; "
          f"constants median {np.median(as_const):.3f} s {[round(t, 3) for t in as_const]}; "
          f"constants session load {t_load:.1f} s; max |diff| {diff:.1e}")


# --- machine peaks ------------------------------------------------------------------------------

def matmul_peaks(threads: int, n: int = 2048, reps: int = 10) -> dict[str, float]:
    """ONNX Runtime's own MatMul rate on this machine, the yardstick for the GFLOP/s columns:
    fp32 MatMul and dynamically quantized int8 (what ours-int8's dense layers run), (n x n) by
    (n x n) with a constant right-hand side, the best of `reps` runs (a peak: a slow spell of the
    shared machine must not lower it) -> {"fp32": GFLOP/s, "int8": GOP/s}."""
    import tempfile as tf

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "peak",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [n, n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    x = rng.standard_normal((n, n)).astype(np.float32)
    rates = {}
    with tf.TemporaryDirectory() as tmp:
        fp32, int8 = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save(model, str(fp32))
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
        for name, path in (("fp32", fp32), ("int8", int8)):
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            session.run(None, {"x": x})
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                session.run(None, {"x": x})
                times.append(time.perf_counter() - start)
            rates[name] = 2 * n ** 3 / min(times) / 1e9
    return rates


# --- report ------------------------------------------------------------------------------------

def _percent_of_peak(rate: float, kind: str, peaks: dict[str, float] | None) -> str:
    if not peaks:
        return "-"
    return f"{100 * rate / peaks['int8' if kind.startswith('ours-int8') else 'fp32']:.0f}%"


def markdown_table(results: list[dict]) -> str:
    """The results as docs/benchmarks.md shows them (a test compares the two): median wall and CPU
    seconds, peak RSS and activations (peak minus the RSS once loaded) per length and kind."""
    lines = ["| tokens | kind | wall s | CPU s | peak RSS GiB | activations GiB |", "|---:|---|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["length"], kind_order(r["kind"]))):
        if "error" not in r:
            lines.append(f"| {r['length']} | {r['kind']} | {r['median']:.2f} | {r['median_cpu']:.2f} | "
                         f"{r['peak_gib']:.2f} | {r['act_gib']:.2f} |")
    return "\n".join(lines)


def write_report(results: list[dict], out_dir: Path, header: str, threads: int,
                 peaks: dict[str, float] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_export.json").write_text(json.dumps({"peaks": peaks, "results": results}, indent=1))
    lines = [header, "",
             "wall = median wall-clock latency; cpu = median CPU seconds of the process per run (all threads): on a "
             "shared, oversubscribed machine wall time inflates with other users' load, CPU time much less. "
             "GFLOP/s (wall) = model FLOPs / wall; GFLOP/s (cpu) = model FLOPs / (cpu / threads), the rate while "
             "on the cores.", "",
             "| length | kind | wall s | cpu s | tokens/s (wall) | peak RSS GiB | act. GiB | GFLOP/s wall | GFLOP/s cpu | "
             "% of peak | runs (wall s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    if peaks:
        lines[1:1] = ["", f"Measured peaks before the run ({threads} threads, ONNX Runtime MatMul 2048^3, constant "
                      f"right-hand side, best of 10): fp32 {peaks['fp32']:.0f} GFLOP/s, dynamically quantized int8 "
                      f"{peaks['int8']:.0f} GOP/s. % of peak = GFLOP/s cpu against the fp32 peak "
                      f"(ours-int8: against the int8 peak, though its attention stays fp32; ours-int8-attn: the int8 peak)."]
    for r in sorted(results, key=lambda r: (r["length"], kind_order(r["kind"]))):
        if "error" in r:
            lines.append(f"| {r['length']} | {r['kind']} | - | - | - | - | - | - | - | - | {r['error']} |")
            continue
        flops = model_flops(r["length"], full=r["kind"] == "full-onnx")
        on_core = r["median_cpu"] / threads
        lines.append(f"| {r['length']} | {r['kind']} | {r['median']:.2f} | {r['median_cpu']:.2f} | "
                     f"{r['length'] / r['median']:.0f} | {r['peak_gib']:.2f} | {r['act_gib']:.2f} | "
                     f"{flops / r['median'] / 1e9:.0f} | {flops / on_core / 1e9:.0f} | "
                     f"{_percent_of_peak(flops / on_core / 1e9, r['kind'], peaks)} | "
                     f"{', '.join(f'{t:.2f}' for t in r['times'])} |")
    (out_dir / "bench_export.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(15, 4.2))
    for kind in sorted({r["kind"] for r in results}, key=kind_order):
        rows = sorted((r for r in results if r["kind"] == kind and "error" not in r), key=lambda r: r["length"])
        if rows:
            xs = [r["length"] for r in rows]
            ax1.plot(xs, [r["median"] for r in rows], "o-", label=kind)
            ax3.plot(xs, [r["median_cpu"] for r in rows], "o-", label=kind)
            ax2.plot(xs, [r["peak_gib"] for r in rows], "o-", label=kind)
    for ax, label in ((ax1, "median wall latency (s)"), (ax3, "median CPU time per run (s)"),
                      (ax2, "peak RSS (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    if ax1.lines:
        ax1.legend()
    fig.suptitle("BigBird-base QA, batch 1, 2 threads (CPU)")
    fig.tight_layout()
    fig.savefig(out_dir / "bench_export.png", dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-bench"),
                   help="checkpoints and exports, reused between runs (default: /tmp/longdoc-bench)")
    p.add_argument("--out", type=Path, default=ROOT / "docs",
                   help="where bench_export.md/.json/.png go (default: docs/)")
    p.add_argument("--lengths", default="1024,2048,4096",
                   help="comma-separated lengths with max_position 4096, '' for none (default: 1024,2048,4096)")
    p.add_argument("--long", action="store_true", help="also 8192 and 16384 (max_position_embeddings 16384; default: off)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated; an ours-* kind with @MODE is exported with `--sparse-gather MODE` "
                        f"({', '.join(SPARSE_GATHER)}), e.g. ours-fp32,ours-fp32@window (default: {','.join(KINDS)})")
    p.add_argument("--int8-attention", default=INT8_ATTENTION_DEFAULT, choices=INT8_ATTENTION[1:],
                   help=f"mode of ours-int8-attn (`longdoc export --int8-attention`; default: {INT8_ATTENTION_DEFAULT})")
    p.add_argument("--reps", type=int, default=3, help="timed runs at <= 4096 tokens, after one warm-up (default: 3)")
    p.add_argument("--long-reps", type=int, default=1, help="timed runs at 8192/16384 (after one warm-up; default: 1)")
    p.add_argument("--threads", type=int, default=2, help="threads of every kind (default: 2)")
    p.add_argument("--timeout", type=float, default=900, help="seconds any one child may wait (default: 900)")
    p.add_argument("--dense-max", type=int, default=8192,
                   help="longest length for full-onnx and hf-torch: both hold a dense (H, S, S) fp32 "
                        "attention tensor (transformers 5.x does even on the block-sparse path), 12.9 GB at 16384 (default: 8192)")
    p.add_argument("--mem-cap-gib", type=float, default=0,
                   help="address-space limit of each measuring process (0 = none): a model that needs more "
                        "fails with an allocation error instead of exhausting the machine's memory (default: 0)")
    p.add_argument("--layout-check", type=int, metavar="LENGTH",
                   help="only compare layout-as-input with layout-as-constants at LENGTH (ours-fp32; default: off)")
    p.add_argument("--interleave", action="store_true",
                   help="at each length, load every kind at once (one process each) and alternate their runs "
                        "round-robin, so that the machine's drifts in speed hit all kinds alike (default: off)")
    p.add_argument("--no-peaks", action="store_true",
                   help="skip measuring ONNX Runtime's fp32/int8 MatMul peaks before the run (the %% of peak column; default: measured)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.path, args.length, args.reps, args.threads, args.mem_cap_gib)))
        return 0
    if args.serve:
        serve(args.serve, args.path, args.length, args.threads, args.mem_cap_gib)
        return 0

    def log(msg):
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    kinds = args.kinds.split(",")
    for kind in kinds:
        try:
            split_kind(kind)
        except ValueError as exc:
            p.error(str(exc))
    args.work.mkdir(parents=True, exist_ok=True)
    if args.layout_check:
        paths = prepare(args.work, 4096, log, ["ours-fp32"])
        layout_input_vs_constants(paths["ours-fp32"], args.layout_check, args.reps, args.threads)
        return 0
    plans = [(4096, [int(x) for x in args.lengths.split(",")])] if args.lengths else []
    if args.long:
        plans.append((16384, [8192, 16384]))
    results = []
    header = (f"BigBird-base QA (random init), batch 1, {args.threads} threads, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"`{' '.join(['.venv/bin/python', 'bench/bench_export.py'] + sys.argv[1:])}`")
    peaks = None
    if not args.no_peaks:
        peaks = matmul_peaks(args.threads)
        log(f"peaks: fp32 MatMul {peaks['fp32']:.0f} GFLOP/s, int8 {peaks['int8']:.0f} GOP/s ({args.threads} threads)")
    for max_position, lengths in plans:
        paths = prepare(args.work, max_position, log, kinds, args.int8_attention)
        if "hf-traced" in kinds and max_position == 4096:
            paths["hf-traced"] = trace_export(paths["ckpt"], args.work / "hf-traced", TRACED_LENGTH, log)
        for S in lengths:
            jobs = []
            for kind in kinds:
                if kind in ("full-onnx", "hf-torch") and S > args.dense_max:
                    results.append({"kind": kind, "length": S, "error": f"not run (> --dense-max {args.dense_max}: "
                                    f"a dense 12 x S^2 fp32 attention tensor is {12 * 4 * S * S / 2**30:.1f} GiB)"})
                    continue
                if kind == "hf-traced" and max_position != 4096:
                    continue
                jobs.append((kind, paths["ckpt"] if kind == "hf-torch" else paths[kind]))
            reps = args.reps if S <= 4096 else args.long_reps
            if args.interleave:
                # the traced graph fails at any length but its own: one try is enough
                traced_elsewhere = [j for j in jobs if j[0] == "hf-traced" and S != TRACED_LENGTH]
                for kind, path in traced_elsewhere:
                    results.append(run_child(kind, path, S, 1, args.threads, args.timeout, args.mem_cap_gib))
                results += run_interleaved([j for j in jobs if j not in traced_elsewhere], S, reps, args.threads,
                                           args.timeout, args.mem_cap_gib, log)
                write_report(results, args.out, header, args.threads, peaks)
                continue
            for kind, path in jobs:
                n = 1 if kind == "hf-traced" and S != TRACED_LENGTH else reps
                log(f"{kind} at {S} tokens ({n} runs)")
                r = run_child(kind, path, S, n, args.threads, args.timeout, args.mem_cap_gib)
                log(f"  -> {r.get('median', r.get('error'))}")
                results.append(r)
                write_report(results, args.out, header, args.threads, peaks)
    write_report(results, args.out, header, args.threads, peaks)
    log(f"wrote {args.out / 'bench_export.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
