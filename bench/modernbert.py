"""ModernBERT-base on CPU at 2048..8192 tokens: our export (fp32, int8) against transformers (eager,
sdpa) and a plain ONNX export of transformers' model, interleaved (issue 28 item 5). A script, not a test.

The checkpoint is random-init (transformers, seed 0) at ModernBERT-base's shape, transformers'
`ModernBertConfig()` defaults: hidden 768, 22 layers, 12 heads, local_attention 128 (a band of 64
tokens each side), every 3rd layer global (full attention), 8192 positions; QA head. Input: batch 1,
S random ids (seeded; the first one [CLS]), no padding.

Systems:

    ours-fp32   `longdoc export --task qa` (sliding layers lowered to a band, linear in S), ONNX Runtime
    ours-int8   the same with `--dtype int8` (dynamic int8 quantization of the dense MatMuls)
    ours-int8-attn  the same with `--int8-attention dynamic-s8`: the full layers' Q.K^T and P.V in
                int8 too (the band layers stay fp32)
    hf-eager    transformers' ModernBertForQuestionAnswering, attn_implementation="eager"
    hf-sdpa     the same, attn_implementation="sdpa"
    hf-onnx     torch.onnx.export of transformers' model (sdpa, dynamic batch and sequence axes), run
                by ONNX Runtime; if it cannot be exported, the error is recorded and it is left out

Every system runs --threads intra-op threads (ONNX Runtime's intra_op_num_threads, torch's
set_num_threads), torch under torch.inference_mode. Each measurement is a fresh subprocess: load,
one warm-up pass, one timed pass; "peak" = that process's peak RSS (VmHWM: ru_maxrss carries a
forked parent's high-water mark over into the child). Rounds interleave the systems at each length,
so a slow spell of the shared machine hits all of them; latency = median over rounds, peak = the
largest. "growth" = latency at the longest length / latency at the shortest. "max |diff|" = largest
absolute difference of the start and end logits from hf-eager's on the same input (the computations
compared are the same). A child that fails is reported as failed (reason) and not run again at that
length.

    .venv/bin/python bench/modernbert.py --lengths 2048,4096,8192 --reps 2,1,1

writes docs/modernbert.json and docs/modernbert.png and prints the table (docs/benchmarks.md).
`--quick` runs the same on the tests' tiny ModernBERT (longdoc/testing/tiny_models.py) at 64 and
128 tokens, one round, into --work: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import command_line, cpu_name, length_axes, loadavg, log, status_gib

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("ours-fp32", "ours-int8", "ours-int8-attn", "hf-eager", "hf-sdpa", "hf-onnx")
# system -> (dtype, int8 attention); the export directory is the system's name
EXPORTS = {"ours-fp32": ("fp32", "off"), "ours-int8": ("int8", "off"), "ours-int8-attn": ("int8", "dynamic-s8")}
REFERENCE = "hf-eager"
GOAL_SPEEDUP = 3.0  # ours int8 at the longest length vs transformers' fastest CPU path (hf-eager, hf-sdpa)
DEFAULT_LENGTHS = "2048,4096,8192"
QUICK_LENGTHS = "64,128"




# --- preparation (parent process) --------------------------------------------------------------

def make_checkpoint(directory: Path, config: str) -> None:
    """Random-init ModernBERT QA checkpoint: base = ModernBertConfig() defaults, tiny = the tests'."""
    import torch
    import transformers

    from longdoc.testing.tiny_models import make_tiny_modernbert, tiny_tokenizer

    if config == "tiny":
        make_tiny_modernbert(directory, "qa")
        return
    torch.manual_seed(0)
    transformers.ModernBertForQuestionAnswering(transformers.ModernBertConfig()).eval().save_pretrained(directory)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))  # ids are random: any tokenizer will do


def hf_model(checkpoint: Path, attn: str):
    import transformers

    return transformers.ModernBertForQuestionAnswering.from_pretrained(
        str(checkpoint), attn_implementation=attn).eval()


def onnx_export(work: Path) -> dict:
    """torch.onnx.export of transformers' model (sdpa) into work/hf-onnx/model.onnx with dynamic
    batch and sequence axes, run as a child: the dynamo exporter (torch's default), then the
    TorchScript one (dynamo=False) if that fails -> {"exporter", "seconds", "errors"}; raises when
    neither exports."""
    import torch

    out = work / "hf-onnx" / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    model = hf_model(work / "checkpoint", "sdpa")
    ids = torch.from_numpy(inputs(256 if json_config(work)["hidden_size"] > 64 else 64, work)[0])
    args = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    names = {"input_names": ["input_ids", "attention_mask"], "output_names": ["start_logits", "end_logits"]}
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    attempts = {
        "dynamo=True": dict(dynamo=True, dynamic_shapes={k: {0: batch, 1: seq} for k in args}),
        "dynamo=False": dict(dynamo=False, opset_version=17,
                             dynamic_axes={k: {0: "batch", 1: "sequence"} for k in (*args, "start_logits", "end_logits")}),
    }
    errors = {}
    for name, options in attempts.items():
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                torch.onnx.export(model, (), str(out), kwargs=args, **names, **options)
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            continue
        return {"exporter": f"torch.onnx.export({name}), torch {torch.__version__}",
                "seconds": round(time.perf_counter() - t0, 1), "errors": errors}
    raise RuntimeError("; ".join(f"{k}: {v}" for k, v in errors.items()))


