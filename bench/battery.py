"""The reliability battery (issues 12 and 29) against a real `longdoc serve` (settings: start_server):
hostile inputs (/livez p99 and worst), 4x open-loop overload (admitted p99, Retry-After honesty,
small requests beside a large one), a mixed soak (server RSS), an idle-connection flood (probes
answered meanwhile), protocol errors and request smuggling (JSON, connection closed), SIGTERM under
4x load, and on a fresh server with an API key: wrong keys (throttled) then SIGINT twice under 4x
load. Prints one table, saves JSON.

    python bench/battery.py [--url URL] [--json battery.json]

Without --url it starts `longdoc serve --threads 2` on the shipped models/ (and always starts a
fresh one for each signal part, which needs the process). About 5-10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

# bench/ is a folder of scripts: run as one, a script's own folder is on sys.path
import load
from load import free_port, wait_ready  # one port picker, one start-up wait
from slow_clients import rss_mib  # one VmRSS reader

ROOT = Path(__file__).resolve().parents[1]

SMALL_DOC = "The committee met on Tuesday and approved the budget for the new library. " * 4
QUESTION = "When did the committee meet?"
# the overload's request: classify of about 2,000 tokens (a few per second on 2 cores)
OVERLOAD_DOC = ("The committee met on Tuesday and approved the budget for the new library, after a long "
                "debate about the cost of books, staff and the roof. ") * 80


def request_for(task: str, document: str) -> tuple[str, dict]:
    return load.request_for(task, document, question=QUESTION, max_new_tokens=16)


def outcome(response: httpx.Response | None) -> str:
    """'200', or '<status> <error.type>' for the one error shape, or 'BAD <status>' for anything else
    (plain text, generic 5xx, a transport failure)."""
    if response is None:
        return "BAD transport"
    if isinstance(response, httpx.ConnectError):  # listener closed (shutdown): never admitted
        return "connect refused"
    if response.status_code == 200:
        return "200"
    try:
        kind = response.json()["error"]["type"]
    except Exception:
        return f"BAD {response.status_code}"
    return f"BAD {response.status_code} {kind}" if response.status_code in (500, 502, 504) else \
        f"{response.status_code} {kind}"


def p99(values) -> float:
    return float(np.percentile(values, 99)) if len(values) else float("nan")


def start_server(threads: int, log_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    models = [f"--model={task}={ROOT / 'models' / task}" for task in ("qa", "classify", "summarize")]
    # body timeout 15 s (default 60): the hostile part's slow upload (20 s) must meet it while it
    # trickles; every other setting is the default (the queue: 262144 tokens and max_queue_wait_s 10)
    proc = subprocess.Popen([sys.executable, "-m", "longdoc", "serve", "--port", str(port), "--threads",
                             str(threads), "--log-level", "warning", "--body-timeout-s", "15", *models],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, **(env or {})))
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", f"longdoc serve (log: {log_path})")


def hostile(url: str, seconds_each: float) -> dict:
    """/livez probed every 20 ms while 2 MB documents, a 500k-key object and a slow upload arrive."""
    document = json.dumps({"document": " ".join(f"w{i % 200}" for i in range(440_000))}).encode()
    keys = json.dumps({f"k{i}": 1 for i in range(500_000)}).encode()
    # 16 documents of 1.9 MB: a 30 MB body, within the body limit (16 x 2 MB + 64 KiB)
    many = json.dumps({"documents": [" ".join(f"w{i % 200}" for i in range(420_000))] * 16}).encode()
    outcomes, probes = Counter(), []
    port = int(url.rsplit(":", 1)[1])

    def slow_upload():
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 100000\r\n\r\n")
            end = time.monotonic() + seconds_each
            try:
                while time.monotonic() < end:
                    s.sendall(b" " * 100)
                    time.sleep(0.1)
            except OSError:
                pass
            s.settimeout(5)
            try:
                line = s.recv(200).split(b"\r\n")[0]
                outcomes[f"slow upload {line.split()[1].decode()}" if line.startswith(b"HTTP/") else "slow upload closed"] += 1
            except OSError:
                outcomes["slow upload closed"] += 1

    def big(body: bytes):
        end = time.monotonic() + seconds_each
        while time.monotonic() < end:
            try:
                outcomes[outcome(httpx.post(url + "/v1/classify", content=body, timeout=120,
                                            headers={"content-type": "application/json"}))] += 1
            except httpx.TransportError:
                outcomes["BAD transport"] += 1

    workers = [threading.Thread(target=f, args=a) for f, a in ((big, (document,)), (big, (keys,)), (big, (many,)),
                                                                      (slow_upload, ()))]
    for w in workers:
        w.start()
    with httpx.Client(base_url=url, timeout=30) as client:
        while any(w.is_alive() for w in workers):
            start = time.monotonic()
            client.get("/livez")
            probes.append(time.monotonic() - start)
            time.sleep(0.02)
    figure = p99(probes)
    return dict(part="hostile inputs: /livez p99 (worst)", requests=sum(outcomes.values()) + len(probes),
                outcomes=dict(outcomes), figure=f"{figure * 1000:.0f} ms ({max(probes) * 1000:.0f} ms)",
                target="p99 < 200 ms", met=figure < 0.2)


def capacity(url: str, seconds: float, document: str = SMALL_DOC, clients: int = 1, headers: dict | None = None) -> float:
    """Classify requests of `document` from `clients` closed-loop clients: requests/s (with several
    clients the server batches: its saturated throughput). A client told 429 waits its Retry-After
    (the queue's wait bound, max_queue_wait_s, can refuse a cold server's 8th request)."""
    path, body = request_for("classify", document)

    async def run() -> int:
        done, start = 0, time.monotonic()
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:
            async def one_client():
                nonlocal done
                while time.monotonic() - start < seconds:
                    r = await client.post(path, json=body)
                    if r.status_code == 429:
                        await asyncio.sleep(float(r.headers.get("retry-after", 1)))  # the server's backpressure
                        continue
                    r.raise_for_status()
                    done += 1
            await asyncio.gather(*(one_client() for _ in range(clients)))
        return done

    start = time.monotonic()
    n = asyncio.run(run())
    return n / (time.monotonic() - start)


async def open_loop(url: str, rate: float, seconds: float, on_started=None, tasks_=("classify",),
                    document: str = SMALL_DOC, headers: dict | None = None) -> dict:
    """Requests (classify of `document` unless `tasks_` says) arriving every 1/rate s for `seconds`.
    Every request's send time, latency, outcome and Retry-After are kept (`log`)."""
    outcomes, admitted, log = Counter(), [], []

    async def one(client, i):
        path, body = request_for(tasks_[i % len(tasks_)], document)
        start = time.monotonic()
        try:
            r = await client.post(path, json=body)
        except httpx.ConnectError as e:
            r = e
        except httpx.TransportError:
            r = None
        outcomes[outcome(r)] += 1
        ok = isinstance(r, httpx.Response) and r.status_code == 200
        if ok:
            admitted.append(time.monotonic() - start)
        retry = r.headers.get("retry-after") if isinstance(r, httpx.Response) and r.status_code == 429 else None
        log.append(dict(sent=start, latency=time.monotonic() - start, ok=ok,
                        retry_after=None if retry is None else float(retry)))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1000),
                                 headers=headers) as client:
        pending, start, i = [], time.monotonic(), 0
        while time.monotonic() - start < seconds:
            pending.append(asyncio.create_task(one(client, i)))
            if on_started and i == int(rate):  # a second into the load
                on_started()
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        sending = time.monotonic() - start
        await asyncio.gather(*pending)
    return dict(outcomes=outcomes, admitted=admitted, log=log, sent=i, sent_per_s=i / sending)


