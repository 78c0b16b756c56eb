"""Train the default QA model (models/qa) on CPU: MiniLM warm-started to BigBird 4096, fine-tuned
on man-page QA windows. The exact commands used for the shipped model (models/qa/MODEL_CARD.md):

    .venv/bin/python -m data.build_manpages
    for n in 768 384; do .venv/bin/python -m data.qa_windows data/cache/manpages/qa_train.jsonl \
        data/cache/manpages/qa_train_w$n.jsonl --max-length $n $([ $n = 384 ] && echo --seed 1); done
    # phase 1: 768-token windows, block-sparse (32 min wall here)
    .venv/bin/python -m data.train_default_qa --max-steps 90
    # phase 2: 384-token windows (full attention: below the 704 threshold), 2x the examples a step
    .venv/bin/python -m data.train_default_qa --init data/cache/runs/qa --seed 1 \
        --train data/cache/manpages/qa_train_w384.jsonl --max-length 384 --batch-size 8 \
        --output data/cache/runs/qa2 --max-steps 90
    # phase 3: back to 768-token block-sparse windows (distractor-rich, like long pages)
    .venv/bin/python -m data.train_default_qa --init data/cache/runs/qa2 --seed 2 \
        --output data/cache/runs/qa3 --max-steps 60
    # (a phase 4 like phase 3, --init data/cache/runs/qa3 --seed 3 --output data/cache/runs/qa4
    #  --max-steps 60, was stopped at step 26; its checkpoint-15 is the start of phase 5)
    # phase 5: 768-token windows plus same-window questions of other terms (--siblings)
    .venv/bin/python -m data.train_default_qa --init data/cache/runs/qa4/checkpoint-15 --seed 4 \
        --siblings 2 --train data/cache/manpages/qa_train_w768s.jsonl \
        --output data/cache/runs/qa5 --max-steps 250 --threads 1
    .venv/bin/python -m data.ship_model data/cache/runs/qa5 models/qa --task qa --dtype int8

Time box: the machine has 2 CPU cores shared with other jobs (60-350 training tokens/s
measured), so training windows are short: 768 tokens is 12 blocks of 64, above the
(5 + 2*3) * 64 = 704 full-attention threshold, so those steps run block-sparse attention; 384
tokens runs full attention and fits twice the questions in a step. Positions beyond 768 are
never trained, but the warm start tiles the 512 MiniLM rows (row i = row i mod 512), so every
position row the model meets at 4096 has been trained. 1,320 windows were seen in all
(each phase draws its own order), i.e. less than half an epoch of the 3,217 training questions.
"""


from __future__ import annotations

import argparse
from pathlib import Path

CHECKPOINT = "data/cache/minilm-bigbird-4096"


def write_sibling_windows(output: str, max_length: int, siblings: int, seed: int,
                          source: str = "data/cache/manpages/qa_train.jsonl") -> str:
    """Like data/qa_windows.py (one window per question that holds its answer), plus, for each
    window, up to `siblings` records of other questions of the same page whose whole answer lies in
    that window: identical text, different question and answer. The model cannot get those right
    without reading the question (the shipped phases 1-3 answered several questions of one page
    with the same sentence)."""
    import itertools
    import json
    import random

    from data.build_manpages import load_tokenizer
    from data.qa_windows import records_by_page, window_record

    tokenizer, rng, cache = load_tokenizer(), random.Random(seed), {}
    primary = extra = 0
    with open(output, "w") as f:
        for _page, group in itertools.groupby(records_by_page(Path(source)), key=lambda r: r["page"]):
            records = list(group)  # one page's questions at a time
            for record in records:
                window = window_record(record, tokenizer, max_length, rng, cache)
                if window is None:
                    continue
                f.write(json.dumps(window) + "\n")
                primary += 1
                lo, hi = window["window_chars"]
                inside = [r for r in records if r is not record and r["answers"][0]["start"] >= lo
                          and r["answers"][0]["start"] + len(r["answers"][0]["text"]) <= hi]
                for other in rng.sample(inside, min(siblings, len(inside))):
                    answer = other["answers"][0]
                    out = dict(other, context=window["context"], window_chars=[lo, hi],
                               answers=[{"text": answer["text"], "start": answer["start"] - lo}])
                    assert out["context"][answer["start"] - lo:].startswith(answer["text"])
                    f.write(json.dumps(out) + "\n")
                    extra += 1
    return f"{output}: {primary} windows + {extra} same-window questions of other terms"


def training_options(parser: argparse.ArgumentParser, train: str, output: str, batch_size: int, max_steps: int,
                     seed_help: str = "random seed (data order)") -> None:
    """The options every default model's training script takes, with its own defaults."""
    parser.add_argument("--train", default=train, help="training records (JSON lines) (default: %(default)s)")
    parser.add_argument("--output", default=output, help="run directory (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=768,
                        help="tokens per training example (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="examples per step (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=max_steps, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help=f"{seed_help} (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    training_options(parser, "data/cache/manpages/qa_train_w768.jsonl", "data/cache/runs/qa", batch_size=4,
                     max_steps=90, seed_help="data order (use a new one when continuing)")
    parser.add_argument("--init",
                        help="continue from this QA checkpoint instead of the MiniLM warm start (default: none)")
    parser.add_argument("--siblings", type=int, default=0,
                        help="write --train first from qa_train.jsonl: each answer's window plus up to N other "
                             "questions of the same page whose answers lie in that window (same text, other question)"
                             " (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.siblings:
        # from the whole-page questions beside the windows file (data/cache/manpages/qa_train.jsonl for
        # the shipped recipe, data/cache/manpages-broad/... for the broad corpus)
        print(write_sibling_windows(args.train, args.max_length, args.siblings, args.seed,
                                    source=str(Path(args.train).with_name("qa_train.jsonl"))))

    import torch

    from data.build_manpages import minilm_dir
    from longdoc.model.warmstart import warm_start

    torch.set_num_threads(args.threads)
    if args.init is None:
        warm_start(minilm_dir(), CHECKPOINT, 4096, block_size=64, num_random_blocks=3)
    return run_time_boxed("qa", args.init or CHECKPOINT, args, save_every=15)


def run_time_boxed(task: str, model: str, args, save_every: int) -> int:
    """`longdoc train` with the settings every default-model script uses (CPU, log each step, keep
    2 checkpoints); `args` carries train, output, max_length, batch_size, max_steps, lr, seed."""
    from longdoc.model.train import TrainConfig, train

    cfg = TrainConfig(task=task, model=model, train=args.train, output=args.output,
                      max_length=args.max_length, batch_size=args.batch_size, max_steps=args.max_steps,
                      lr=args.lr, warmup_ratio=0.1, log_every=1, save_every=save_every, eval_every=0,
                      keep_checkpoints=2, device="cpu", seed=args.seed)
    result = train(cfg)
    print(f"final loss {result.train_loss:.4f} at step {result.step}: {result.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
