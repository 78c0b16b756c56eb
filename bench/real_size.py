"""The public architectures at their real size, end to end (issue 11, "Real-size checkpoints").
A script, not a test: it takes tens of minutes and downloads nothing.

Random-init weights (transformers, seed 0) at transformers' default configurations:

    bigbird-base      BigBirdConfig()                 (bigbird-roberta-base), QA and classify heads
    bigbird-large     24 layers x 1024, 16 heads      (bigbird-roberta-large), QA head
    pegasus-large     BigBirdPegasusConfig()          (bigbird-pegasus-large), summarize

For each: build the checkpoint, `longdoc export` fp32 and int8 (time, graph sizes, external data
where a graph passes 2 GiB), `longdoc verify` (fp32 against transformers, int8 against the fp32
PyTorch model by task agreement), then serve it with a real `longdoc serve` and send one request
at 1024 and one at 4096 tokens (latency as the client sees it; peak RSS of the server process).
For pegasus-large also the time per generated token, greedy and beam 5, of the export
(`OnnxModel.generate`) against transformers `generate()` on the same weights, same run.

Every phase runs in its own process (peak RSS = that process's VmHWM). Progress goes to stderr;
the table to stdout and, with --out, to a JSON file.

    .venv/bin/python bench/real_size.py --work /tmp/longdoc-real --threads 2 --out docs/real_size.json

writes docs/real_size.json: the command, the machine and the results (docs/benchmarks.md's tables).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import command_line, cpu_name, loadavg, log

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "bigbird-base": {"kind": "big_bird", "config": {}, "tasks": ("qa", "classify")},
    "bigbird-large": {"kind": "big_bird", "tasks": ("qa",),
                      "config": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096)},
    "pegasus-large": {"kind": "bigbird_pegasus", "config": {}, "tasks": ("summarize",)},
}
HF_CLASSES = {"qa": "BigBirdForQuestionAnswering", "classify": "BigBirdForSequenceClassification",
              "summarize": "BigBirdPegasusForConditionalGeneration"}



def peak_rss_gib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def child(phase: str, **kwargs) -> dict:
    """Run one phase in a fresh process; its JSON result (with its peak RSS)."""
    cmd = [sys.executable, __file__, "--phase", phase, "--args", json.dumps(kwargs)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"phase {phase} failed (exit {out.returncode}); see its output above")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- phases (child processes) ------------------------------------------------------------------

def phase_make(ckpt: str, kind: str, task: str, config: dict) -> dict:
    import torch
    import transformers

    from longdoc.testing.tiny_models import tiny_tokenizer

    torch.manual_seed(0)
    cfg_cls = transformers.BigBirdPegasusConfig if kind == "bigbird_pegasus" else transformers.BigBirdConfig
    model = getattr(transformers, HF_CLASSES[task])(cfg_cls(**config)).eval()
    model.save_pretrained(ckpt, safe_serialization=True)
    tiny_tokenizer().save(str(Path(ckpt) / "tokenizer.json"))  # ids < vocab: enough for random weights
    return {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def phase_export(ckpt: str, out: str, task: str, dtype: str) -> dict:
    from longdoc.export.exporter import export_model

    start = time.perf_counter()
    export_model(ckpt, out, task, dtype=dtype, progress=lambda m: log(f"  export {dtype}: {m}"))
    files = {p.name: p.stat().st_size for p in Path(out).iterdir() if p.name.endswith((".onnx", ".data"))}
    return {"seconds": time.perf_counter() - start, "files_mib": {k: v / 2**20 for k, v in files.items()},
            "external_data": any(k.endswith(".data") for k in files), "peak_gib": peak_rss_gib()}


def phase_verify(model_dir: str, ckpt: str, against: str, lengths: list[int], threads: int) -> dict:
    from longdoc.export.verify import verify_model

    start = time.perf_counter()
    report = verify_model(model_dir, ckpt, against=against, lengths=lengths, threads=threads,
                          progress=lambda m: log(f"  verify: {m}"), generation_lengths=1, max_new_tokens=8)
    diffs = [c.max_abs_diff for c in report.checks if c.max_abs_diff is not None]
    agreement = [f"{c.what}: {c.note}" for c in report.checks if c.graph == "agreement"]
    log(report.summary())
    return {"ok": report.ok, "checks": len(report.checks), "passed": sum(c.ok for c in report.checks),
            "max_abs_diff": max(diffs) if diffs else None, "agreement": agreement,
            "seconds": time.perf_counter() - start, "peak_gib": peak_rss_gib()}


def phase_generate(model_dir: str, ckpt: str, tokens: int, new_tokens: int, threads: int) -> dict:
    """Seconds per generated token, export vs transformers, greedy and beam 5: (t(N) - t(1)) / (N - 1)
    over the tokens really generated, so the encoder's time cancels out."""
    import numpy as np
    import torch
    import transformers

    from longdoc.export.runtime import OnnxModel

    torch.set_num_threads(threads)
    ours = OnnxModel(model_dir, threads=threads)
    theirs = transformers.BigBirdPegasusForConditionalGeneration.from_pretrained(ckpt).eval()
    ids = np.random.default_rng(0).integers(10, 400, (1, tokens))
    mask = np.ones_like(ids)
    result = {}
    for beams in (1, 5):
        for name in ("ours", "transformers"):
            def run(n: int) -> tuple[float, int]:
                start = time.perf_counter()
                if name == "ours":
                    made = len(ours.generate(ids, mask, max_new_tokens=n, num_beams=beams)[0])
                else:
                    with torch.no_grad():
                        made = theirs.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                               max_new_tokens=n, min_new_tokens=n, num_beams=beams,
                                               do_sample=False).shape[1]
                return time.perf_counter() - start, made

            run(new_tokens)  # warm-up: sessions, layouts, allocator
            timings = {n: min(run(n) for _ in range(2)) for n in (1, new_tokens)}
            (t1, m1), (tn, mn) = timings[1], timings[new_tokens]
            per_token = (tn - t1) / max(mn - m1, 1)
            result[f"{name}_beam{beams}_s_per_token"] = per_token
            log(f"  generate {name} beams {beams}: {per_token * 1000:.0f} ms/token ({mn} vs {m1} tokens)")
    return result