def retry_after_honesty(log: list[dict]) -> list[float]:
    """For each 429: its Retry-After R over the wait W that requests admitted at that moment (sent
    within 0.5 s of it) really had until their answer, W floored at 1 s (Retry-After counts whole
    seconds). R/W in [0.5, 2] is "within 2x of the observed wait"."""
    ratios = []
    for r in log:
        if r["retry_after"] is None:
            continue
        near = [x["latency"] for x in log if x["ok"] and abs(x["sent"] - r["sent"]) <= 0.5]
        if near:
            ratios.append(r["retry_after"] / max(float(np.median(near)), 1.0))
    return ratios


def overload(url: str, seconds: float, capacity_seconds: float) -> list[dict]:
    """Open-loop load at 4x the saturated throughput (8 closed-loop clients, batching) of classify
    requests on OVERLOAD_DOC: heavy enough that one client process can offer 4x."""
    rate = capacity(url, capacity_seconds, OVERLOAD_DOC, clients=8)
    result = asyncio.run(open_loop(url, 4 * rate, seconds, document=OVERLOAD_DOC))
    rows = [dict(part=f"4x overload ({4 * rate:.1f}/s for {seconds:.0f} s): admitted p99",
                 requests=result["sent"], outcomes=dict(result["outcomes"]),
                 figure=f"{p99(result['admitted']):.2f} s (capacity {rate:.1f}/s, sent {result['sent_per_s']:.1f}/s)",
                 target="bounded (reported), >= 3.6x offered",
                 met=bool(result["admitted"]) and p99(result["admitted"]) < 120 and result["sent_per_s"] >= 3.6 * rate)]
    ratios = retry_after_honesty(result["log"])
    within = [x for x in ratios if 0.5 <= x <= 2]
    rows.append(dict(part="429 Retry-After R vs observed wait W", requests=len(ratios),
                     outcomes={"within 2x": len(within), "outside": len(ratios) - len(within)},
                     figure=(f"R/W median {np.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}"
                             if ratios else "no 429"),
                     target="R within 2x of W for >= 90%", met=bool(ratios) and len(within) >= 0.9 * len(ratios)))
    # One large summarize while small classify requests keep arriving at capacity.
    big_path, big_body = request_for("summarize", "The report covers many topics. " * 600)
    big_body["max_new_tokens"] = 64
    box = {}

    def large():
        box["start"] = time.monotonic()
        box["r"] = httpx.post(url + big_path, json=big_body, timeout=300)
        box["end"] = time.monotonic()

    thread = threading.Thread(target=large)
    small_rate = capacity(url, capacity_seconds / 2)
    small = asyncio.run(open_loop(url, small_rate, seconds, on_started=thread.start))
    thread.join()
    served = small["outcomes"].get("200", 0)
    rows.append(dict(part="small requests beside one large", requests=small["sent"] + 1,
                     outcomes=dict(small["outcomes"] + Counter({f"large {outcome(box['r'])}": 1})),
                     figure=f"{served} small 200s, large took {box['end'] - box['start']:.1f} s",
                     target="small keep being served", met=served > 0))
    return rows


