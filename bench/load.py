"""Load generator for `longdoc serve` (asyncio + httpx, loopback only, bounded in requests and time).

Starts the server itself (one subprocess per batching mode) on 127.0.0.1, sweeps client
concurrency, and prints throughput and p50/p95/p99 latency, with dynamic batching on and off.
Also measures the offline throughput of the same model at several batch sizes
(longdoc.export.runtime.OnnxModel, no HTTP; the reference is the best of them), open-loop latency at a
fraction of saturation for Poisson and paced arrivals next to an ideal FIFO server replaying the
same send times (service time = offline batch-1 latency: the queueing a perfect server would
show too), and the service overhead: client latency minus the server's x-inference-time.

    python bench/load.py --model-dir models/qa --doc-tokens 1024 --concurrency 1,4,16,32

Numbers and the commands that produced them: docs/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

QUESTION = "where is the gold"


def make_document(tokenizer, n_tokens: int, seed: int) -> str:
    """A document of exactly n_tokens tokens (without specials), from the tokenizer's own words."""
    vocab = [w for w, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
             if w.isalpha() and w.isascii() and len(w) > 1]
    rng = np.random.default_rng(seed)
    words = [vocab[i] for i in rng.integers(0, len(vocab), n_tokens * 2)]
    text = " ".join(words[:n_tokens])
    enc = tokenizer.encode(text, add_special_tokens=False)
    if len(enc.ids) > n_tokens:  # subword tokenizers: cut at the n-th token's end
        text = text[: enc.offsets[n_tokens - 1][1]]
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, batching: bool, threads: int | None, extra: list[str],
                 python: str = sys.executable) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [python, "-m", "longdoc", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", f"bench={model_dir}", "--log-level", "warning", *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    if not batching:
        cmd.append("--no-batching")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", " ".join(cmd))


def wait_ready(proc: subprocess.Popen, url: str, what: str, timeout_s: float = 300) -> str:
    """`url` once the server process started as `proc` answers /readyz 200; SystemExit if it exits
    or is not ready within `timeout_s` (the one start-up wait of the bench scripts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling a subprocess's start-up; not ordering within the program
    proc.kill()
    raise SystemExit(f"{what} did not become ready in {timeout_s:g} s")


def request_for(task: str, doc: str, question: str = QUESTION, max_new_tokens: int = 32) -> tuple[str, dict]:
    if task == "qa":
        return "/v1/qa", {"question": question, "document": doc}
    if task == "classify":
        return "/v1/classify", {"document": doc}
    return "/v1/summarize", {"document": doc, "max_new_tokens": max_new_tokens}


async def sweep_point(url: str, task: str, docs: list[str], concurrency: int, n_requests: int,
                      max_seconds: float) -> dict:
    """n_requests requests from `concurrency` clients (or until max_seconds), closed loop."""
    latencies, inference, server_total, codes = [], [], [], []
    issued = 0
    stop_at = time.monotonic() + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one_client():
            nonlocal issued
            while issued < n_requests and time.monotonic() < stop_at:
                doc = docs[issued % len(docs)]
                issued += 1
                path, body = request_for(task, doc)
                t = time.perf_counter()
                r = await client.post(path, json=body)
                latencies.append(time.perf_counter() - t)
                codes.append(r.status_code)
                if r.status_code == 200:
                    inference.append(float(r.headers.get("x-inference-time", "nan")) / 1000)
                    server_total.append(float(r.headers.get("x-total-time", "nan")) / 1000)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [lat for lat, c in zip(latencies, codes) if c == 200]
    q = np.percentile(ok, [50, 95, 99]) if ok else [float("nan")] * 3
    return {"concurrency": concurrency, "requests": len(codes), "ok": len(ok), "seconds": wall,
            "mean_ms": statistics.fmean(ok) * 1000 if ok else float("nan"),
            "throughput_rps": len(ok) / wall, "p50_ms": q[0] * 1000, "p95_ms": q[1] * 1000, "p99_ms": q[2] * 1000,
            "inference_ms": statistics.fmean(inference) * 1000 if inference else float("nan"),
            "server_total_ms": statistics.fmean(server_total) * 1000 if server_total else float("nan")}


def arrival_times(kind: str, rate: float, n: int, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: "poisson" (exponential gaps, mean 1/rate) or
    "paced" (a constant gap of 1/rate: the same mean rate without bursts)."""
    if kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    elif kind == "paced":
        gaps = np.full(n, 1.0 / rate)
    else:
        raise ValueError(f"arrivals {kind!r}: poisson or paced")
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def ideal_fifo(arrivals, service_s: float) -> np.ndarray:
    """Latencies of an ideal single FIFO server with a constant service time (no overhead, no
    batching) for these arrival times: each request starts when it arrives or when the one before
    it finishes, whichever is later (M/D/1 for Poisson arrivals, D/D/1 for paced ones)."""
    free, out = -np.inf, []
    for a in arrivals:
        free = max(a, free) + service_s
        out.append(free - a)
    return np.asarray(out)


def _percentiles(latencies_s) -> dict:
    q = np.percentile(latencies_s, [50, 95, 99]) * 1000 if len(latencies_s) else [float("nan")] * 3
    return {"p50_ms": q[0], "p95_ms": q[1], "p99_ms": q[2], "p99_over_p50": q[2] / q[0]}


async def open_loop(url: str, task: str, docs: list[str], arrivals: np.ndarray) -> dict:
    """One request at each planned time in `arrivals` (seconds from the start, independent of the
    answers). Records the actual send times, which the ideal-server replay uses."""
    latencies, codes, sent = {}, {}, {}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        async def one(i):
            path, body = request_for(task, docs[i % len(docs)])
            t = time.perf_counter()
            sent[i] = t - start
            r = await client.post(path, json=body)
            latencies[i] = time.perf_counter() - t
            codes[i] = r.status_code

        tasks, start = [], time.perf_counter()
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = [latencies[i] for i in sorted(latencies) if codes[i] == 200]
    send_times = np.array([sent[i] for i in sorted(sent)])
    lag = send_times - np.asarray(arrivals)[: len(send_times)]
    return {"requests": len(arrivals), "ok": len(ok), "seconds": wall, "send_times": send_times.tolist(),
            "max_send_lag_ms": float(lag.max() * 1000), **_percentiles(ok)}


def offline_throughput(model_dir: str, task: str, docs: list[str], batch_size: int, threads: int | None,
                       max_seconds: float) -> float:
    """Documents per second running the model directly in batches (no HTTP, no queue)."""
    from longdoc.export.runtime import OnnxModel

    from longdoc.export.windows import classify_windows, qa_windows

    m = OnnxModel(model_dir, threads=threads)
    tok = m.tokenizer
    sp = m.manifest.special_tokens
    cls = sp.get("cls") or tok.token_to_id("[CLS]")
    sep = sp.get("sep") or tok.token_to_id("[SEP]")
    q = tok.encode(QUESTION, add_special_tokens=False).ids
    seqs = []
    for doc in docs:
        ids = tok.encode(doc, add_special_tokens=False).ids
        if task == "qa":
            seqs += [w.input_ids for w in qa_windows(q, ids, m.manifest.max_length, None, cls, sep)]
        else:
            seqs += classify_windows(ids, m.manifest.max_length, None, cls, sep)
    per_doc = len(seqs) / len(docs)
    longest = max(len(s) for s in seqs)
    ids = np.zeros((batch_size, longest), np.int64)
    mask = np.zeros_like(ids)
    for i in range(batch_size):
        s = seqs[i % len(seqs)]
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    m.run_encoder(ids, mask)  # warm
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < max_seconds or done == 0:
        m.run_encoder(ids, mask)
        done += batch_size
    return done / per_doc / (time.perf_counter() - start)


BENCH_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                   block_size=64, num_random_blocks=3, max_position_embeddings=4096)