# --- serving (parent) ----------------------------------------------------------------------------

def serve_and_time(name: str, model_dir: Path, task: str, threads: int, lengths=(1024, 4096)) -> dict:
    import httpx

    from load import free_port, wait_ready
    from longdoc.testing.tiny_models import TINY_WORDS

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "longdoc", "serve", "--model", f"{name}={model_dir}",
                             "--port", str(port), "--threads", str(threads)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_ready(proc, f"http://127.0.0.1:{port}", f"longdoc serve {model_dir}", timeout_s=900)
        result = {"rss_after_load_gib": peak_rss_gib(proc.pid)}
        words = [w for w in TINY_WORDS if w.isalpha()]
        for n in lengths:
            doc = " ".join(words[i % len(words)] for i in range(n - 20))  # ~n tokens with the question
            body = {"document": doc}
            if task == "qa":
                body["question"] = "what is the answer"
            if task == "summarize":
                body["max_new_tokens"] = 16
            path = {"qa": "/v1/qa", "classify": "/v1/classify", "summarize": "/v1/summarize"}[task]
            start = time.perf_counter()
            r = httpx.post(url + path, json=body, headers={"X-Request-Timeout": "600"}, timeout=900)
            seconds = time.perf_counter() - start
            if r.status_code != 200:
                raise SystemExit(f"{path} at {n} tokens: {r.status_code} {r.text[:300]}")
            usage = r.json()["results"][0]["usage"]
            result[f"latency_{n}_s"] = seconds
            result[f"tokens_{n}"] = usage["tokens"]
            log(f"  served {name} {task} at {usage['tokens']} tokens ({usage['windows']} windows): {seconds:.2f} s")
        result["peak_rss_gib"] = peak_rss_gib(proc.pid)
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- driver --------------------------------------------------------------------------------------