def soak(url: str, pid: int | None, n: int) -> dict:
    """n mixed small requests, 4 at a time; server VmRSS after warm-up, after 100 and after n."""
    rss = {"start": rss_mib(pid) if pid else float("nan")}
    outcomes = Counter()

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for start in range(0, n, 4):
                batch = [request_for(("qa", "classify", "summarize")[i % 3], SMALL_DOC) for i in range(start, min(n, start + 4))]
                rs = await asyncio.gather(*(client.post(path, json=body) for path, body in batch), return_exceptions=True)
                for r in rs:
                    outcomes[outcome(r if isinstance(r, httpx.Response) else None)] += 1
                if start + 4 == 100 and pid:
                    rss["100"] = rss_mib(pid)
    asyncio.run(run())
    rss[str(n)] = rss_mib(pid) if pid else float("nan")
    growth = rss[str(n)] - rss.get("100", float("nan"))
    return dict(part=f"{n}-request soak: RSS MiB", requests=n, outcomes=dict(outcomes),
                figure=" / ".join(f"{k} {v:.0f}" for k, v in rss.items()), target="flat after warm-up (< 5% 100->end)",
                met=bool(growth < 0.05 * rss.get("100", float("inf"))))


def sigterm(threads: int, seconds: float, log_dir: Path) -> dict:
    proc, url = start_server(threads, log_dir / "battery-sigterm.log")
    rate = capacity(url, 3, OVERLOAD_DOC, clients=8)
    result = {}

    def load():
        result.update(asyncio.run(open_loop(url, 4 * rate, seconds, document=OVERLOAD_DOC)))

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(seconds / 2)  # the load is running; SIGTERM lands in its middle
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    thread.join()
    outcomes = result["outcomes"]
    # admitted: 200 or 503 shutting_down; refused before admission: 429 overloaded (the queue was
    # full: 4x load) or the listener already closed (connect refused)
    bad = {k: v for k, v in outcomes.items() if k not in ("200", "503 shutting_down", "429 overloaded",
                                                         "connect refused")}
    return dict(part=f"SIGTERM under 4x load ({4 * rate:.1f}/s offered, {result['sent_per_s']:.1f}/s sent)",
                requests=result["sent"], outcomes=dict(outcomes),
                figure=f"exit {code}, {sum(bad.values())} other answers", target="admitted: 200 or 503 shutting_down (refused: 429 or connect refused), exit 0",
                met=code == 0 and not bad)


