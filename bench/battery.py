"""The reliability battery (issues 12, 29 and 38) against a real `longdoc serve` (settings: start_server):
hostile inputs (/livez p99 and worst), 4x open-loop overload with clients that obey Retry-After and
clients that do not (admitted p99, Retry-After against the time until the next admission, each
kind's time to a 200), small requests beside a large one, a mixed soak (server RSS), idle floods
from the probes' own address and from several, a slow-body flood from several addresses beside a
well-behaved client, over-token documents beside small requests, header sizes, protocol errors
and request smuggling (JSON, connection closed), SIGTERM under 4x load, wrong keys (throttled)
then SIGINT twice under 4x load, and kill -9 of a `--front-ends 2` engine and of one front end.
Traffic goes to loopback addresses only (127.0.0.x); every part is bounded in time and count.
Prints one table, saves JSON.

    python bench/battery.py [--url URL] [--parts hostile,overload,...] [--json battery.json]

Without --url it starts `longdoc serve --threads 2` on the shipped models/ (and always starts a
fresh one for each signal and kill part, which needs the process). About 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
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
                    if r.status_code == 504:  # past its deadline on a slow machine: not done, go on
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


def next_admission(log: list[dict]) -> list[tuple[float, float]]:
    """For each 429: (its Retry-After R, the time A from its answer until the next request sent
    after it was admitted). A request that waits R finds room if A <= R; R - A is the time it waits
    beyond that (Retry-After counts whole seconds, so up to 1 s of it is rounding)."""
    admitted = sorted(x["sent"] for x in log if x["ok"])
    pairs = []
    for r in log:
        if r["retry_after"] is None:
            continue
        answered = r["sent"] + r["latency"]
        later = [t for t in admitted if t >= answered]
        if later:
            pairs.append((r["retry_after"], later[0] - answered))
    return pairs


async def obeying_and_ignoring(url: str, rate: float, seconds: float, document: str, job_timeout_s: float = 60,
                               ignore_pause_s: float = 0.5) -> dict:
    """Jobs arriving every 1/rate s for `seconds`, alternately of two kinds of client, each sending
    its request until it is answered 200 (or `job_timeout_s` passes): one waits each 429's
    Retry-After before sending again, the other sends again after `ignore_pause_s`. Every attempt
    is logged as in `open_loop`; per kind, the time from a job's first attempt to its 200."""
    log, jobs = [], {"obeys": [], "ignores": []}
    outcomes = Counter()
    path, body = request_for("classify", document)

    async def job(client, kind: str):
        first = time.monotonic()
        attempts = 0
        while time.monotonic() - first < job_timeout_s:
            start = time.monotonic()
            attempts += 1
            try:
                r = await client.post(path, json=body)
            except httpx.TransportError:
                r = None
            outcomes[outcome(r)] += 1
            ok = r is not None and r.status_code == 200
            retry = r.headers.get("retry-after") if r is not None and r.status_code == 429 else None
            log.append(dict(sent=start, latency=time.monotonic() - start, ok=ok,
                            retry_after=None if retry is None else float(retry)))
            if ok:
                jobs[kind].append(dict(seconds=time.monotonic() - first, attempts=attempts))
                return
            if retry is None:  # not a 429: the job ends
                break
            await asyncio.sleep(float(retry) if kind == "obeys" else ignore_pause_s)
        jobs[kind].append(dict(seconds=None, attempts=attempts))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1000)) as client:
        pending, start, i = [], time.monotonic(), 0
        while time.monotonic() - start < seconds:
            pending.append(asyncio.create_task(job(client, ("obeys", "ignores")[i % 2])))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        sending = time.monotonic() - start
        await asyncio.gather(*pending)
    return dict(log=log, jobs=jobs, outcomes=outcomes, sent=i, sent_per_s=i / sending)


