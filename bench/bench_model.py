"""Latency and peak memory: our PyTorch BigBird vs transformers, same random-init weights.

    .venv/bin/python bench/bench_model.py                       # BigBird-base shape, 1024/2048/4096
    .venv/bin/python bench/bench_model.py --lengths 1024 --repeats 2 --layers 2   # a quick look

BigBird-base shape (12 layers, hidden 768, 12 heads, block 64, 3 random blocks, block_sparse),
batch 1, `torch.set_num_threads(--threads)` (2 by default), inference mode, eval mode for both
(our plan "hf-eval" = the same random blocks as transformers in eval mode).

Every (implementation, length) runs in a fresh subprocess, so one measurement cannot inherit the
other's allocator state or peak. Memory: after loading and one warm-up forward, the process's
peak resident set size is reset (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0) and read back
(`VmHWM` in /proc/self/status) after the timed forwards; "peak activation memory" is that peak
minus the resident size just before (weights and everything else already there). tracemalloc
would miss torch's allocations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def measure(impl: str, checkpoint: str, length: int, repeats: int, threads: int) -> dict:
    """Runs in the child process."""
    import torch

    torch.set_num_threads(threads)
    if impl == "transformers":
        from transformers import BigBirdModel

        model = BigBirdModel.from_pretrained(checkpoint).eval()
    else:
        from model.checkpoint import load_pretrained

        model = load_pretrained(checkpoint, plan="hf-eval", architecture="BigBirdModel")
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 50000, (1, length), generator=g)
    attention_mask = torch.ones_like(input_ids)

    def run():
        with torch.inference_mode():
            if impl == "transformers":
                return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return model(input_ids, attention_mask).last_hidden_state

    out = run()  # warm-up (layout building, allocator)
    checksum = float(out.double().abs().mean())
    Path("/proc/self/clear_refs").write_text("5")
    rss_before = _status_kib("VmRSS")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM")
    return {
        "impl": impl, "length": length, "threads": threads, "times_s": times,
        "median_s": statistics.median(times), "rss_before_mib": rss_before / 1024,
        "peak_rss_mib": peak / 1024, "peak_activation_mib": (peak - rss_before) / 1024,
        "checksum": checksum,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per measurement (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--impls", nargs="+", default=["transformers", "ours"], choices=["transformers", "ours"])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "CHECKPOINT", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        impl, checkpoint, length = args.child
        print(json.dumps(measure(impl, checkpoint, int(length), args.repeats, args.threads)))
        return

    import torch
    from transformers import BigBirdConfig, BigBirdModel

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        BigBirdModel(BigBirdConfig(**base_config(args.layers))).save_pretrained(tmp)
        for length in args.lengths:
            for impl in args.impls:
                cmd = [sys.executable, __file__, "--child", impl, tmp, str(length),
                       "--repeats", str(args.repeats), "--threads", str(args.threads)]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                      env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
                if proc.returncode:
                    sys.exit(f"{impl} @ {length} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                results.append(r)
                print(f"{impl:>12} {length:>5}: median {r['median_s']:.2f} s  runs {[round(t, 2) for t in r['times_s']]}"
                      f"  peak activation {r['peak_activation_mib']:.0f} MiB  (peak RSS {r['peak_rss_mib']:.0f} MiB)",
                      flush=True)

    print(f"\n| length | transformers median (s) | ours median (s) | speed-up | transformers peak act. (MiB) | ours peak act. (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    by = {(r["impl"], r["length"]): r for r in results}
    for length in args.lengths:
        t, o = by.get(("transformers", length)), by.get(("ours", length))
        if t and o:
            print(f"| {length} | {t['median_s']:.2f} | {o['median_s']:.2f} | {t['median_s'] / o['median_s']:.2f}x "
                  f"| {t['peak_activation_mib']:.0f} | {o['peak_activation_mib']:.0f} |")
            if abs(t["checksum"] - o["checksum"]) > 1e-4 * abs(t["checksum"]):
                print(f"  WARNING: outputs differ at {length}: {t['checksum']} vs {o['checksum']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