def connection_flood(url: str, n: int, seconds: float) -> dict:
    """`n` connections from this client, each sending part of a request line and a byte a second
    after it (and reopened when the server closes it), for `seconds`; meanwhile /livez and /readyz
    on fresh connections from the same address, every 50 ms: their statuses and slowest answer."""
    port = int(url.rsplit(":", 1)[1])
    end = time.monotonic() + seconds
    opened, outcomes, probes = Counter(), Counter(), []

    def flood():
        held: list[socket.socket] = []
        while time.monotonic() < end:
            alive = []
            for s in held:
                try:
                    s.send(b"o")  # dribbling: a header byte a round
                    alive.append(s)
                except OSError:
                    s.close()
            held = alive
            while len(held) < n and time.monotonic() < end:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(b"GET /livez HTTP/1.1\r\nh")
                    held.append(s)
                    opened["flood connections opened"] += 1
                except OSError:
                    opened["flood connect failed"] += 1
            time.sleep(1.0)
        for s in held:
            s.close()

    thread = threading.Thread(target=flood)
    thread.start()
    while thread.is_alive():
        for path in ("/livez", "/readyz"):
            start = time.monotonic()
            try:
                r = httpx.get(url + path, timeout=30)  # a new connection each time
                outcomes[f"{path} {outcome(r)}"] += 1
            except httpx.TransportError:
                outcomes[f"{path} BAD transport"] += 1
            probes.append(time.monotonic() - start)
        time.sleep(0.05)
    thread.join()
    ok = sum(v for k, v in outcomes.items() if k.endswith(" 200"))
    return dict(part=f"{n} idle connections from one client for {seconds:.0f} s: probes", requests=len(probes),
                outcomes=dict(outcomes + opened),
                figure=f"{ok}/{len(probes)} probes 200, p99 {p99(probes) * 1000:.0f} ms, worst {max(probes) * 1000:.0f} ms",
                target="every probe 200", met=ok == len(probes))


def protocol_errors(url: str) -> dict:
    """Malformed and ambiguous framing, each on its own connection: the answer must be JSON in the
    error shape and the connection closed; the request smuggled after a CL+TE request unanswered."""
    port = int(url.rsplit(":", 1)[1])
    post = b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    cases = {
        "CL+TE, GET /nope after": post + b"content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                                  b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n",
        "differing CL": post + b"content-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        "TE xchunked": post + b"transfer-encoding: xchunked\r\n\r\n",
        "CL +5": post + b"content-length: +5\r\n\r\n{}",
        "NUL in a header": b"GET /livez HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\n\r\n",
        "1 MB header": b"GET /livez HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n",
        "bad chunk size": post + b"transfer-encoding: chunked\r\n\r\nzz\r\n",
    }
    outcomes = Counter()
    for name, data in cases.items():
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            try:
                s.sendall(data)
            except OSError:  # the 1 MB header: answered and closed before it was all sent
                pass
            received = b""
            try:
                while chunk := s.recv(65536):
                    received += chunk
            except OSError:
                pass
        head, _, body = received.partition(b"\r\n\r\n")
        status = head.split(b"\r\n")[0].split(b" ")[1].decode() if head.startswith(b"HTTP/") else "none"
        try:
            kind = json.loads(body)["error"]["type"]
        except ValueError:  # the JSON ends where the smuggled answer would begin
            kind = "BAD not the error shape" if b"HTTP/1.1" not in body else "BAD smuggled request answered"
        outcomes[f"{name}: {status} {kind}"] += 1
    bad = [k for k in outcomes if "BAD" in k or "malformed_request" not in k]
    return dict(part="protocol errors and request smuggling", requests=len(cases), outcomes=dict(outcomes),
                figure=f"{len(cases) - len(bad)}/{len(cases)} JSON and closed", target="all, nothing smuggled",
                met=not bad)