def overload(url: str, seconds: float, capacity_seconds: float) -> list[dict]:
    """Jobs at 4x the saturated throughput (8 closed-loop clients, batching) of classify requests
    on OVERLOAD_DOC (heavy enough that one client process can offer 4x), half of them obeying
    Retry-After and half sending again after 0.5 s; then small requests beside one large."""
    rate = capacity(url, capacity_seconds, OVERLOAD_DOC, clients=8)
    result = asyncio.run(obeying_and_ignoring(url, 4 * rate, seconds, OVERLOAD_DOC))
    admitted = [x["latency"] for x in result["log"] if x["ok"]]
    rows = [dict(part=f"4x overload ({4 * rate:.1f} jobs/s for {seconds:.0f} s): admitted p99",
                 requests=len(result["log"]), outcomes=dict(result["outcomes"]),
                 figure=f"{p99(admitted):.2f} s (capacity {rate:.1f}/s, jobs sent {result['sent_per_s']:.1f}/s)",
                 target=f"<= max_queue_wait_s (10 s) + 1/capacity ({1 / rate:.1f} s), >= 3.6x offered",
                 met=bool(admitted) and p99(admitted) <= 10 + 1 / rate and result["sent_per_s"] >= 3.6 * rate)]
    pairs = next_admission(result["log"])
    close = [(r, a) for r, a in pairs if a <= r + 0.5 and r - a <= 1.5]
    rows.append(dict(part="429 Retry-After R vs time A until the next admission", requests=len(pairs),
                     outcomes={"A <= R + 0.5 s and R - A <= 1.5 s": len(close), "outside": len(pairs) - len(close)},
                     figure=(f"R median {np.median([r for r, _ in pairs]):.1f} s, A median "
                             f"{np.median([a for _, a in pairs]):.2f} s, R - A median "
                             f"{np.median([r - a for r, a in pairs]):.2f} s" if pairs else "no 429"),
                     target="R - A within [-0.5, 1.5] s for >= 90%", met=bool(pairs) and len(close) >= 0.9 * len(pairs)))
    for kind in ("obeys", "ignores"):
        done = [j["seconds"] for j in result["jobs"][kind] if j["seconds"] is not None]
        attempts = [j["attempts"] for j in result["jobs"][kind]]
        rows.append(dict(part=f"4x overload: jobs whose client {'obeys' if kind == 'obeys' else 'ignores'} Retry-After",
                         requests=sum(attempts),
                         outcomes={"done": len(done), "not done in 60 s": len(attempts) - len(done)},
                         figure=(f"time to 200: median {np.median(done):.1f} s, p90 {np.percentile(done, 90):.1f} s; "
                                 f"attempts per job: median {np.median(attempts):.0f}" if done else "none done"),
                         target="reported (obeying costs no more than ignoring: next row)", met=bool(done)))
    obey = [j["seconds"] for j in result["jobs"]["obeys"] if j["seconds"] is not None]
    ignore = [j["seconds"] for j in result["jobs"]["ignores"] if j["seconds"] is not None]
    if obey and ignore:
        ratio = float(np.median(obey) / max(np.median(ignore), 1e-3))
        rows.append(dict(part="4x overload: obeying vs ignoring Retry-After", requests=0, outcomes={},
                         figure=f"median time to 200, obeying / ignoring: {ratio:.2f}",
                         target="<= 1.5 (obeying does not lose the turn)", met=ratio <= 1.5))
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


def connection_flood(url: str, n: int, seconds: float, sources: tuple[str, ...] = ("127.0.0.1",),
                     head: bytes = b"GET /livez HTTP/1.1\r\nh", what: str = "idle") -> dict:
    """`n` connections spread over the loopback addresses `sources`, each sending `head` (part of
    a request line, or a whole head of a POST whose body never comes) and a byte a second after it
    (reopened when the server closes it), for `seconds`; meanwhile /livez and /readyz on fresh
    connections from 127.0.0.1 every 50 ms: their statuses and slowest answer. The flood's answers
    are counted by status."""
    port = int(url.rsplit(":", 1)[1])
    end = time.monotonic() + seconds
    opened, outcomes, probes = Counter(), Counter(), []

    def flood():
        held: list[socket.socket] = []
        while time.monotonic() < end:
            alive = []
            for s in held:
                try:
                    s.send(b" ")  # dribbling: a byte a round (of a header, or of a body)
                    alive.append(s)
                except OSError:
                    s.close()
                    continue
            held = alive
            readable, _, _ = select.select(held, [], [], 0) if held else ([], [], [])
            for s in readable:  # answered (and closed) by the server
                try:
                    line = s.recv(64).split(b"\r\n")[0]
                    opened[f"flood answered {line.split()[1].decode()}" if line.startswith(b"HTTP/") else
                           "flood closed"] += 1
                except (OSError, IndexError):
                    opened["flood closed"] += 1
                held.remove(s)
                s.close()
            while len(held) < n and time.monotonic() < end:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5,
                                                 source_address=(sources[len(held) % len(sources)], 0))
                    s.sendall(head)
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
    whence = "127.0.0.1 (the probes' own)" if sources == ("127.0.0.1",) else f"{len(sources)} addresses"
    return dict(part=f"{n} {what} connections from {whence} for {seconds:.0f} s: probes", requests=len(probes),
                outcomes=dict(outcomes + opened),
                figure=f"{ok}/{len(probes)} probes 200, p99 {p99(probes) * 1000:.0f} ms, worst {max(probes) * 1000:.0f} ms",
                target="every probe 200", met=ok == len(probes))