def run(work: Path, names: list[str], threads: int, new_tokens: int) -> dict:
    results = {}
    for name in names:
        spec = MODELS[name]
        for task in spec["tasks"]:
            key = f"{name}-{task}"
            row = results[key] = {}
            ckpt = work / f"ckpt-{key}"
            if not (ckpt / "config.json").is_file():
                log(f"{key}: building the random-init checkpoint")
                row["make"] = child("make", ckpt=str(ckpt), kind=spec["kind"], task=task, config=spec["config"])
            for dtype in ("fp32", "int8"):
                out = work / f"{key}-{dtype}"
                log(f"{key}: export {dtype}")
                subprocess.run(["rm", "-rf", str(out)], check=True)
                row[f"export_{dtype}"] = child("export", ckpt=str(ckpt), out=str(out), task=task, dtype=dtype)
                against = "transformers" if dtype == "fp32" else "model"
                log(f"{key}: verify {dtype} against {against}")
                row[f"verify_{dtype}"] = child("verify", model_dir=str(out), ckpt=str(ckpt), against=against,
                                               lengths=[1024], threads=threads)
                log(f"{key}: serve {dtype}")
                row[f"serve_{dtype}"] = serve_and_time(key, out, task, threads)
            if task == "summarize":
                log(f"{key}: time per generated token")
                row["generate"] = child("generate", model_dir=str(work / f"{key}-fp32"), ckpt=str(ckpt),
                                        tokens=1024, new_tokens=new_tokens, threads=threads)
    return results


def table(results: dict) -> str:
    lines = ["| model | dtype | export s | graphs MiB | ext. data | verify | served RSS GiB | 1024 tok s | 4096 tok s |",
             "|---|---|---:|---:|---|---|---:|---:|---:|"]
    for key, row in results.items():
        for dtype in ("fp32", "int8"):
            e, v, s = row[f"export_{dtype}"], row[f"verify_{dtype}"], row[f"serve_{dtype}"]
            verdict = ("PASS" if v["ok"] else "FAIL") + f" {v['passed']}/{v['checks']}"
            if v["max_abs_diff"] is not None and dtype == "fp32":
                verdict += f", max diff {v['max_abs_diff']:.1e}"
            lines.append(f"| {key} | {dtype} | {e['seconds']:.0f} | {sum(e['files_mib'].values()):.0f} | "
                         f"{'yes' if e['external_data'] else 'no'} | {verdict} | {s['peak_rss_gib']:.2f} | "
                         f"{s['latency_1024_s']:.2f} | {s['latency_4096_s']:.2f} |")
    gen = [(k, r["generate"]) for k, r in results.items() if "generate" in r]
    if gen:
        lines += ["", "| model | search | ours ms/token | transformers ms/token | speed-up |", "|---|---|---:|---:|---:|"]
        for key, g in gen:
            for beams in (1, 5):
                ours, theirs = g[f"ours_beam{beams}_s_per_token"], g[f"transformers_beam{beams}_s_per_token"]
                search = "greedy" if beams == 1 else f"beam {beams}"
                lines.append(f"| {key} | {search} | {1000 * ours:.0f} | {1000 * theirs:.0f} | {theirs / ours:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-real"),
                   help="folder for checkpoints and exports (default: /tmp/longdoc-real; tens of GB)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime and torch threads (default: 2)")
    p.add_argument("--new-tokens", type=int, default=17,
                   help="generated tokens for the per-token timing (default: 17)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here (default: none)")
    p.add_argument("--tiny", action="store_true",
                   help="small shapes with the same position tables, to check the script in a minute (default: off)")
    p.add_argument("--phase", default=None, choices=["make", "export", "verify", "generate"],
                   help="run one phase in this process, as the driver does (default: none, the whole run)")
    p.add_argument("--args", default="{}", help="the phase's keyword arguments as JSON (default: {})")
    args = p.parse_args()
    if args.phase:
        fn = {"make": phase_make, "export": phase_export, "verify": phase_verify, "generate": phase_generate}
        print(json.dumps(fn[args.phase](**json.loads(args.args))))
        return 0
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if args.tiny:
        tiny = {"big_bird": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                 vocab_size=1000),
                "bigbird_pegasus": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                        vocab_size=1000)}
        for spec in MODELS.values():
            spec["config"] = tiny[spec["kind"]]
    args.work.mkdir(parents=True, exist_ok=True)
    start, started, load_before = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S %z"), loadavg()
    results = run(args.work, names, args.threads, args.new_tokens)
    print(table(results))
    print(f"\n{len(results)} checkpoints in {(time.perf_counter() - start) / 60:.0f} min, "
          f"threads {args.threads}, {time.strftime('%Y-%m-%d %H:%M')}")
    if args.out:  # docs/benchmarks.md's tables are `table` of this file's "results" (tests/test_benchmark_figures.py)
        args.out.write_text(json.dumps({
            "command": command_line("real_size.py"),
            "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": {"cpus": os.cpu_count(), "processor": cpu_name(),
                        "loadavg_before": load_before,
                        "loadavg_after": loadavg()},
            "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
