"""Slow and huge uploads against `longdoc serve`'s HTTP stack (fake workers, no model): how long
slow-header connections are held, and what 20 connections that send 29 MB and go quiet hold.

    python bench/slow_clients.py [--connections 300] [--uploads 20] [--upload-mb 29]

Prints one JSON object. Runs a server subprocess on a loopback port with the default limits
(service/settings.py) unless flags override them; about header_timeout_s + body_timeout_s seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve(port: int, overrides: dict) -> None:
    import uvicorn

    from longdoc.service.app import create_app
    from longdoc.service.connections import limited_protocol
    from longdoc.service.settings import Settings
    from longdoc.testing.fake_worker import FakeWorker

    settings = Settings(models={"cls": "classify"}, port=port, **overrides)
    app = create_app(settings, worker_factory=lambda name, d, device, s: FakeWorker(name=name, task=str(d)))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error",
                http=limited_protocol(settings))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def status_of(reader) -> int | None:
    line = await reader.readline()
    return int(line.split()[1]) if line.startswith(b"HTTP/") else None


async def slow_headers(port: int, n: int) -> dict:
    """n connections sending a header a byte a second: when (and how) the server ends each."""
    start = time.monotonic()

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /livez HTTP/1.1\r\nx-slow: ")
        status = None
        try:
            while True:
                try:
                    status = await asyncio.wait_for(status_of(reader), 1.0)
                    break
                except TimeoutError:
                    writer.write(b"a")
                    await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()
        return status, time.monotonic() - start

    results = await asyncio.gather(*(one() for _ in range(n)))
    held = [t for _, t in results]
    return {"connections": n, "statuses": {str(s): sum(1 for r in results if r[0] == s) for s in {r[0] for r in results}},
            "held_max_s": round(max(held), 1), "held_min_s": round(min(held), 1)}


async def quiet_uploads(port: int, n: int, mb: int, pid: int) -> dict:
    """n connections each declaring mb+1 MiB, sending mb MiB and going quiet."""
    start = time.monotonic()
    body = b'{"document": "' + b"a" * (mb * 2**20)
    rss_before = rss_mib(pid)
    peak = [rss_before]

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (len(body) + 2**20))
        try:
            writer.write(body)
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        status = await status_of(reader)
        writer.close()
        return status, time.monotonic() - start

    async def watch():
        while True:
            peak[0] = max(peak[0], rss_mib(pid))
            await asyncio.sleep(0.2)

    watcher = asyncio.ensure_future(watch())
    results = await asyncio.gather(*(one() for _ in range(n)))
    watcher.cancel()
    return {"uploads": n, "upload_mib": mb,
            "statuses": {str(s): sum(1 for r in results if r[0] == s) for s in {r[0] for r in results}},
            "held_max_s": round(max(t for _, t in results), 1),
            "server_rss_mib_before": round(rss_before), "server_rss_mib_peak": round(peak[0]),
            "server_rss_mib_after": round(rss_mib(pid))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=300, help="slow-header connections (default 300)")
    p.add_argument("--uploads", type=int, default=20, help="quiet uploads (default 20)")
    p.add_argument("--upload-mb", type=int, default=29, help="MiB each upload sends before going quiet (default 29)")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                   help="a service setting for the server, e.g. body_timeout_s=5 (default: none)")
    p.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.setting)
    if args.serve_port:
        serve(args.serve_port, overrides)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve-port", str(port), *sum((["--setting", kv] for kv in args.setting), [])]
    server = subprocess.Popen(cmd, cwd=ROOT)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        out = {"slow_headers": asyncio.run(slow_headers(port, args.connections)),
               "quiet_uploads": asyncio.run(quiet_uploads(port, args.uploads, args.upload_mb, server.pid))}
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
