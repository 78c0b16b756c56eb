"""Latency and peak memory: our PyTorch BigBird vs transformers, same random-init weights.

    .venv/bin/python bench/bench_model.py                       # BigBird-base shape, 1024/2048/4096
    .venv/bin/python bench/bench_model.py --lengths 1024 --repeats 2 --layers 2   # a quick look

BigBird-base shape (12 layers, hidden 768, 12 heads, block 64, 3 random blocks, block_sparse),
batch 1, `torch.set_num_threads(--threads)` (2 by default), inference mode, eval mode for both
(our plan "hf-eval" = the same random blocks as transformers in eval mode, so the outputs are
compared too).

Latency: one fresh subprocess per length holds both models and alternates them (transformers,
ours, ours, transformers, ...) after a warm-up each, so load changes on a shared machine hit both
alike; the median of `--repeats` forwards each is reported.

Peak memory: one fresh subprocess per (implementation, length). After loading (and reading every
weight once, so lazily mapped weights are resident before the forward), freed heap is
returned to the OS (`malloc_trim`), the resident size is read (`VmRSS`), the peak resident size is
reset (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), one forward runs, and the peak is read
back (`VmHWM`). "Peak activation memory" = peak - resident before: everything the forward
allocated at its high point (tracemalloc would miss torch's allocations).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("transformers", "ours")


def base_config(layers: int) -> dict:
    return dict(
        vocab_size=50358, hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
        intermediate_size=3072, hidden_act="gelu_new", max_position_embeddings=4096, block_size=64,
        num_random_blocks=3, attention_type="block_sparse",
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _load(impl: str, checkpoint: str):
    if impl == "transformers":
        from transformers import BigBirdModel

        return BigBirdModel.from_pretrained(checkpoint).eval()
    from longdoc.model.checkpoint import load_pretrained

    return load_pretrained(checkpoint, plan="hf-eval", architecture="BigBirdModel")


def _forward(impl: str, model, input_ids):
    import torch

    with torch.inference_mode():
        if impl == "transformers":
            return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state
        return model(input_ids, torch.ones_like(input_ids)).last_hidden_state


def _inputs(length: int):
    import torch

    return torch.randint(5, 50000, (1, length), generator=torch.Generator().manual_seed(length))


def measure_latency(checkpoint: str, length: int, repeats: int, threads: int) -> dict:
    """Child: both models, alternating forwards."""
    import torch

    torch.set_num_threads(threads)
    models = {impl: _load(impl, checkpoint) for impl in IMPLS}
    input_ids = _inputs(length)
    outs = {impl: _forward(impl, models[impl], input_ids) for impl in IMPLS}  # warm-up
    max_abs_diff = float((outs["transformers"] - outs["ours"]).abs().max())
    times = {impl: [] for impl in IMPLS}
    for r in range(repeats):
        for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
            t0 = time.perf_counter()
            _forward(impl, models[impl], input_ids)
            times[impl].append(time.perf_counter() - t0)
    return {"length": length, "threads": threads, "times_s": times,
            "median_s": {impl: statistics.median(t) for impl, t in times.items()}, "max_abs_diff": max_abs_diff}


def measure_memory(impl: str, checkpoint: str, length: int, threads: int) -> dict:
    """Child: one model, one forward, peak resident memory above the loaded state."""
    import torch

    torch.set_num_threads(threads)
    model = _load(impl, checkpoint)
    input_ids = _inputs(length)
    # page every weight in (a loader may map the file lazily), so the peak counts activations only
    with torch.inference_mode():
        sum(float(t.abs().sum()) for t in model.state_dict().values() if t.is_floating_point())
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    _forward(impl, model, input_ids)
    peak = _status_kib("VmHWM")
    return {"impl": impl, "length": length, "rss_before_mib": rss_before / 1024, "peak_rss_mib": peak / 1024,
            "peak_activation_mib": (peak - rss_before) / 1024}


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if proc.returncode:
        sys.exit(f"{args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                   help="input lengths in tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed forwards per measurement (after 1 warm-up) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    p.add_argument("--layers", type=int, default=12,
                   help="encoder layers of the BigBird-base shape (default: %(default)s)")
    p.add_argument("--json", type=Path, help="also write the results here (default: none)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        kind, *rest = args.child
        if kind == "latency":
            checkpoint, length = rest
            result = measure_latency(checkpoint, int(length), args.repeats, args.threads)
        else:
            impl, checkpoint, length = rest
            result = measure_memory(impl, checkpoint, int(length), args.threads)
        print(json.dumps(result))
        return

    import torch
    from transformers import BigBirdConfig, BigBirdModel

    latency, memory = {}, {}
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads)]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        BigBirdModel(BigBirdConfig(**base_config(args.layers))).save_pretrained(tmp)
        for length in args.lengths:
            r = latency[length] = _child(["latency", tmp, str(length), *common])
            print(f"{length:>5} latency: " + "  ".join(
                f"{impl} median {r['median_s'][impl]:.2f} s {[round(t, 2) for t in r['times_s'][impl]]}" for impl in IMPLS)
                + f"  max |diff| {r['max_abs_diff']:.1e}", flush=True)
            for impl in IMPLS:
                m = memory[impl, length] = _child(["memory", impl, tmp, str(length), *common])
                print(f"{length:>5} memory: {impl} peak activation {m['peak_activation_mib']:.0f} MiB "
                      f"(resident before {m['rss_before_mib']:.0f} MiB, peak {m['peak_rss_mib']:.0f} MiB)", flush=True)

    print(f"\nthreads={args.threads}, layers={args.layers}, repeats={args.repeats}, batch 1\n")
    print("| length | transformers median (s) | ours median (s) | speed-up | transformers peak act. (MiB) "
          "| ours peak act. (MiB) | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        t, o = latency[length]["median_s"]["transformers"], latency[length]["median_s"]["ours"]
        mt, mo = memory["transformers", length], memory["ours", length]
        print(f"| {length} | {t:.2f} | {o:.2f} | {t / o:.2f}x | {mt['peak_activation_mib']:.0f} "
              f"| {mo['peak_activation_mib']:.0f} | {latency[length]['max_abs_diff']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps({"latency": latency, "memory": [memory[k] for k in memory]}, indent=2))


if __name__ == "__main__":
    main()
