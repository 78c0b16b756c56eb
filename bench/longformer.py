"""Longformer-base at 4096 tokens: the export (fp32, int8) against transformers' PyTorch Longformer
(sliding chunks), interleaved. A script, not a test.

The checkpoint is random-init (transformers, seed 0) at the shape of allenai/longformer-base-4096:
`LongformerConfig(vocab_size=50265, max_position_embeddings=4098, type_vocab_size=1)` (attention
window 512, 12 layers x 768, 12 heads), QA head. Input: batch 1, S tokens, the first 32 global
(`<s>` and a question, as the QA default makes them).

Each measurement is a fresh subprocess (peak RSS = its VmHWM, "act" = peak minus the RSS once
the model is loaded): load, one warm-up pass, one timed pass. Rounds interleave the systems, so
a slow spell of the shared machine hits all of them; the table gives the median over rounds.

    .venv/bin/python bench/longformer.py --work /tmp/longdoc-longformer --threads 2 --reps 2

`--positions 16386` builds the checkpoint with LED's position count (16384 tokens after
RoBERTa's two reserved positions) for lengths up to 16384; use its own `--work` directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("ours-fp32", "ours-int8", "transformers")
QUESTION_TOKENS = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rss_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def make_checkpoint(directory: Path, positions: int) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import tiny_tokenizer  # ids are random: any tokenizer.json will do

    torch.manual_seed(0)
    config = transformers.LongformerConfig(vocab_size=50265, max_position_embeddings=positions, type_vocab_size=1)
    transformers.LongformerForQuestionAnswering(config).eval().save_pretrained(directory)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))


def inputs(S: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 50265, (1, S))
    ids[0, 0] = 0
    global_mask = np.zeros((1, S), np.int64)
    global_mask[0, :QUESTION_TOKENS] = 1
    return ids, np.ones((1, S), np.int64), global_mask


def measure(system: str, work: Path, S: int, threads: int) -> dict:
    """One process: load, warm up, time one pass."""
    ids, mask, global_mask = inputs(S)
    if system == "transformers":
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.LongformerForQuestionAnswering.from_pretrained(str(work / "checkpoint")).eval()
        args = {k: torch.from_numpy(v) for k, v in
                (("input_ids", ids), ("attention_mask", mask), ("global_attention_mask", global_mask))}

        def run():
            with torch.no_grad():
                return model(**args).start_logits.numpy()
    else:
        from longdoc.export.runtime import OnnxModel

        model = OnnxModel(work / system.removeprefix("ours-"), threads=threads)

        def run():
            return model.run_encoder(ids, mask, global_attention_mask=global_mask)["start_logits"]

    loaded = _rss_gib("VmRSS")
    run()  # warm-up
    t0 = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - t0
    return {"system": system, "seconds": seconds, "peak_gib": _rss_gib("VmHWM"), "act_gib": _rss_gib("VmHWM") - loaded,
            "start_logits_head": [float(x) for x in out[0, QUESTION_TOKENS:QUESTION_TOKENS + 4]]}


def child(system: str, work: Path, S: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--phase", system, "--work", str(work), "--length", str(S),
           "--threads", str(threads)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-longformer"),
                   help="checkpoint and exports are built here once (default: /tmp/longdoc-longformer)")
    p.add_argument("--length", type=int, default=4096, help="tokens per input (default: 4096)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every system (default: 2)")
    p.add_argument("--reps", type=int, default=2, help="interleaved rounds (default: 2)")
    p.add_argument("--positions", type=int, default=4098,
                   help="the checkpoint's max_position_embeddings (default: 4098, longformer-base-4096's; "
                        "16386 = LED's 16384 tokens)")
    p.add_argument("--phase", choices=SYSTEMS, default=None, help="internal: one measurement (default: none)")
    a = p.parse_args()
    if a.phase:
        print(json.dumps(measure(a.phase, a.work, a.length, a.threads)))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    config_path = a.work / "checkpoint" / "config.json"
    if not config_path.is_file():
        log(f"building the random-init Longformer-base QA checkpoint ({a.positions} positions)")
        make_checkpoint(a.work / "checkpoint", a.positions)
    elif json.loads(config_path.read_text())["max_position_embeddings"] != a.positions:
        sys.exit(f"{a.work}: its checkpoint has another position count than --positions {a.positions}; "
                 "use another --work")
    from longdoc.export.exporter import export_model

    for dtype in ("fp32", "int8"):
        if not (a.work / dtype / "manifest.json").is_file():
            log(f"exporting {dtype}")
            export_model(a.work / "checkpoint", a.work / dtype, "qa", dtype=dtype, progress=log)
    results: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for rep in range(a.reps):
        for system in SYSTEMS:
            r = child(system, a.work, a.length, a.threads)
            log(f"round {rep + 1} {system}: {r['seconds']:.2f} s, peak {r['peak_gib']:.2f} GiB")
            results[system].append(r)
    ref = statistics.median(r["seconds"] for r in results["transformers"])
    print(f"Longformer-base QA, batch 1, {a.length} tokens ({QUESTION_TOKENS} global), {a.threads} threads, "
          f"median of {a.reps} interleaved rounds")
    print("| system | latency s | vs transformers | peak RSS GiB | activations GiB | first start logits |")
    print("|---|---|---|---|---|---|")
    for system in SYSTEMS:
        rs = results[system]
        t = statistics.median(r["seconds"] for r in rs)
        print(f"| {system} | {t:.2f} | {ref / t:.2f}x | {max(r['peak_gib'] for r in rs):.2f} | "
              f"{max(r['act_gib'] for r in rs):.2f} | {', '.join(f'{x:.3f}' for x in rs[0]['start_logits_head'])} |")


if __name__ == "__main__":
    main()
