"""Greedy decoder steps as the service runs them (`DeviceDecoder.step_greedy`), one worker per
way of running a step (`decoder_steps`: dynamic, fixed, captured), measured in one process with
the ways interleaved round by round, so that the machine's drift falls on all alike:

    per round and way: --batch documents of --tokens encoder tokens are encoded, then --steps
    greedy steps run from the start token (the cache grows as in a summary); the first step
    (the batch's assembly) is left out, the median of the others is the round's figure; a way
    against the first: the median over rounds of the two figures' ratio in one round

Batch 1 and --batch. On bench/decode_concurrency.py's model (its --work folder, made there;
torch and transformers needed once) or any summarize export (--model-dir). Prints a table,
writes --json.

    .venv/bin/python bench/decode_steps.py --work /tmp/decode-bench2 --json docs/decode/steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import command_line, cpu_name, log


def round_ratio(result: dict, way: str, batch: str) -> float:
    """A way's step time against the first way's, the median over rounds of the two measured in one
    round (one after the other), so that the machine's drift between rounds cancels."""
    base = result["rounds"][next(iter(result["rounds"]))][batch]
    return statistics.median(t / b for t, b in zip(result["rounds"][way][batch], base))


def markdown_table(result: dict) -> str:
    """The page's table (docs/benchmarks.md, "Fixed-shape decoder steps") of a results file."""
    batch = f"batch_{result['batch']}"
    ways = list(result["step_ms"])
    lines = [f"| decoder steps | batch 1, ms a step | batch {result['batch']}, ms a step | against {ways[0]} |",
             "|---|---:|---:|---:|"]
    for w, ms in result["step_ms"].items():
        lines.append(f"| {w} | {ms['batch_1']:.1f} | {ms[batch]:.1f} | "
                     f"{round_ratio(result, w, 'batch_1'):.2f}x, {round_ratio(result, w, batch):.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-decode-bench"),
                   help="bench/decode_concurrency.py's --work folder (default: /tmp/longdoc-decode-bench)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a summarize export to measure instead of --work's model (default: none)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--ways", default=None,
                   help="comma-separated decoder_steps to compare (default: dynamic,fixed on cpu, "
                        "dynamic,fixed,captured on cuda)")
    p.add_argument("--tokens", type=int, default=4096, help="encoder tokens per document (default: 4096)")
    p.add_argument("--batch", type=int, default=8, help="the larger decode batch (default: 8)")
    p.add_argument("--steps", type=int, default=32, help="greedy steps per round (default: 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: its own choice)")
    p.add_argument("--json", type=Path, default=None, help="results file (default: none)")
    a = p.parse_args()

    from longdoc.model.search import StepConstraints
    from longdoc.service.workers import CudaWorker, OnnxWorker

    if a.model_dir is None:
        from decode_concurrency import make_model

        a.model_dir = make_model(a.work)
    ways = (a.ways or ("dynamic,fixed" if a.device == "cpu" else "dynamic,fixed,captured")).split(",")
    cls = OnnxWorker if a.device == "cpu" else CudaWorker
    workers = {w: cls("bench", a.model_dir, a.device, threads=a.threads, decoder_steps=w) for w in ways}
    any_worker = next(iter(workers.values()))
    doc = [7 + i % 500 for i in range(min(a.tokens, any_worker.info.max_length))]
    start = any_worker.info.special_tokens["decoder_start"]

    def round_ms(worker, batch: int) -> float:
        states = worker.begin([doc] * batch)
        tokens, times = [start] * batch, []
        for _ in range(a.steps):
            t = time.perf_counter()
            tokens = worker.step_greedy(states, tokens, [StepConstraints()] * batch)
            times.append(time.perf_counter() - t)
        worker.release()
        return 1000 * statistics.median(times[1:])

    for w, worker in workers.items():  # warm-up: sessions of the shapes to come, captures
        log(f"warm-up: {w}")
        for batch in (1, a.batch):
            round_ms(worker, batch)
    rounds: dict[str, dict[str, list[float]]] = {w: {"batch_1": [], f"batch_{a.batch}": []} for w in ways}
    for r in range(a.rounds):
        for batch in (1, a.batch):
            for w, worker in workers.items():
                log(f"round {r + 1}, batch {batch}: {w}")
                rounds[w][f"batch_{batch}"].append(round_ms(worker, batch))
    step_ms = {w: {k: statistics.median(v) for k, v in by.items()} for w, by in rounds.items()}
    result = {"command": command_line("decode_steps.py"), "device": a.device, "cpu": cpu_name(),
              "model_dir": str(a.model_dir), "tokens": len(doc), "steps": a.steps, "batch": a.batch,
              "threads": a.threads, "step_ms": step_ms, "rounds": rounds,
              # a captured way whose capture ONNX Runtime refused ran uncaptured (and logged why)
              "captured_kept": {w: worker.decoder.fixed.cuda_graph for w, worker in workers.items()
                                if w == "captured"}}
    print(markdown_table(result))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