def json_config(work: Path) -> dict:
    return json.loads((work / "checkpoint" / "config.json").read_text())


# --- one measurement (child process) ------------------------------------------------------------

def inputs(S: int, work: Path):
    import numpy as np

    config = json_config(work)
    rng = np.random.default_rng(0)
    ids = rng.integers(8, min(config["vocab_size"], 50000), (1, S))
    ids[0, 0] = config["cls_token_id"]
    return ids.astype(np.int64), np.ones((1, S), np.int64)


def measure(system: str, work: Path, S: int, threads: int) -> dict:
    """Load, warm up, time one pass; the logits go to work/logits/SYSTEM-S.npy."""
    import numpy as np

    try:  # this process first when memory runs out (raising one's own score needs no privilege)
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    ids, mask = inputs(S, work)
    if system.startswith("hf-") and system != "hf-onnx":
        import torch

        torch.set_num_threads(threads)
        model = hf_model(work / "checkpoint", system.removeprefix("hf-"))
        args = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}

        def run():
            with torch.inference_mode():
                out = model(**args)
            return out.start_logits.numpy(), out.end_logits.numpy()
    elif system == "hf-onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(str(work / "hf-onnx" / "model.onnx"), options,
                                       providers=["CPUExecutionProvider"])

        def run():
            return tuple(session.run(["start_logits", "end_logits"], {"input_ids": ids, "attention_mask": mask}))
    else:
        from longdoc.export.runtime import OnnxModel

        model = OnnxModel(work / system, threads=threads)

        def run():
            out = model.run_encoder(ids, mask)
            return out["start_logits"], out["end_logits"]

    loaded = status_gib("VmRSS")
    run()  # warm-up
    t0 = time.perf_counter()
    start, end = run()
    seconds = time.perf_counter() - t0
    (work / "logits").mkdir(exist_ok=True)
    np.save(work / "logits" / f"{system}-{S}.npy", np.stack([np.asarray(start, np.float32).reshape(-1),
                                                             np.asarray(end, np.float32).reshape(-1)]))
    peak = status_gib("VmHWM")
    return {"system": system, "seconds": seconds, "peak_gib": peak, "act_gib": peak - loaded}


