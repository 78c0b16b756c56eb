"""Host-path capacity of `longdoc serve`: QA documents per second through the real HTTP service
when the engine costs nothing, on 1, 2, ... cores (the server pinned with `taskset`).

The engine is a null one (`NullWorker`: correctly shaped outputs at once, no ONNX session), so
what is measured is everything the host does per request: HTTP, the body checks, validation,
tokenization, windows, batching, answer shaping and the response. The model directory gives the
real tokenizer and manifest. A benchmark and test fixture, not a serving option: the server runs
as `python bench/host_path.py serve --model-dir DIR [longdoc serve flags]` (the same
`longdoc.service.cli.serve`, with the null engine as its worker factory).

Clients are raw asyncio sockets (HTTP/1.1 keep-alive, prebuilt requests), closed loop: each sends
its next request when the previous is answered, so the client's own cost per request is small
(its CPU seconds per request are printed; on a machine with no spare core it shares the server's).

    python bench/host_path.py --model-dir models/qa --cores 1,2            # this machine (2 cores)
    python bench/host_path.py --model-dir models/qa --cores 1,2,4,8,15 --client-cpus 15   # GPU host

Prints a table, writes a JSON results file (--out) and a plot (--plot). Modes (--mode NAME=FLAGS,
repeatable) are `longdoc serve` flags, `{cores}` replaced by the point's core count: `one-process`
is the default server, `front-ends` runs `--front-ends {cores}` (one front end per core, in front
of the engine process). Numbers and the commands that produced them: docs/benchmarks.md ("The host path").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from common import cpu_name

QUESTION = "where is the gold"
DEFAULT_MODES = ("one-process=", "front-ends=--front-ends {cores}")


# ---------------------------------------------------------------------------------------------
# the null engine (server side)


class NullWorker:
    """A worker whose outputs have the right shapes and come at once: qa (B, S) start and end
    logits, classify (B, labels) logits. The host path is all that is left to measure.

    The logits are a fixed random table, not zeros: answer shaping over flat logits is a
    degenerate case (every span ties, and numpy's partition takes 4x as long as on a model's)."""

    overlaps_encoding = False

    def __init__(self, info, max_batch_tokens: int):
        self.info = info
        self.device = "cpu"
        self.max_batch_tokens = max_batch_tokens
        if info.task not in ("qa", "classify"):
            raise ValueError(f"the null engine serves qa and classify, not {info.task}")
        self.table = np.random.default_rng(0).standard_normal((2, info.max_length)).astype(np.float32)

    def health(self) -> bool:
        return True

    def warmup(self) -> None:
        pass

    def run(self, batch) -> dict[str, np.ndarray]:
        b, s = batch.input_ids.shape
        if self.info.task == "qa":
            return {"start_logits": np.tile(self.table[0, :s], (b, 1)), "end_logits": np.tile(self.table[1, :s], (b, 1))}
        return {"logits": np.tile(self.table[0, : len(self.info.labels or (0, 1))], (b, 1))}

    def close(self) -> None:
        pass


def null_worker_factory(name: str, directory: Path, device: str, settings) -> NullWorker:
    """create_app's worker factory: the model's manifest and tokenizer, no ONNX session."""
    from tokenizers import Tokenizer

    from longdoc.export.manifest import Manifest
    from longdoc.service.workers import _info_from_model

    manifest = Manifest.load(directory)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    info = _info_from_model(name, Path(directory), SimpleNamespace(manifest=manifest, tokenizer=tokenizer))
    return NullWorker(info, settings.batch_tokens_for(device))


def serve_null(argv: list[str]) -> int:
    """`longdoc serve ARGV` with the null engine."""
    from longdoc.service import cli

    parser = argparse.ArgumentParser(prog="host_path.py serve")
    cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *argv])
    return cli.serve(args, worker_factory=null_worker_factory)


# ---------------------------------------------------------------------------------------------
# the client


def make_document(tokenizer, n_tokens: int, seed: int) -> str:
    """A document of n_tokens tokens (without specials), from the tokenizer's own words."""
    vocab = [w for w, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
             if w.isalpha() and w.isascii() and len(w) > 1]
    rng = np.random.default_rng(seed)
    text = " ".join(vocab[i] for i in rng.integers(0, len(vocab), n_tokens * 2))
    enc = tokenizer.encode(text, add_special_tokens=False)
    return text[: enc.offsets[n_tokens - 1][1]] if len(enc.ids) > n_tokens else text


