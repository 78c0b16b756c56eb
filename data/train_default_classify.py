"""Train the default section classifier (models/classify) on CPU: MiniLM warm-started to BigBird
4096 (as models/qa), fine-tuned to tell a man page's manual section ("1".."8") from its text.

    .venv/bin/python -m data.build_manpages                      # data/cache/manpages/classify_*.jsonl
    .venv/bin/python -m data.train_default_classify              # warm start + longdoc train
    .venv/bin/python -m data.ship_model data/cache/runs/classify models/classify --task classify --dtype int8
    .venv/bin/longdoc eval models/classify --data data/cache/manpages/classify_test.jsonl --threads 2

The input is the page without its NAME section, as data/build_manpages.py writes it (the running
header, which names the section, is dropped there too). Pages are cut to the first
--max-length word pieces for training (768 = 12 blocks of 64: block-sparse, above the 704-token
full-attention threshold); served documents up to 4096 tokens are classified whole, longer ones
by the mean of their windows' logits (export/windows.py).
"""

from __future__ import annotations

import argparse

from data.train_default_qa import CHECKPOINT, run_time_boxed, training_options  # the same MiniLM warm start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    training_options(parser, "data/cache/manpages/classify_train.jsonl", "data/cache/runs/classify", batch_size=8,
                     max_steps=100)
    args = parser.parse_args(argv)

    import torch

    from data.build_manpages import minilm_dir
    from longdoc.model.warmstart import warm_start

    torch.set_num_threads(args.threads)
    warm_start(minilm_dir(), CHECKPOINT, 4096, block_size=64, num_random_blocks=3)
    return run_time_boxed("classify", CHECKPOINT, args, save_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