def child(phase: str, work: Path, S: int, threads: int) -> dict:
    """One measurement (or the ONNX export) in a fresh process; a failed one -> {"failed": reason}."""
    cmd = [sys.executable, __file__, "--phase", phase, "--work", str(work), "--lengths", str(S),
           "--threads", str(threads)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if out.returncode == 0:
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return {"failed": "no result"}
    sys.stderr.write(out.stderr[-4000:])
    return {"failed": failure_reason(out.returncode, out.stderr)}


def failure_reason(returncode: int, stderr: str) -> str:
    """The signal (SIGKILL: most likely the out-of-memory killer) or the last line of stderr."""
    import signal

    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"{name}, out of memory?" if name == "SIGKILL" else name
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return (lines[-1][:200] if lines else f"exit status {returncode}").replace("|", "/")


# --- summary, table, plot --------------------------------------------------------------------

def max_diff(work: Path, system: str, S: int) -> float | None:
    import numpy as np

    got, want = work / "logits" / f"{system}-{S}.npy", work / "logits" / f"{REFERENCE}-{S}.npy"
    if not (got.is_file() and want.is_file()):
        return None
    return float(np.abs(np.load(got) - np.load(want)).max())


def summarize(rounds: list[dict]) -> dict:
    """One system at one length: median latency and largest peak over its successful rounds."""
    ok = [r for r in rounds if "failed" not in r]
    if not ok:
        return {"seconds": None, "peak_gib": None, "failed": rounds[0]["failed"] if rounds else "not run"}
    return {"seconds": statistics.median(r["seconds"] for r in ok), "rounds": [r["seconds"] for r in ok],
            "peak_gib": max(r["peak_gib"] for r in ok), "act_gib": max(r["act_gib"] for r in ok)}


def speedup(results: dict, system: str, length: int) -> float | None:
    """transformers' fastest CPU path (hf-eager, hf-sdpa) / system's latency at `length`."""
    row = results["systems"][system][str(length)]
    hf = [results["systems"][s][str(length)]["seconds"] for s in ("hf-eager", "hf-sdpa") if s in results["systems"]]
    hf = [t for t in hf if t]
    return min(hf) / row["seconds"] if hf and row["seconds"] else None


def growth(results: dict, system: str) -> float | None:
    lengths = results["lengths"]
    first, last = (results["systems"][system][str(n)]["seconds"] for n in (lengths[0], lengths[-1]))
    return last / first if first and last and len(lengths) > 1 else None


def markdown_table(results: dict) -> str:
    """The table of docs/benchmarks.md from the results file: one row per system and length."""
    lengths = results["lengths"]
    rows = ["| system | tokens | latency s | vs fastest transformers | peak RSS GiB | "
            f"max \\|diff\\| vs {REFERENCE} | growth {lengths[-1]}/{lengths[0]} |",
            "|---|---|---|---|---|---|---|"]
    for system, by_length in results["systems"].items():
        g = growth(results, system)
        for n in lengths:
            row = by_length[str(n)]
            if row["seconds"] is None:
                rows.append(f"| {system} | {n} | failed ({row['failed']}) | - | - | - | - |")
                continue
            s = speedup(results, system, n)
            diff = row.get("max_diff")
            rows.append(f"| {system} | {n} | {row['seconds']:.3g} | {f'{s:.2f}x' if s else '-'} | "
                        f"{row['peak_gib']:.2f} | {'-' if diff is None else f'{diff:.1e}'} | "
                        f"{f'{g:.1f}x' if g and n == lengths[-1] else ''} |")
    return "\n".join(rows)


def goal(results: dict) -> dict:
    """At the longest length: our faster int8 export (ours-int8, ours-int8-attn) at least GOAL_SPEEDUP x
    faster than transformers' fastest path."""
    n = results["lengths"][-1]
    found = [(speedup(results, name, n), name) for name in ("ours-int8", "ours-int8-attn")
             if name in results["systems"]]
    s, system = max(((v, name) for v, name in found if v), default=(None, None))
    return {"length": n, "target": GOAL_SPEEDUP, "speedup": s, "system": system,
            "met": bool(s and s >= GOAL_SPEEDUP)}


def plot(results: dict, png: Path) -> None:
    """Latency and peak RSS against length, log-log, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, by_length in results["systems"].items():
        points = [(int(n), v) for n, v in by_length.items() if v["seconds"]]
        if not points:
            continue
        axes[0].plot([n for n, _ in points], [v["seconds"] for _, v in points], "o-", label=system)
        axes[1].plot([n for n, _ in points], [v["peak_gib"] for _, v in points], "o-", label=system)
    length_axes(axes)
    fig.suptitle(f"ModernBERT{'-base' if results['config'] == 'base' else ' (tiny)'} QA on CPU "
                 f"({results['threads']} threads): our export vs transformers")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------

def _lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive token counts")
    return lengths


def _reps(text: str) -> list[int]:
    try:
        reps = [int(x) for x in text.split(",")]
    except ValueError:
        reps = []
    if not reps or min(reps) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of rounds, or one per length")
    return reps


def _systems(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    if not names or any(x not in SYSTEMS for x in names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in names]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-modernbert"),
                   help="checkpoint, exports and logits are built here once (default: /tmp/longdoc-modernbert)")
    p.add_argument("--lengths", type=_lengths, default=None, metavar="N,...",
                   help=f"tokens per input, comma-separated (default: {DEFAULT_LENGTHS}; {QUICK_LENGTHS} with --quick)")
    p.add_argument("--reps", type=_reps, default=None, metavar="N[,N...]",
                   help="interleaved rounds per length, each a warm-up and a timed pass; one number for every "
                        "length or one per length, e.g. 2,1,1 (default: 2; 1 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every system (default: 2)")
    p.add_argument("--systems", type=_systems, default=list(SYSTEMS), metavar="NAME,...",
                   help=f"which systems to measure, comma-separated (default: {','.join(SYSTEMS)})")
    p.add_argument("--quick", action="store_true",
                   help="the tests' tiny ModernBERT (hidden 64, 4 layers, 512 positions), lengths "
                        f"{QUICK_LENGTHS}, one round, results into --work: a smoke test (default: off)")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default: docs/modernbert.json; WORK/modernbert.json with --quick)")
    p.add_argument("--png", type=Path, default=None,
                   help="plot (default: docs/modernbert.png; WORK/modernbert.png with --quick)")
    p.add_argument("--phase", default=None, help="internal: one measurement or the ONNX export (default: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.phase:
        result = onnx_export(a.work) if a.phase == "onnx-export" else measure(a.phase, a.work, a.lengths[0], a.threads)
        print(json.dumps(result))
        return 0
    config = "tiny" if a.quick else "base"
    lengths = a.lengths or _lengths(QUICK_LENGTHS if a.quick else DEFAULT_LENGTHS)
    reps = a.reps or [1 if a.quick else 2]
    if len(reps) not in (1, len(lengths)):
        sys.exit(f"--reps: one number or one per length ({len(lengths)})")
    reps_at = dict(zip(lengths, reps * len(lengths) if len(reps) == 1 else reps))
    out_dir = a.work if a.quick else ROOT / "docs"
    json_path, png_path = a.json or out_dir / "modernbert.json", a.png or out_dir / "modernbert.png"
    a.work.mkdir(parents=True, exist_ok=True)
    config_path = a.work / "checkpoint" / "config.json"
    want_hidden = 64 if config == "tiny" else 768
    if not config_path.is_file():
        log(f"building the random-init ModernBERT QA checkpoint ({config})")
        make_checkpoint(a.work / "checkpoint", config)
    elif json_config(a.work)["hidden_size"] != want_hidden:
        sys.exit(f"{a.work}: its checkpoint is not the {config} one; use another --work")
    if lengths[-1] > json_config(a.work)["max_position_embeddings"]:
        sys.exit(f"--lengths: at most {json_config(a.work)['max_position_embeddings']} tokens")

    from longdoc.export.exporter import export_model

    for system, (dtype, int8_attention) in EXPORTS.items():
        if system in a.systems and not (a.work / system / "manifest.json").is_file():
            log(f"longdoc export --task qa --dtype {dtype} --int8-attention {int8_attention} -> {a.work / system}")
            export_model(a.work / "checkpoint", a.work / system, "qa", dtype=dtype, int8_attention=int8_attention,
                         progress=lambda m: log("  " + m))
    onnx_status = None
    if "hf-onnx" in a.systems:
        if (a.work / "hf-onnx" / "export.json").is_file():
            onnx_status = json.loads((a.work / "hf-onnx" / "export.json").read_text())
        else:
            log("torch.onnx.export of transformers' model")
            onnx_status = child("onnx-export", a.work, lengths[0], a.threads)
            (a.work / "hf-onnx").mkdir(parents=True, exist_ok=True)
            (a.work / "hf-onnx" / "export.json").write_text(json.dumps(onnx_status) + "\n")
        log(f"  {onnx_status}")

    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    load_before = loadavg()
    rounds: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in lengths} for s in a.systems}
    for n in lengths:
        for rep in range(reps_at[n]):
            for system in a.systems:
                if system == "hf-onnx" and "failed" in onnx_status:
                    rounds[system][n].append({"failed": f"torch.onnx.export: {onnx_status['failed']}"})
                    continue
                if any("failed" in r for r in rounds[system][n]):  # an out-of-memory pass fails again
                    continue
                r = child(system, a.work, n, a.threads)
                log(f"{n} tokens, round {rep + 1} {system}: " + (
                    f"failed ({r['failed']})" if "failed" in r else f"{r['seconds']:.2f} s, peak {r['peak_gib']:.2f} GiB"))
                rounds[system][n].append(r)
    results = {
        "command": command_line("modernbert.py", argv),
        "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": cpu_name(),
                    "loadavg_before": load_before,
                    "loadavg_after": loadavg()},
        "config": config, "lengths": lengths, "reps": {str(n): r for n, r in reps_at.items()}, "threads": a.threads, "reference": REFERENCE,
        "hf_onnx_export": onnx_status,
        "systems": {s: {str(n): summarize(rounds[s][n]) for n in lengths} for s in a.systems},
    }
    for s in a.systems:
        for n in lengths:
            if results["systems"][s][str(n)]["seconds"] is not None:
                results["systems"][s][str(n)]["max_diff"] = max_diff(a.work, s, n)
    results["goal"] = goal(results)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, png_path)
    print(f"ModernBERT{'-base' if config == 'base' else ' (tiny)'} QA, batch 1, {a.threads} threads, "
          f"median of {'/'.join(str(r) for r in reps_at.values())} interleaved round(s) at {'/'.join(map(str, lengths))} tokens")
    print(markdown_table(results))
    g = results["goal"]
    shown = "-" if g["speedup"] is None else f"{g['speedup']:.2f}x"
    print(f"goal (ours int8 >= {g['target']:.0f}x transformers' fastest at {g['length']} tokens): "
          f"{'met' if g['met'] else 'not met'} ({shown}, {g['system']})")
    log(f"wrote {json_path} and {png_path}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