def http_request(port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST /v1/qa HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def closed_loop(port: int, requests: list[bytes], concurrency: int, warmup_s: float,
                      duration_s: float, server_pid: int | None = None) -> dict:
    """`concurrency` keep-alive connections, each sending its next request when answered; counts
    the answers that arrive within the `duration_s` after `warmup_s`, and the CPU seconds the
    server process (`server_pid`) and its children spent meanwhile."""
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    cpu_samples = []
    if server_pid is not None:
        loop.call_later(warmup_s, lambda: cpu_samples.append(cpu_seconds(server_pid)))
        loop.call_later(warmup_s + duration_s, lambda: cpu_samples.append(cpu_seconds(server_pid)))
    begin, end = t0 + warmup_s, t0 + warmup_s + duration_s
    done, errors, latency, total_ms, tokenize_ms = 0, [], [], [], []

    async def one_client(i: int) -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            k = i
            while time.monotonic() < end:
                sent = time.monotonic()
                writer.write(requests[k % len(requests)])
                k += concurrency
                status, headers, body = await read_response(reader)
                now = time.monotonic()
                if status != 200:
                    errors.append(f"{status} {body[:200]!r}")
                    if len(errors) > 20:
                        raise RuntimeError(f"server errors: {errors[:3]}")
                    continue
                if begin <= now <= end:
                    done += 1
                    latency.append(now - sent)
                    total_ms.append(float(headers["x-total-time"]))
                    tokenize_ms.append(float(headers["x-tokenization-time"]))
        finally:
            writer.close()

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    client_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    cpu = {}
    if len(cpu_samples) == 2 and done:
        (main0, pool0), (main1, pool1) = cpu_samples
        cpu = {"server_cores_busy": (main1 + pool1 - main0 - pool0) / duration_s,
               "loop_cpu_ms_per_doc": 1000 * (main1 - main0) / done,
               "pool_cpu_ms_per_doc": 1000 * (pool1 - pool0) / done}
    return {**cpu,
        "docs_per_s": done / duration_s, "requests": done,
        "latency_p50_ms": float(np.percentile(latency, 50) * 1000) if latency else None,
        "server_total_ms": float(np.mean(total_ms)) if total_ms else None,
        "server_tokenize_ms": float(np.mean(tokenize_ms)) if tokenize_ms else None,
        "client_cpu_ms_per_request": 1000 * client_cpu / max(1, done),
    }


def _proc_cpu(pid: int) -> float:
    """utime + stime of one process, seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the server process `pid` (with --front-ends: the engine) and of its live
    child processes (the front ends)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return _proc_cpu(pid), sum(_proc_cpu(c) for c in children)


# ---------------------------------------------------------------------------------------------
# the sweep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(f"GET /readyz HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)  # polling a subprocess's start-up
    proc.kill()
    raise SystemExit(f"the server was not ready within {timeout_s:g} s")


def measure(args, cpus: list[int], flags: list[str], requests_for) -> dict:
    port = free_port()
    cmd = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, str(Path(__file__).resolve()), "serve",
           "--model", f"bench={args.model_dir}", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--max-batch-tokens", str(args.max_batch_tokens),
           "--max-batch-size", str(args.max_batch_size), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None if args.verbose else subprocess.DEVNULL)
    try:
        wait_ready(proc, port)
        result = asyncio.run(closed_loop(port, requests_for(port), args.concurrency, args.warmup, args.duration,
                                          proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"command": shlex.join(cmd), **result}


def summarize(results: list[dict]) -> list[dict]:
    """Per (mode, cores): the median docs/s over the rounds, and its ratio to the mode's 1-core median."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        for n in dict.fromkeys(r["cores"] for r in results if r["mode"] == mode):
            rows = [r for r in results if r["mode"] == mode and r["cores"] == n]
            med = lambda key: round(float(np.median([r.get(key, 0.0) for r in rows])), 2)  # noqa: E731
            out.append({"mode": mode, "cores": n, "doc_tokens": rows[0]["doc_tokens"], "rounds": len(rows),
                        "docs_per_s": med("docs_per_s"), "server_cores_busy": med("server_cores_busy"),
                        "loop_cpu_ms_per_doc": med("loop_cpu_ms_per_doc"),
                        "pool_cpu_ms_per_doc": med("pool_cpu_ms_per_doc"), "load_average": med("load_average")})
    for row in out:
        one = [o for o in out if o["mode"] == row["mode"] and o["cores"] == 1]
        if one and row["cores"] != 1:
            row["vs_1_core"] = round(row["docs_per_s"] / one[0]["docs_per_s"], 2)
    return out


def markdown_table(summary: list[dict]) -> str:
    """The summary as docs/service.md shows it (a test compares the two)."""
    lines = ["| mode | server cores | docs/s | vs 1 core | cores busy | main process CPU ms/doc | "
             "child processes CPU ms/doc | load average |", "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        ratio = f"{r['vs_1_core']:.2f}x" if "vs_1_core" in r else "-"
        lines.append(f"| {r['mode']} | {r['cores']} | {r['docs_per_s']:.1f} | {ratio} | "
                     f"{r['server_cores_busy']:.2f} | {r['loop_cpu_ms_per_doc']:.1f} | {r['pool_cpu_ms_per_doc']:.1f} | "
                     f"{r['load_average']:.1f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rows = [r for r in results if r["mode"] == mode]
        ax.plot([r["cores"] for r in rows], [r["docs_per_s"] for r in rows], marker="o", label=mode)
    cores = sorted({r["cores"] for r in results})
    ax.set_xticks(cores)
    ax.set_xlabel("server cores (taskset)")
    ax.set_ylabel("QA documents / s")
    ax.set_title(f"host path, null engine ({results[0]['doc_tokens']}-token documents)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_null(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="models/qa",
                   help="an exported QA model (its tokenizer and manifest) (default: %(default)s)")
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document (default: %(default)s)")
    p.add_argument("--documents", type=int, default=16,
                   help="distinct documents, sent round-robin (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="client connections (default: %(default)s)")
    p.add_argument("--cores", default="1,2",
                   help="server core counts to measure, comma-separated (default: %(default)s)")
    p.add_argument("--client-cpus", default=None,
                   help="pin the client to these CPUs (e.g. 15) (default: none, unpinned)")
    p.add_argument("--mode", action="append", metavar="NAME=FLAGS",
                   help=f"a server configuration: extra `longdoc serve` flags (repeatable; default: "
                        f"{'; '.join(DEFAULT_MODES)})")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured per point (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over all points (the table gives medians) (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=65536,
                   help="batch budget (as on a GPU) (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=32,
                   help="the server's --max-batch-size (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: none)")
    p.add_argument("--plot", type=Path, default=None, help="plot (PNG) (default: none)")
    p.add_argument("--verbose", action="store_true", help="show the server's stderr (default: off)")
    args = p.parse_args(argv)

    from tokenizers import Tokenizer

    if args.client_cpus:
        os.sched_setaffinity(0, [int(c) for c in args.client_cpus.split(",")])
    tokenizer = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    docs = [make_document(tokenizer, args.doc_tokens, seed) for seed in range(args.documents)]
    requests_for = lambda port: [http_request(port, {"question": QUESTION, "document": d}) for d in docs]  # noqa: E731
    allowed = sorted(os.sched_getaffinity(0) if not args.client_cpus else range(os.cpu_count() or 1))
    modes = [m.partition("=") for m in (args.mode or DEFAULT_MODES)]
    results = []
    print(f"{'mode':12s} {'cores':>5s} {'docs/s':>7s} {'p50 ms':>7s} {'server ms':>9s} {'tokenize ms':>11s} "
          f"{'cores busy':>10s} {'main cpu ms/doc':>15s} {'child cpu ms/doc':>16s} {'client cpu ms/doc':>17s} "
          f"{'load':>5s}", flush=True)
    cores = [int(c) for c in args.cores.split(",")]
    if max(cores) > len(allowed):
        raise SystemExit(f"--cores {max(cores)}: only {len(allowed)} CPUs")
    for round_ in range(args.repeat):  # rounds interleave the points: a machine whose load drifts drifts for all
        for name, _, flags in modes:
            for n in cores:
                load = os.getloadavg()[0]
                r = measure(args, allowed[:n], shlex.split(flags.replace("{cores}", str(n))), requests_for)
                r.update(mode=name, cores=n, flags=flags, doc_tokens=args.doc_tokens, concurrency=args.concurrency,
                         round=round_, load_average=load)
                results.append(r)
                print(f"{name:12s} {n:5d} {r['docs_per_s']:7.1f} {r['latency_p50_ms'] or 0:7.1f} "
                      f"{r['server_total_ms'] or 0:9.1f} {r['server_tokenize_ms'] or 0:11.1f} "
                      f"{r.get('server_cores_busy', 0):10.2f} {r.get('loop_cpu_ms_per_doc', 0):15.2f} "
                      f"{r.get('pool_cpu_ms_per_doc', 0):16.2f} {r['client_cpu_ms_per_request']:17.2f} "
                      f"{load:5.1f}", flush=True)
    summary = summarize(results)
    print(f"\nmedians of {args.repeat} round(s):\n" + markdown_table(summary))
    if args.out:
        args.out.write_text(json.dumps({"command": shlex.join([sys.executable, *sys.argv]), "cpu": cpu_name(),
                                        "cpus": os.cpu_count(), "summary": summary, "results": results},
                                       indent=2) + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
