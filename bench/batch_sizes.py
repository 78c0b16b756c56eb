"""Offline encoder throughput by batch size and sequence length (longdoc.export.runtime.OnnxModel, no
HTTP), interleaved: for each length, several rounds over the batch sizes (alternating order), each
timing about the same number of tokens; prints the best and the median sequences/s per size.
This is the measurement behind the CPU default of `max_batch_tokens` (docs/service.md, "CPU
batching defaults"). Random token ids (the numbers do not depend on them).

    python bench/batch_sizes.py MODEL_DIR --lengths 128,256,512,1024 --batches 1,2,4,8 --rounds 9
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--lengths", default="128,256,512,1024",
                    help="document tokens (+7 for a QA question and specials), comma-separated (default: %(default)s)")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=9,
                    help="rounds over the batch sizes per length (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of the model (default: %(default)s)")
    args = ap.parse_args()
    from longdoc.export.runtime import OnnxModel

    m = OnnxModel(args.model_dir, threads=args.threads)
    vocab = m.tokenizer.get_vocab_size()
    batches = [int(x) for x in args.batches.split(",")]
    rng = np.random.default_rng(0)
    for n in [int(x) for x in args.lengths.split(",")]:
        S = n + 7
        feeds = {b: (rng.integers(10, vocab, (b, S)), np.ones((b, S), np.int64)) for b in batches}
        for b in batches:
            m.run_encoder(*feeds[b])  # warm: layouts and ORT buffers
        res: dict[int, list[float]] = {b: [] for b in batches}
        for r in range(args.rounds):
            for b in batches if r % 2 == 0 else batches[::-1]:
                k = max(1, round(2048 / (S * b)))
                t = time.perf_counter()
                for _ in range(k):
                    m.run_encoder(*feeds[b])
                res[b].append(k * b / (time.perf_counter() - t))
        line = "  ".join(f"b{b}: best {max(v):6.1f} med {np.median(v):6.1f}" for b, v in res.items())
        print(f"len {n} (+7): {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