def make_bench_model(directory: str, task: str) -> None:
    """A random-weight BigBird of BENCH_MODEL's shape (block 64, up to 4096 tokens), exported.
    Needs torch + transformers (the dev install); the numbers do not depend on the weights."""
    import torch

    from longdoc.export.exporter import export_model
    from longdoc.testing.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(1)
    checkpoint = make_tiny_checkpoint(Path(directory + "-checkpoint"), task, **BENCH_MODEL)
    export_model(checkpoint, Path(directory), task, dtype="fp32", plan="hf-train", progress=print)


def main() -> int:
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # stop the server subprocess on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="an exported model directory (qa or classify)")
    ap.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,4,16,32",
                    help="client concurrencies to sweep, comma-separated (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=64, help="per sweep point (default: %(default)s)")
    ap.add_argument("--max-seconds", type=float, default=60, help="per sweep point (default: %(default)s)")
    ap.add_argument("--modes", default="on,off", help="dynamic batching: on, off or on,off (default: %(default)s)")
    ap.add_argument("--offline-seconds", type=float, default=10, help="per offline batch size (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (server and offline) (default: none, the server's and ONNX Runtime's own)")
    ap.add_argument("--offline-batch", default="1,2,4,8",
                    help="offline batch sizes (comma-separated); the reference is the best of them"
                         " (default: %(default)s)")
    ap.add_argument("--overhead-doc-tokens", type=int, default=None,
                    help="also measure service overhead at concurrency 1 on documents of this many tokens"
                         " (default: none, not measured)")
    ap.add_argument("--open-loop-fraction", type=float, default=0.7,
                    help="with batching on, also send open-loop arrivals (--arrivals) at this fraction of the "
                         "best throughput, and replay them through an ideal FIFO server (offline batch-1 time)"
                         " (default: %(default)s)")
    ap.add_argument("--arrivals", default="poisson,paced",
                    help="open-loop arrival processes: poisson (exponential gaps) and/or paced (constant gaps)"
                         " (default: %(default)s)")
    ap.add_argument("--open-loop-requests", type=int, default=None,
                    help="requests per open-loop run (default: max(--requests, 200))")
    ap.add_argument("--json", help="write the results here too (default: none)")
    ap.add_argument("--make-model", metavar="TASK", help="first export a random bench model of this task "
                    "(qa or classify) to --model-dir (needs torch; default: none)")
    args = ap.parse_args()
    if args.make_model:
        make_bench_model(args.model_dir, args.make_model)

    from tokenizers import Tokenizer

    manifest = json.loads((Path(args.model_dir) / "manifest.json").read_text())
    task = manifest["task"]
    tok = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    docs = [make_document(tok, args.doc_tokens, seed) for seed in range(16)]
    results = {"task": task, "doc_tokens": args.doc_tokens, "cpu_count": os.cpu_count(), "modes": {}}
    print(f"# {task} model {args.model_dir}: max_length {manifest['max_length']}, block {manifest['block_size']}, "
          f"{manifest['num_layers']} layers, hidden {manifest['hidden_size']}; documents of {args.doc_tokens} tokens")

    if task != "summarize":
        offline = {}
        for b in [int(x) for x in args.offline_batch.split(",")]:
            offline[b] = offline_throughput(args.model_dir, task, docs, b, args.threads, args.offline_seconds)
            print(f"offline (batch {b}, no HTTP): {offline[b]:.2f} docs/s", flush=True)
        best_batch = max(offline, key=offline.get)
        results["offline"] = {str(b): r for b, r in offline.items()}
        results["offline_best_batch"] = best_batch
        results["offline_docs_per_s"] = offline[best_batch]
        print(f"offline reference (best batch size, {best_batch}): {offline[best_batch]:.2f} docs/s")

    for mode in args.modes.split(","):
        proc, url = start_server(args.model_dir, mode == "on", args.threads, [])
        try:
            rows = []
            print(f"\n## dynamic batching {mode}\n")
            print("| concurrency | requests | ok | throughput (req/s) | p50 ms | p95 ms | p99 ms | mean inference ms |")
            print("|---|---|---|---|---|---|---|---|")
            for c in [int(x) for x in args.concurrency.split(",")]:
                row = asyncio.run(sweep_point(url, task, docs, c, args.requests, args.max_seconds))
                rows.append(row)
                print(f"| {c} | {row['requests']} | {row['ok']} | {row['throughput_rps']:.2f} | {row['p50_ms']:.0f} | "
                      f"{row['p95_ms']:.0f} | {row['p99_ms']:.0f} | {row['inference_ms']:.0f} |", flush=True)
            results["modes"][mode] = rows
            if mode == "on" and args.open_loop_fraction:
                saturation = max(r["throughput_rps"] for r in rows)
                rate = args.open_loop_fraction * saturation
                service_s = 1.0 / results["offline"]["1"] if "1" in results.get("offline", {}) else None
                results["open_loop"] = {"saturation_rps": saturation, "rate_rps": rate,
                                        "ideal_service_ms": service_s and service_s * 1000}
                n_open = args.open_loop_requests or max(args.requests, 200)
                for kind in args.arrivals.split(","):
                    row = asyncio.run(open_loop(url, task, docs, arrival_times(kind, rate, n_open)))
                    line = (f"\nopen loop, {kind} arrivals at {args.open_loop_fraction:.0%} of saturation "
                            f"({rate:.2f} req/s, {row['ok']}/{n_open} ok): measured p50 {row['p50_ms']:.0f} ms, "
                            f"p95 {row['p95_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms (p99/p50 {row['p99_over_p50']:.2f})")
                    if service_s:
                        ideal = _percentiles(ideal_fifo(row["send_times"], service_s))
                        row["ideal_fifo"] = ideal
                        line += (f"\n  ideal FIFO server, same send times, service {service_s * 1000:.1f} ms "
                                 f"(offline batch 1): p50 {ideal['p50_ms']:.0f} ms, p95 {ideal['p95_ms']:.0f} ms, "
                                 f"p99 {ideal['p99_ms']:.0f} ms (p99/p50 {ideal['p99_over_p50']:.2f})")
                    results["open_loop"][kind] = row
                    print(line, flush=True)
            if mode == "on" and args.overhead_doc_tokens:
                long_docs = [make_document(tok, args.overhead_doc_tokens, 100 + s) for s in range(4)]
                row = asyncio.run(sweep_point(url, task, long_docs, 1, 8, args.max_seconds))
                overhead = (row["mean_ms"] - row["inference_ms"]) / row["inference_ms"]
                in_server = (row["server_total_ms"] - row["inference_ms"]) / row["inference_ms"]
                results["overhead"] = dict(row, overhead_ratio=overhead, server_overhead_ratio=in_server,
                                           doc_tokens=args.overhead_doc_tokens)
                print(f"\nservice overhead at {args.overhead_doc_tokens} tokens, concurrency 1: client mean "
                      f"{row['mean_ms']:.0f} ms, server total {row['server_total_ms']:.0f} ms, inference "
                      f"{row['inference_ms']:.0f} ms -> overhead {100 * overhead:.1f}% of inference as the client "
                      f"sees it, {100 * in_server:.1f}% inside the server (tokenize + queue + postprocess)")
        finally:
            proc.terminate()
            proc.wait(60)
    if "offline_docs_per_s" in results:
        ref = results["offline_docs_per_s"]
        for mode, rows in results["modes"].items():
            ratios = ", ".join(f"{r['concurrency']}: {r['throughput_rps'] / ref:.2f}x" for r in rows)
            print(f"\nbatching {mode}: service throughput / best offline "
                  f"(batch {results['offline_best_batch']}, {ref:.2f} docs/s) by concurrency: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
