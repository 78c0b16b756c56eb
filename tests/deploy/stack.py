"""Real processes for the deployment tests: the service under uvicorn, a Prometheus scraping it,
and a bounded loopback load. Everything listens on 127.0.0.1 and stops by itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.deploy.conftest import ROOT

WORDS = ("the river runs north to the sea and the old man saw the ship near the island "
         "while children play in the green field by the school every morning").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None,
             alive=None) -> None:
    """Until `url` answers 200; fails early when `proc` exited or `alive()` says False."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited {proc.returncode}: {_tail(log)}")
        if alive is not None and not alive():
            raise RuntimeError(f"{url}: the server is gone")
        try:
            if get(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s: {_tail(log)}")


def _tail(log: Path | None) -> str:
    return log.read_text()[-3000:] if log and log.exists() else ""


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextmanager
def service(models: dict[str, Path], log: Path, **settings):
    """`uvicorn --factory longdoc.service.app:create_app` with LONGDOC_* settings; yields its base URL."""
    port = free_port()
    env = dict(os.environ, LONGDOC_MODELS=json.dumps({k: str(v) for k, v in models.items()}), LONGDOC_THREADS="1",
               **{f"LONGDOC_{k.upper()}": str(v) for k, v in settings.items()})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "longdoc.service.app:create_app", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url + "/readyz", 120, proc, log)
        yield url
    finally:
        stop(proc)


@contextmanager
def prometheus(binary: str, target: str, rules: list[Path], workdir: Path, labels: dict[str, str]):
    """A Prometheus scraping `target` (host:port) every second as job "longdoc"; yields its URL."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(r) for r in rules],
        "scrape_configs": [{"job_name": "longdoc", "static_configs": [{"targets": [target], "labels": labels}]}],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url + "/-/ready", 60, proc, log)
        yield url
    finally:
        stop(proc)


def instant_query(prometheus_url: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    status, body = get(f"{prometheus_url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=30)
    data = json.loads(body)
    if status != 200 or data.get("status") != "success":
        raise AssertionError(f"{expr}: {status} {data}")
    return data["data"]["result"]


def document(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words)) + " ."


def load(base_url: str, duration_s: float, concurrency: int = 6, max_requests: int = 20000) -> dict[int, int]:
    """Mixed requests for `duration_s` (bounded in time and count): QA across length buckets (short,
    multi-block, several windows), classification, short summaries, and some invalid bodies.
    Returns the count of each HTTP status."""
    import httpx

    lengths = (12, 60, 150, 300, 700)  # words ~ tokens: several length buckets, > 512 gives windows
    statuses: dict[int, int] = {}

    async def client(worker: int, http: httpx.AsyncClient, end: float, counter: list[int]):
        i = worker
        while time.monotonic() < end and counter[0] < max_requests:
            counter[0] += 1
            kind = i % 10
            n = lengths[(i // 10 + worker) % len(lengths)]
            if kind < 5:
                path, body = "/v1/qa", {"question": "where does the river run", "document": document(n, i)}
            elif kind < 7:
                path, body = "/v1/classify", {"document": document(n, i)}
            elif kind < 9:  # every other one streamed (longdoc_time_to_first_token_seconds)
                path, body = "/v1/summarize", {"document": document(min(n, 200), i), "max_new_tokens": 6,
                                               "stream": kind == 8}
            else:
                path, body = "/v1/qa", {"question": "why", "document": "   "}  # 422
            try:
                r = await http.post(path, json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            except httpx.HTTPError:
                statuses[-1] = statuses.get(-1, 0) + 1
            i += concurrency

    async def main():
        end = time.monotonic() + duration_s
        counter = [0]
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            await asyncio.gather(*(client(w, http, end, counter) for w in range(concurrency)))

    asyncio.run(main())
    return statuses
