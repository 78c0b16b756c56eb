"""Longformer-base at 4096 tokens: the export (fp32, int8) against transformers' PyTorch Longformer
(sliding chunks) and a full-attention export (fp32, int8), interleaved. A script, not a test.

The checkpoint is random-init (transformers, seed 0) at the shape of allenai/longformer-base-4096:
`LongformerConfig(vocab_size=50265, max_position_embeddings=4098, type_vocab_size=1)` (attention
window 512, 12 layers x 768, 12 heads), QA head. Input: batch 1, S tokens, the first 32 global
(`<s>` and a question, as the QA default makes them).

Systems: `ours-fp32` / `ours-int8` (the export of the checkpoint's window and global tokens),
`full-fp32` / `full-int8` (`longdoc export --attention full`: every token attends to every token
with the ordinary projections, what a plain ONNX export of Longformer runs; a baseline for speed
and memory, not the checkpoint's outputs beyond its window; it takes no global tokens) and
`transformers`.

Each measurement is a fresh subprocess (peak RSS = its VmHWM, "act" = peak minus the RSS once
the model is loaded): load, one warm-up pass, one timed pass. Rounds interleave the systems, so
a slow spell of the shared machine hits all of them; the table gives the median over rounds.
A child that fails (a full-attention pass at 16384 tokens may exceed the memory: its scores are
heads x S^2 floats per layer) is reported as `failed (reason)` and left out of later rounds; each
child asks the kernel to kill it first when memory runs out (oom_score_adj 1000).

    .venv/bin/python bench/longformer.py --work /tmp/longdoc-longformer --threads 2 --reps 2

`--config tiny` runs the same on the tests' tiny Longformer (longdoc/testing/tiny_models.py; a smoke test
of the script, e.g. `--config tiny --work /tmp/lf-tiny --length 100 --reps 1`).

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

from common import length_axes, log, status_gib

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("ours-fp32", "ours-int8", "full-fp32", "full-int8", "transformers")
# system -> (export directory under --work, export_model's attention, dtype)
EXPORTS = {"ours-fp32": ("fp32", "sparse", "fp32"), "ours-int8": ("int8", "sparse", "int8"),
           "full-fp32": ("full-fp32", "full", "fp32"), "full-int8": ("full-int8", "full", "int8")}
QUESTION_TOKENS = 32




def make_checkpoint(directory: Path, positions: int, config: str) -> None:
    import torch
    import transformers

    # ids are random: any tokenizer will do
    from longdoc.testing.tiny_models import make_tiny_longformer, tiny_tokenizer

    if config == "tiny":
        make_tiny_longformer(directory, "qa")
        return
    torch.manual_seed(0)
    config = transformers.LongformerConfig(vocab_size=50265, max_position_embeddings=positions, type_vocab_size=1)
    transformers.LongformerForQuestionAnswering(config).eval().save_pretrained(directory)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))


def inputs(S: int, vocab_size: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab_size, (1, S))
    ids[0, 0] = 0
    global_mask = np.zeros((1, S), np.int64)
    global_mask[0, :QUESTION_TOKENS] = 1
    return ids, np.ones((1, S), np.int64), global_mask


def measure(system: str, work: Path, S: int, threads: int) -> dict:
    """One process: load, warm up, time one pass."""
    try:  # this process first when memory runs out (raising one's own score needs no privilege)
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    vocab_size = json.loads((work / "checkpoint" / "config.json").read_text())["vocab_size"]
    ids, mask, global_mask = inputs(S, vocab_size)
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

        model = OnnxModel(work / EXPORTS[system][0], threads=threads)
        # the full-attention graph has no global tokens (every token sees every token)
        extra = {} if system.startswith("full-") else {"global_attention_mask": global_mask}

        def run():
            return model.run_encoder(ids, mask, **extra)["start_logits"]

    loaded = status_gib("VmRSS")
    run()  # warm-up
    t0 = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - t0
    return {"system": system, "seconds": seconds, "peak_gib": status_gib("VmHWM"), "act_gib": status_gib("VmHWM") - loaded,
            "start_logits_head": [float(x) for x in out[0, QUESTION_TOKENS:QUESTION_TOKENS + 4]]}


def child(system: str, work: Path, S: int, threads: int) -> dict:
    """One measurement in a fresh process; a failed one -> {"system", "failed": reason}."""
    cmd = [sys.executable, __file__, "--phase", system, "--work", str(work), "--length", str(S),
           "--threads", str(threads)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(out.stderr)
    if out.returncode == 0:
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return {"system": system, "failed": "no result"}
    return {"system": system, "failed": failure_reason(out.returncode, out.stderr)}


def failure_reason(returncode: int, stderr: str) -> str:
    """A short reason for the table: the signal (SIGKILL: most likely the out-of-memory killer) or
    the last line of stderr."""
    import signal

    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"{name}, out of memory?" if name == "SIGKILL" else name
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return (lines[-1][:120] if lines else f"exit status {returncode}").replace("|", "/")


def table(results: dict[str, list[dict]], systems: list[str]) -> list[str]:
    """Markdown rows: medians of the successful rounds; a system with none: `failed (reason)`."""
    ok = {s: [r for r in rs if "failed" not in r] for s, rs in results.items()}
    ref = statistics.median(r["seconds"] for r in ok["transformers"]) if ok.get("transformers") else None
    rows = ["| system | latency s | vs transformers | peak RSS GiB | activations GiB | first start logits |",
            "|---|---|---|---|---|---|"]
    for system in systems:
        rs, failed = ok[system], [r["failed"] for r in results[system] if "failed" in r]
        if not rs:
            rows.append(f"| {system} | failed ({failed[0]}) | - | - | - | - |")
            continue
        t = statistics.median(r["seconds"] for r in rs)
        note = f" ({len(failed)} round(s) failed: {failed[0]})" if failed else ""
        rows.append(f"| {system} | {t:.2f}{note} | {f'{ref / t:.2f}x' if ref else '-'} | "
                    f"{max(r['peak_gib'] for r in rs):.2f} | {max(r['act_gib'] for r in rs):.2f} | "
                    f"{', '.join(f'{x:.3f}' for x in rs[0]['start_logits_head'])} |")
    return rows


def _systems(text: str) -> list[str]:
    """`--systems ours-fp32,full-fp32` -> the list (an argparse type)."""
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(SYSTEMS)}")
    return names


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
    p.add_argument("--systems", type=_systems, default=list(SYSTEMS), metavar="NAME,...",
                   help=f"which systems to measure, comma-separated (default: {','.join(SYSTEMS)})")
    p.add_argument("--config", choices=["base", "tiny"], default="base",
                   help="base = Longformer-base shape; tiny = the tests' tiny Longformer, a smoke test of the "
                        "script (window 16, 512 tokens at most; --positions is ignored) (default: base)")
    p.add_argument("--plot", type=Path, default=None,
                   help="measure nothing: draw latency and peak RSS against length from every results-LENGTH.json "
                        "a run left in --work, into this PNG (default: none)")
    p.add_argument("--phase", choices=SYSTEMS, default=None, help="internal: one measurement (default: none)")
    a = p.parse_args()
    if a.plot:
        plot(a.work, a.plot)
        return
    if a.phase:
        print(json.dumps(measure(a.phase, a.work, a.length, a.threads)))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    config_path = a.work / "checkpoint" / "config.json"
    want = {"hidden_size": 32} if a.config == "tiny" else {"hidden_size": 768, "max_position_embeddings": a.positions}
    if not config_path.is_file():
        log(f"building the random-init Longformer QA checkpoint ({a.config}, {a.positions} positions)"
            if a.config == "base" else "building the tiny Longformer QA checkpoint")
        make_checkpoint(a.work / "checkpoint", a.positions, a.config)
    elif any(json.loads(config_path.read_text()).get(k) != v for k, v in want.items()):
        sys.exit(f"{a.work}: its checkpoint is not --config {a.config} with --positions {a.positions} "
                 f"({', '.join(f'{k} {v}' for k, v in want.items())}); use another --work")
    from longdoc.export.exporter import export_model

    for system in a.systems:
        if system in EXPORTS and not (a.work / EXPORTS[system][0] / "manifest.json").is_file():
            name, attention, dtype = EXPORTS[system]
            log(f"exporting {name}")
            export_model(a.work / "checkpoint", a.work / name, "qa", dtype=dtype, attention=attention, progress=log)
    results: dict[str, list[dict]] = {s: [] for s in a.systems}
    for rep in range(a.reps):
        for system in a.systems:
            if any("failed" in r for r in results[system]):  # an out-of-memory pass fails again
                log(f"round {rep + 1} {system}: skipped (failed before)")
                continue
            r = child(system, a.work, a.length, a.threads)
            log(f"round {rep + 1} {system}: " + (f"failed ({r['failed']})" if "failed" in r else
                                                 f"{r['seconds']:.2f} s, peak {r['peak_gib']:.2f} GiB"))
            results[system].append(r)
    print(f"Longformer{'-base' if a.config == 'base' else ' (tiny)'} QA, batch 1, {a.length} tokens "
          f"({QUESTION_TOKENS} global; full-* none), {a.threads} threads, median of {a.reps} interleaved rounds")
    print("\n".join(table(results, a.systems)))
    summary = {"length": a.length, "reps": a.reps, "threads": a.threads, "config": a.config,
               "systems": {s: summarize(rs) for s, rs in results.items()}}
    out = a.work / f"results-{a.length}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    log(f"wrote {out} (--plot draws every length's)")


def summarize(rounds: list[dict]) -> dict:
    """One system's median latency and largest peak over its successful rounds (None: all failed)."""
    ok = [r for r in rounds if "failed" not in r]
    if not ok:
        return {"seconds": None, "peak_gib": None, "failed": rounds[0]["failed"] if rounds else "not run"}
    return {"seconds": statistics.median(r["seconds"] for r in ok), "peak_gib": max(r["peak_gib"] for r in ok)}


def plot(work: Path, png: Path) -> None:
    """Latency and peak RSS against length, log-log, one line per system, from work/results-*.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((json.loads(f.read_text()) for f in work.glob("results-*.json")), key=lambda r: r["length"])
    if not runs:
        sys.exit(f"{work}: no results-*.json (run a measurement first)")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in SYSTEMS:
        points = [(r["length"], r["systems"][system]) for r in runs if r["systems"].get(system, {}).get("seconds")]
        if not points:
            continue
        lengths = [n for n, _ in points]
        axes[0].plot(lengths, [v["seconds"] for _, v in points], "o-", label=system)
        axes[1].plot(lengths, [v["peak_gib"] for _, v in points], "o-", label=system)
    length_axes(axes)
    fig.suptitle(f"Longformer-base QA on CPU ({runs[0]['threads']} threads): block-sparse export vs full attention "
                 "vs transformers")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    log(f"wrote {png}")


if __name__ == "__main__":
    main()
