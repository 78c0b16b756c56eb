"""Two exports of one checkpoint, interleaved: which graph is faster, and do they agree? A script.

Loads each model directory once (the serving options: export/runtime.py `OnnxModel`, --threads
intra-op threads) in this one process, then runs the same encoder input (batch --batch, --length
tokens, seeded random ids, the last row's final quarter padded when --batch > 1) through A and B
alternately, one warm-up each, --rounds timed rounds (A, B, B, A, A, B, ...: neither side always
goes first). Prints each round, the medians, B / A, and the largest absolute difference of every
output; writes them as JSON with --json.

    .venv/bin/python bench/graph_ab.py /tmp/ab/old-int8 /tmp/ab/new-int8 --length 4096 --json docs/results/ab.json

Used for graph changes that must be exact and should be faster (docs/export.md, "The key bias in
the products").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from common import command_line, cpu_name, loadavg, log


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="model directory A (the baseline)")
    p.add_argument("b", type=Path, help="model directory B (the change)")
    p.add_argument("--length", type=int, default=4096, help="tokens per row (default: 4096)")
    p.add_argument("--batch", type=int, default=1, help="rows (default: 1)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each (default: 5)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default: 2)")
    p.add_argument("--json", type=Path, default=None, help="write the results here (default: none)")
    a = p.parse_args(argv)
    from longdoc.export.runtime import OnnxModel

    models = {"a": OnnxModel(a.a, threads=a.threads), "b": OnnxModel(a.b, threads=a.threads)}
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 300, (a.batch, a.length))
    mask = np.ones_like(ids)
    if a.batch > 1:
        mask[-1, a.length - a.length // 4:] = 0
    outputs = {k: m.run_encoder(ids, mask) for k, m in models.items()}  # warm-up
    diff = {name: float(np.abs(np.asarray(outputs["a"][name], np.float64)
                               - np.asarray(outputs["b"][name], np.float64)).max()) for name in outputs["a"]}
    times: dict[str, list[float]] = {"a": [], "b": []}
    load_before = loadavg()
    for r in range(a.rounds):
        for k in ("a", "b") if r % 2 == 0 else ("b", "a"):
            t0 = time.perf_counter()
            models[k].run_encoder(ids, mask)
            times[k].append(time.perf_counter() - t0)
        log(f"round {r + 1}/{a.rounds}: A {times['a'][-1]:.3f} s, B {times['b'][-1]:.3f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    results = {
        "command": command_line("graph_ab.py", argv),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpu": cpu_name(), "cpus": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": loadavg(),
        "a": str(a.a), "b": str(a.b), "length": a.length, "batch": a.batch, "threads": a.threads,
        "seconds": times, "median_s": med, "b_over_a": med["b"] / med["a"], "max_abs_diff": diff}
    print(f"A {a.a}: median {med['a']:.3f} s; B {a.b}: median {med['b']:.3f} s; B / A = {med['b'] / med['a']:.3f}")
    print("max |A - B| per output: " + ", ".join(f"{n} {d:.1e}" for n, d in diff.items()))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
