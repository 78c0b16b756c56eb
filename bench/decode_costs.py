"""Where a summary's time goes in the decode worker (issue 24, item 1), measured in one process
with the variants interleaved, so that the shared machine's drift falls on both sides alike:

    encode      newcomers encoded as one batch of --group documents, against one at a time (the
                worker's CPU budget, `max_batch_tokens` 1024, since budget_groups): ms per document
    join        a newcomer joining a running batch of --batch - 1 sequences: the slot write (its
                own row) against one copy of the whole batch (what a join cost before the slot
                buffers: the batch concatenated anew), both through `Regroup.take` on the device
    step        one decoder step at batch 1 and at --batch (all rows at the maximum length)

On bench/decode_concurrency.py's model (its --work folder, made there). Prints a table, writes
--json.

    .venv/bin/python bench/decode_costs.py --work /tmp/decode-bench2 --json docs/decode/costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import command_line, log, time_it


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-decode-bench"),
                   help="bench/decode_concurrency.py's --work folder (default: /tmp/longdoc-decode-bench)")
    p.add_argument("--tokens", type=int, default=4096, help="encoder tokens per document (default: 4096)")
    p.add_argument("--group", type=int, default=4, help="newcomers encoded together (default: 4)")
    p.add_argument("--batch", type=int, default=8, help="decode batch size (default: 8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each measurement (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: its own choice)")
    p.add_argument("--json", type=Path, default=None, help="results file (default: none)")
    a = p.parse_args()

    from decode_concurrency import make_model

    from longdoc.service.workers import OnnxWorker

    model_dir = make_model(a.work)
    worker = OnnxWorker("bench", model_dir, "cpu", threads=a.threads)
    dec = worker.decoder
    doc = [7 + i % 500 for i in range(a.tokens)]
    start = worker.info.special_tokens["decoder_start"]
    log("warm-up")
    worker.begin([doc])

    def encode(budget: int) -> float:
        worker.max_batch_tokens = budget
        return time_it(lambda: worker.begin([doc] * a.group), 1, warmups=0) / a.group

    one_batch, one_at_a_time = [], []
    for r in range(a.rounds):
        log(f"encode, round {r + 1}")
        one_batch.append(encode(1 << 30))
        one_at_a_time.append(encode(1024))

    log("a running batch")
    worker.max_batch_tokens = 1024
    states = worker.begin([doc] * a.batch)
    worker.step(states, [start] * a.batch)  # the batch's slot buffers, all rows written
    b = dec._batch
    buffers = dec.regroup.allocate(list(b.cross[0].shape()), len(dec.kv))
    rows = list(range(a.batch))
    write_one = lambda: dec.regroup.take(b.cross, [0], 2, 0, b.Se, into=(buffers, a.batch - 1))  # noqa: E731
    copy_all = lambda: dec.regroup.take(b.cross, rows, 2, 0, b.Se, into=(buffers, 0))  # noqa: E731
    joins_one, joins_all, steps_full = [], [], []
    for r in range(a.rounds):
        log(f"join and step, round {r + 1}")
        joins_one.append(time_it(write_one, 3, warmups=0))
        joins_all.append(time_it(copy_all, 3, warmups=0))
        steps_full.append(time_it(lambda: worker.step(states, [start] * a.batch), 3, warmups=0))
    worker.release()
    alone = worker.begin([doc])
    worker.step(alone, [start])
    steps_one = [time_it(lambda: worker.step(alone, [start]), 3, warmups=0) for _ in range(a.rounds)]
    worker.release()

    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    result = {
        "command": command_line("decode_costs.py"), "tokens": a.tokens, "group": a.group, "batch": a.batch,
        "encode_ms_per_doc": {"one_batch": ms(one_batch), "one_at_a_time": ms(one_at_a_time)},
        "join_ms": {"copy_whole_batch": ms(joins_all), "write_newcomer_row": ms(joins_one)},
        "step_ms": {"batch_1": ms(steps_one), f"batch_{a.batch}": ms(steps_full)},
        "rounds": {"encode_one_batch": one_batch, "encode_one_at_a_time": one_at_a_time, "join_copy_all": joins_all,
                   "join_write_one": joins_one, "step_full": steps_full, "step_one": steps_one},
    }
    print("| measurement | ms |")
    print("|---|---:|")
    print(f"| encode, {a.group} documents in one batch, per document | {ms(one_batch):.0f} |")
    print(f"| encode, one at a time, per document | {ms(one_at_a_time):.0f} |")
    print(f"| join: one copy of the whole batch of {a.batch} | {ms(joins_all):.1f} |")
    print(f"| join: the newcomer's row | {ms(joins_one):.1f} |")
    print(f"| decoder step, batch 1 | {ms(steps_one):.1f} |")
    print(f"| decoder step, batch {a.batch} | {ms(steps_full):.1f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
