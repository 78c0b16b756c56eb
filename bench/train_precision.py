"""Training step time on this CPU: fp32 against bf16 autocast (`longdoc train --precision bf16`),
interleaved. A script, not a test: it answers "is bf16 faster here?" before a long CPU run.

The default summarizer's recipe (data/train_default_summarize.py): the BERT2BERT MiniLM init,
real man pages, `--max-length` encoder tokens, batches of `--batch-size`. Each round runs
`--steps` optimizer steps (forward, backward, AdamW) in fp32, then as many in bf16, on the same
batches; the table gives the median seconds per step over all rounds.

    .venv/bin/python bench/train_precision.py --rounds 3

(the init is built first if it is missing: data.train_default_summarize.build_init_b2b).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from longdoc.model.train_config import add_train_arguments, config_from_args

    # the TrainConfig fields this benchmark takes (help texts: model/train_config.py), with its defaults
    add_train_arguments(p, only=("model", "train", "max_length", "batch_size"),
                        defaults={"model": "data/cache/summarize-b2b-init",
                                  "train": "data/cache/manpages-broad/summarize_train.jsonl",
                                  "max_length": 768, "batch_size": 8})
    p.add_argument("--steps", type=int, default=3, help="timed steps per precision per round (default: 3)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    a = p.parse_args()

    import torch

    from longdoc.model import data as D
    from longdoc.model.train import Trainer, task_loss

    torch.set_num_threads(a.threads)
    if not (Path(a.model) / "config.json").is_file():
        # data/ is the repository's folder, not installed: import it from the repository root
        subprocess.run([sys.executable, "-c", "import sys; from data.train_default_summarize import build_init_b2b; "
                        "build_init_b2b(sys.argv[1])", str(Path(a.model).resolve())], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(config_from_args(a, task="summarize", output=out, max_target_length=48, max_steps=1,
                                           device="cpu", quiet=True))
    lengths = [len(f["input_ids"]) for f in trainer.train_features]
    order = D.length_grouped_batches(lengths, a.batch_size, 0, 0)
    batches = [trainer._collate([trainer.train_features[i] for i in order[j]]) for j in range(a.steps)]
    tokens = [D.num_tokens(b) for b in batches]
    model, optimizer = trainer.model.train(), torch.optim.AdamW(trainer.model.parameters(), lr=1e-5)
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}

    def step(batch, precision: str) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = task_loss("summarize", model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0], "fp32")  # warm-up, both paths
    step(batches[0], "bf16")
    for r in range(a.rounds):
        for precision in times:
            for batch in batches:
                t0 = time.perf_counter()
                step(batch, precision)
                times[precision].append(time.perf_counter() - t0)
            print(f"round {r + 1} {precision}: {statistics.median(times[precision][-a.steps:]):.2f} s/step",
                  file=sys.stderr, flush=True)
    per_step = sum(tokens) / len(tokens)
    fp32 = statistics.median(times["fp32"])
    print(f"summarize training step, {Path(a.model).name}, batch {a.batch_size} x <= {a.max_length} tokens "
          f"({per_step:,.0f} tokens/step), {a.threads} threads, {a.rounds} interleaved rounds of {a.steps} steps")
    print("| precision | median s/step | tokens/s | vs fp32 |")
    print("|---|---:|---:|---:|")
    for precision, ts in times.items():
        t = statistics.median(ts)
        print(f"| {precision} | {t:.2f} | {per_step / t:,.0f} | {fp32 / t:.2f}x |")


if __name__ == "__main__":
    main()