def wrong_keys_then_second_sigint(threads: int, seconds: float, log_dir: Path) -> list[dict]:
    """A fresh server with an API key: 40 wrong keys from 127.0.0.2 (throttled after 10), then 4x
    load from 127.0.0.1 with the key, SIGINT, and SIGINT again once the first is logged."""
    key = "battery-key-0123456789"
    log_path = log_dir / "battery-sigint.log"
    proc, url = start_server(threads, log_path, env={"LONGDOC_API_KEYS": key})
    path, body = request_for("classify", SMALL_DOC)
    outcomes, retry_after = Counter(), []
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), base_url=url, timeout=30) as guesser:
        for i in range(40):
            r = guesser.post(path, json=body, headers={"authorization": f"Bearer guess-{i}"})
            outcomes[outcome(r)] += 1
            if r.status_code == 429:
                retry_after.append(int(r.headers["retry-after"]))
    rows = [dict(part="40 wrong API keys from one client", requests=40, outcomes=dict(outcomes),
                 figure=f"Retry-After {min(retry_after, default=0)}-{max(retry_after, default=0)} s",
                 target="401 x 10, then 429 with Retry-After",
                 met=outcomes == Counter({"401 unauthorized": 10, "429 rate_limited": 30}))]
    auth = {"authorization": f"Bearer {key}"}
    rate = capacity(url, 3, OVERLOAD_DOC, clients=8, headers=auth)
    result = {}

    def load():
        result.update(asyncio.run(open_loop(url, 4 * rate, seconds, document=OVERLOAD_DOC, headers=auth)))

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(seconds / 2)  # the load is running; the first SIGINT lands in its middle
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while "draining" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # a person pressing Ctrl-C again a second later
    second = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=120)
    stopped = time.monotonic() - second
    thread.join()
    log = log_path.read_text()
    drained = next((line.split("shutting down: ", 1)[1] for line in log.splitlines() if "draining" in line), "not logged")
    tracebacks = log.count("Traceback")
    bad = {k: v for k, v in result["outcomes"].items() if k not in ("200", "503 shutting_down", "429 overloaded",
                                                                     "connect refused")}
    rows.append(dict(part=f"SIGINT twice under 4x load ({4 * rate:.1f}/s offered)", requests=result["sent"],
                     outcomes=dict(result["outcomes"]),
                     figure=f"exit {code} {stopped:.1f} s after the second, {tracebacks} tracebacks, logged: {drained!r}",
                     target="admitted: 200 or 503 shutting_down, no traceback, exit 0",
                     met=code == 0 and not bad and tracebacks == 0 and drained != "not logged"))
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as docs/benchmarks.md shows them (a test compares the two)."""
    lines = ["| part | requests | outcomes | figure | target | met |", "|---|---|---|---|---|---|"]
    for r in rows:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))
        lines.append(f"| {r['part']} | {r['requests']} | {counts} | {r['figure']} | {r['target']} | "
                     f"{'met' if r['met'] else 'NOT met'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start `longdoc serve` on models/)")
    ap.add_argument("--threads", type=int, default=2, help="--threads of a started server (default 2)")
    ap.add_argument("--hostile-seconds", type=float, default=20, help="duration of the hostile part (default 20)")
    ap.add_argument("--capacity-seconds", type=float, default=10, help="capacity measurement (default 10)")
    ap.add_argument("--overload-seconds", type=float, default=15, help="each open-loop load (default 15)")
    ap.add_argument("--soak-requests", type=int, default=500, help="soak length (default 500)")
    ap.add_argument("--sigterm-seconds", type=float, default=10, help="load around each signal (default 10)")
    ap.add_argument("--flood-connections", type=int, default=515, help="idle connections of the flood (default 515)")
    ap.add_argument("--flood-seconds", type=float, default=15, help="duration of the flood (default 15)")
    ap.add_argument("--json", default="battery.json", help="save the rows here (default battery.json)")
    ap.add_argument("--log-dir", default=".", help="server logs go here (default .)")
    args = ap.parse_args()
    log_dir = Path(args.log_dir)

    proc, url = (None, args.url) if args.url else start_server(args.threads, log_dir / "battery-serve.log")
    try:
        rows = [hostile(url, args.hostile_seconds), *overload(url, args.overload_seconds, args.capacity_seconds),
                soak(url, proc.pid if proc else None, args.soak_requests),
                connection_flood(url, args.flood_connections, args.flood_seconds), protocol_errors(url)]
    finally:
        if proc:
            proc.terminate()
            proc.wait()
    rows.append(sigterm(args.threads, args.sigterm_seconds, log_dir))
    rows += wrong_keys_then_second_sigint(args.threads, args.sigterm_seconds, log_dir)
    bad = sum(v for r in rows for k, v in r["outcomes"].items() if str(k).startswith("BAD") or " BAD" in str(k))
    rows.insert(0, dict(part="plain-text or generic 5xx (all parts)", requests=sum(r["requests"] for r in rows),
                        outcomes={}, figure=str(bad), target="0", met=bad == 0))

    print(markdown_table(rows))
    command = "python bench/battery.py " + " ".join(sys.argv[1:])
    Path(args.json).write_text(json.dumps(dict(command=command, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               loadavg=os.getloadavg(), rows=rows), indent=1))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