SLOW_BODY_HEAD = (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100000\r\n\r\n{")  # then a byte a second


def slow_body_flood(url: str, n: int, seconds: float, sources: int) -> dict:
    """`n` connections from `sources` addresses (127.0.0.2 ...) sending a POST body at 1 byte/s,
    reopened as they are closed; meanwhile the probes from 127.0.0.1 (`connection_flood`) and a
    well-behaved client at 127.0.0.99 sending small classify requests one after another."""
    client_outcomes, stop = Counter(), threading.Event()
    path, body = request_for("classify", SMALL_DOC)

    def well_behaved():
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.99"), base_url=url, timeout=30) as c:
            while not stop.is_set():
                try:
                    client_outcomes[f"client {outcome(c.post(path, json=body))}"] += 1
                except httpx.TransportError:
                    client_outcomes["client BAD transport"] += 1

    thread = threading.Thread(target=well_behaved)
    thread.start()
    try:
        row = connection_flood(url, n, seconds, tuple(f"127.0.0.{2 + i}" for i in range(sources)), SLOW_BODY_HEAD,
                               "slow-body (1 byte/s)")
    finally:
        stop.set()
        thread.join()
    served = client_outcomes.get("client 200", 0)
    row["outcomes"] = dict(Counter(row["outcomes"]) + client_outcomes)
    row["requests"] += sum(client_outcomes.values())
    row["figure"] += f"; client {served}/{sum(client_outcomes.values())} 200"
    row["target"] = "every probe and client request 200"
    row["met"] = row["met"] and served == sum(client_outcomes.values()) > 0
    return row


def over_token_senders(url: str, seconds: float, senders: int = 4) -> dict:
    """A small classify request's latency alone, then beside `senders` clients sending 1.9 MB
    documents (under max_document_bytes, over max_document_tokens: 413) one after another."""
    path, body = request_for("classify", SMALL_DOC)
    huge = json.dumps({"document": " ".join(f"w{i % 200}x" for i in range(348_000))}).encode()  # 1.9 MB
    outcomes, stop = Counter(), threading.Event()

    def small_latencies(duration: float) -> list[float]:
        out, end = [], time.monotonic() + duration
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < end:
                start = time.monotonic()
                r = c.post(path, json=body)
                outcomes[f"small {outcome(r)}"] += 1
                out.append(time.monotonic() - start)
        return out

    def sender():
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                try:
                    outcomes[f"over-token {outcome(c.post(path, content=huge, headers={'content-type': 'application/json'}))}"] += 1
                except httpx.TransportError:
                    outcomes["over-token BAD transport"] += 1

    alone = small_latencies(seconds / 2)
    threads = [threading.Thread(target=sender) for _ in range(senders)]
    for t in threads:
        t.start()
    try:
        beside = small_latencies(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
    a, b = float(np.median(alone)), float(np.median(beside))
    return dict(part=f"{senders} clients sending 1.9 MB over-token documents: a small request's p50",
                requests=sum(outcomes.values()), outcomes=dict(outcomes),
                figure=f"{a:.3f} s alone, {b:.3f} s beside them ({b / a:.1f}x)",
                target="<= 3x alone; the 1.9 MB documents 413", met=b <= 3 * a and "over-token 413 too_large" in outcomes)


def header_sizes(url: str) -> dict:
    """GET /livez with one header of each size, sent in one write and in 1 KiB writes: 200 up to the
    16 KiB head limit, 431 over it, however the bytes arrive."""
    port = int(url.rsplit(":", 1)[1])
    outcomes, wrong = Counter(), 0
    for size in (1_000, 8_000, 16_000, 17_000, 20_000, 100_000, 1_000_000):
        data = b"GET /livez HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * size + b"\r\n\r\n"
        for how, step in (("one write", len(data)), ("1 KiB writes", 1024)):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                try:
                    for i in range(0, len(data), step):
                        s.sendall(data[i:i + step])
                except OSError:  # answered and closed before it was all sent
                    pass
                try:
                    line = s.recv(64).split(b"\r\n")[0]
                    status = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
                except OSError:
                    status = "reset"
            outcomes[f"{size // 1000} kB {how}: {status}"] += 1
            wrong += status != ("200" if len(data) <= 16384 else "431")
    return dict(part="a header of 1 kB to 1 MB, in one write and in 1 KiB writes", requests=sum(outcomes.values()),
                outcomes=dict(outcomes), figure=f"{sum(outcomes.values()) - wrong}/{sum(outcomes.values())} as expected",
                target="200 within the 16 KiB head, 431 over it, however sent", met=wrong == 0)


def listening_children(pid: int, port: int) -> list[int]:
    """The processes under `pid` that hold a socket listening on `port` (the front ends)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        if p == pid:
            continue
        try:
            links = [os.readlink(f) for f in Path(f"/proc/{p}/fd").iterdir()]
        except OSError:
            continue
        if any(link[8:-1] in inodes for link in links if link.startswith("socket:[")):
            found.append(p)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def front_ends_server(threads: int, log_path: Path):
    """`longdoc serve --front-ends 2` on the shipped classify model (the kill -9 parts): (process,
    url). Its metrics directory is this script's, removed after (an engine killed -9 cannot)."""
    port = free_port()
    metrics = tempfile.mkdtemp(prefix="battery-metrics-")
    proc = subprocess.Popen([sys.executable, "-m", "longdoc", "serve", "--port", str(port), "--threads", str(threads),
                             "--log-level", "warning", "--front-ends", "2", f"--model=classify={ROOT / 'models' / 'classify'}"],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics))
    try:
        yield proc, wait_ready(proc, f"http://127.0.0.1:{port}", f"longdoc serve --front-ends 2 (log: {log_path})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(metrics, ignore_errors=True)


def kill_engine(threads: int, log_dir: Path, wait_s: float = 20) -> dict:
    """kill -9 of the `--front-ends 2` engine process: do its front ends exit and free the port?"""
    with front_ends_server(threads, log_dir / "battery-kill-engine.log") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        front_ends = listening_children(proc.pid, port)
        proc.kill()
        proc.wait()
        killed, deadline = time.monotonic(), time.monotonic() + wait_s
        while time.monotonic() < deadline and (any(alive(p) for p in front_ends) or not port_free(port)):
            time.sleep(0.1)  # polling other processes' exit
        gone = not any(alive(p) for p in front_ends) and port_free(port)
        for p in front_ends:  # what is left is this script's to clean up
            if alive(p):
                os.kill(p, signal.SIGKILL)
    return dict(part="kill -9 of the engine (--front-ends 2)", requests=0,
                outcomes={"front ends": len(front_ends)},
                figure=(f"front ends gone and the port free {time.monotonic() - killed:.1f} s after" if gone else
                        f"front ends alive or the port held {wait_s:.0f} s after"),
                target="front ends exit, port free", met=gone and len(front_ends) == 2)


def kill_front_end(threads: int, seconds: float, log_dir: Path) -> dict:
    """kill -9 of one of two front ends under 4 closed-loop clients: only the requests it held
    fail, and the port keeps answering (the engine starts a new front end)."""
    with front_ends_server(threads, log_dir / "battery-kill-front-end.log") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        path, body = request_for("classify", SMALL_DOC)
        outcomes, stop = Counter(), threading.Event()

        def client():
            while not stop.is_set():
                try:  # a new connection each time: the kernel spreads them over the front ends
                    outcomes[outcome(httpx.post(url + path, json=body, timeout=30))] += 1
                except httpx.TransportError:
                    outcomes["transport error (its front end killed)"] += 1

        threads_ = [threading.Thread(target=client) for _ in range(4)]
        for t in threads_:
            t.start()
        try:
            time.sleep(seconds / 2)  # the load is running; the kill lands in its middle
            victim = listening_children(proc.pid, port)[0]
            os.kill(victim, signal.SIGKILL)
            time.sleep(seconds / 2)
        finally:
            stop.set()
            for t in threads_:
                t.join()
        killed = time.monotonic()
        while len(listening_children(proc.pid, port)) < 2 and time.monotonic() - killed < 60:
            time.sleep(0.2)  # polling the engine's restart of the front end
        restarted = time.monotonic() - killed
        after = outcome(httpx.post(url + path, json=body, timeout=30))
        front_ends = len(listening_children(proc.pid, port))
        proc.terminate()
        proc.wait(timeout=120)
    lost = outcomes.get("transport error (its front end killed)", 0)
    return dict(part="kill -9 of one of two front ends under load", requests=sum(outcomes.values()) + 1,
                outcomes=dict(outcomes), figure=f"{lost} lost; then {after}, {front_ends} front ends "
                f"({restarted:.1f} s after the load)",
                target="at most the 4 it held lost, then 200 with 2 front ends",
                met=lost <= 4 and after == "200" and front_ends == 2)


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


PARTS = ("hostile", "overload", "soak", "idle-flood", "slow-body-flood", "over-token", "headers", "protocol",
         "sigterm", "keys-sigint", "kill-engine", "kill-front-end")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start `longdoc serve` on models/)")
    ap.add_argument("--threads", type=int, default=2, help="--threads of a started server (default 2)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    ap.add_argument("--hostile-seconds", type=float, default=20, help="duration of the hostile part (default 20)")
    ap.add_argument("--capacity-seconds", type=float, default=10, help="capacity measurement (default 10)")
    ap.add_argument("--overload-seconds", type=float, default=15, help="each open-loop load (default 15)")
    ap.add_argument("--soak-requests", type=int, default=500, help="soak length (default 500)")
    ap.add_argument("--sigterm-seconds", type=float, default=10, help="load around each signal and kill (default 10)")
    ap.add_argument("--flood-connections", type=int, default=600, help="connections of each idle flood (default 600)")
    ap.add_argument("--slow-body-connections", type=int, default=550,
                    help="connections of the slow-body flood, from 5 addresses (default 550)")
    ap.add_argument("--flood-seconds", type=float, default=15, help="duration of each flood (default 15)")
    ap.add_argument("--over-token-seconds", type=float, default=10, help="the over-token senders' part (default 10)")
    ap.add_argument("--json", default="battery.json", help="save the rows here (default battery.json)")
    ap.add_argument("--log-dir", default=".", help="server logs go here (default .)")
    args = ap.parse_args()
    log_dir = Path(args.log_dir)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        ap.error(f"--parts: no such part {', '.join(sorted(unknown))} (parts: {', '.join(PARTS)})")

    rows = []
    one_server = [p for p in PARTS[:8] if p in parts]
    if one_server:
        proc, url = (None, args.url) if args.url else start_server(args.threads, log_dir / "battery-serve.log")
        try:
            for part in one_server:
                if part == "hostile":
                    rows.append(hostile(url, args.hostile_seconds))
                elif part == "overload":
                    rows += overload(url, args.overload_seconds, args.capacity_seconds)
                elif part == "soak":
                    rows.append(soak(url, proc.pid if proc else None, args.soak_requests))
                elif part == "idle-flood":
                    rows.append(connection_flood(url, args.flood_connections, args.flood_seconds))
                    rows.append(connection_flood(url, args.flood_connections, args.flood_seconds,
                                                 tuple(f"127.0.0.{2 + i}" for i in range(5))))
                elif part == "slow-body-flood":
                    rows.append(slow_body_flood(url, args.slow_body_connections, args.flood_seconds, 5))
                elif part == "over-token":
                    rows.append(over_token_senders(url, args.over_token_seconds))
                elif part == "headers":
                    rows.append(header_sizes(url))
                elif part == "protocol":
                    rows.append(protocol_errors(url))
        finally:
            if proc:
                proc.terminate()
                proc.wait()
    if "sigterm" in parts:
        rows.append(sigterm(args.threads, args.sigterm_seconds, log_dir))
    if "keys-sigint" in parts:
        rows += wrong_keys_then_second_sigint(args.threads, args.sigterm_seconds, log_dir)
    if "kill-engine" in parts:
        rows.append(kill_engine(args.threads, log_dir))
    if "kill-front-end" in parts:
        rows.append(kill_front_end(args.threads, args.sigterm_seconds, log_dir))
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
