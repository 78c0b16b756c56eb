"""`longdoc serve --front-ends N` (service/frontends.py, issue 24 item 2): front ends that do the
HTTP and host work, one engine process with the models and batchers. In-process first (the engine's
Service and its socket server in the test's loop, a front-end app in front of it): the same answers,
errors and cancellation as the one-process app; then a real `longdoc serve --front-ends 2`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from longdoc.model.search import resolve_settings
from longdoc.service.batcher import RequestState
from longdoc.service.core import Service
from longdoc.service.engine import LocalModels
from longdoc.service.errors import Overloaded, TooLarge, Unavailable
from longdoc.service.frontends import EngineServer, RemoteModels, error_from, error_payload
from longdoc.service.settings import Settings
from tests.polling import until, until_async
from tests.service.conftest import ServeProcess, fake_factory, running_app, sse_events

MODELS = {"qa": "qa", "cls": "classify", "sum": "summarize"}


async def readyz(client, status: int) -> bool:
    return (await client.get("/readyz")).status_code == status


@contextlib.asynccontextmanager
async def front_end(factory=None, **overrides):
    """An engine (a Service of this process's models, its EngineServer on a Unix socket) and a
    front-end app connected to it (`running_app`'s, same settings, its models `RemoteModels`), in
    this loop; yields (an httpx client of the front end, the engine's Service, its EngineServer)."""
    settings = Settings(models=overrides.get("models", MODELS), **{k: v for k, v in overrides.items() if k != "models"})
    engine = Service(settings, LocalModels(settings, factory or fake_factory()))
    await engine.start()
    server = EngineServer(engine, front_ends=1)
    workdir = Path(tempfile.mkdtemp(prefix="longdoc-fe-test-"))  # short: a socket path has 108 bytes
    await server.start(workdir / "engine.sock")
    try:
        remote = RemoteModels(str(workdir / "engine.sock"))
        async with running_app(source=remote, **overrides) as client:
            remote.serving()  # as uvicorn's startup says it (service/server.py)
            await until_async(lambda: readyz(client, 200), "the front end became ready", 10)
            yield client, engine, server
    finally:
        server.close()
        await engine.stop()
        (workdir / "engine.sock").unlink(missing_ok=True)
        workdir.rmdir()


REQUESTS = [
    ("/v1/qa", {"question": "where is the gold", "documents": ["the gold is in the cave", "nothing here"]}),
    ("/v1/classify", {"documents": ["good good", "bad"]}),
    ("/v1/summarize", {"document": "the gold is where the good map is", "max_new_tokens": 6}),
    ("/v1/summarize", {"document": "the good map", "max_new_tokens": 5, "num_beams": 2}),  # beam search
    ("/v1/qa", {"question": "", "document": "x"}),  # 422
    ("/v1/qa", {"question": "where", "document": "the gold", "model": "nope"}),  # 404
]


def test_a_front_end_answers_as_the_one_process_app():
    async def answers(make):
        async with make() as client:
            client = client[0] if isinstance(client, tuple) else client
            out = []
            for path, body in REQUESTS:
                r = await client.post(path, json=body)
                out.append((r.status_code, r.json()))
            async with client.stream("POST", "/v1/summarize", json={**REQUESTS[2][1], "stream": True}) as r:
                out.append((r.status_code, sse_events([line async for line in r.aiter_lines()])))
            return out

    local, remote = asyncio.run(answers(running_app)), asyncio.run(answers(front_end))
    assert [code for code, _ in local] == [200, 200, 200, 200, 422, 404, 200]
    assert remote == local


def test_errors_cross_with_their_class_status_and_headers():
    for exc in (Overloaded("queue full", 3), TooLarge("too large"), Unavailable("down", {"Retry-After": "1"})):
        back = error_from(error_payload(exc))
        assert (type(back), back.status, back.message, back.headers) == (type(exc), exc.status, exc.message,
                                                                         exc.headers)
    assert type(error_from(error_payload(RuntimeError("x")))).__name__ == "ServiceError"  # no internals leak


def test_an_engine_admission_error_reaches_the_client_as_it_would_in_one_process():
    async def answer(make):
        async with make(max_queue_tokens=64) as client:
            client = client[0] if isinstance(client, tuple) else client
            r = await client.post("/v1/classify", json={"documents": [" ".join(["good"] * 200)]})
            return r.status_code, r.json()

    assert asyncio.run(answer(front_end)) == asyncio.run(answer(running_app))


def test_a_cancelled_summary_leaves_the_engines_batch():
    """The front end's client goes away mid-summary: the engine's job is cancelled and leaves the
    decode batch at once (the worker is held at a gate meanwhile)."""
    gate = threading.Event()
    factory = fake_factory(summarize={"gate": gate, "summary_tokens": 50})

    async def go():
        async with front_end(factory, warmup=False) as (client, engine, _):
            service = client.app.state.service
            remote, scheduler = service.models["sum"].engine, engine.models["sum"].engine
            settings = resolve_settings(service.models["sum"].info.generation, max_new_tokens=40)
            tokens = [service.models["sum"].info.tokenizer.token_to_id(w) for w in ("gold", "good", "map")]
            stream = await remote.submit(tokens, settings, RequestState(deadline=time.monotonic() + 60))
            it = stream.__aiter__()
            first = asyncio.ensure_future(anext(it))
            assert await asyncio.to_thread(factory.made[-1].entered.wait, 10)  # the engine is stepping it
            job = (scheduler.running or scheduler.pending)[0]
            first.cancel()  # the client is gone
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await it.aclose()
            await until_async(lambda: job.request.cancelled, "the engine heard of the cancel", 10)
            gate.set()
            await until_async(lambda: not (scheduler.running or scheduler.pending), "the job left the batch", 10)
            return job

    job = asyncio.run(go())
    gate.set()
    assert len(job.sequence) < 40  # it did not run to its end


def test_a_front_end_whose_engine_is_gone_is_not_ready_and_answers_503():
    async def go():
        async with front_end() as (client, engine, server):
            server.server.close()
            for task in asyncio.all_tasks():  # the engine's connection handlers: the engine process died
                if getattr(task.get_coro(), "__qualname__", "").startswith("EngineServer._serve"):
                    task.cancel()
            await until_async(lambda: readyz(client, 503), "not ready", 10)
            r = await client.post("/v1/classify", json={"documents": ["good"]})
            return r.status_code, r.json()["error"]["type"]

    assert asyncio.run(go()) == (503, "unavailable")


def test_the_engine_is_ready_once_every_front_end_accepts_connections():
    """The engine answers a front end's health poll with yes only while all `front_ends` of them
    have said they accept connections (/readyz follows it), and no again when one is gone."""
    from types import SimpleNamespace

    async def go():
        settings = Settings(models=MODELS)
        engine = Service(settings, LocalModels(settings, fake_factory()))
        await engine.start()
        server = EngineServer(engine, front_ends=2)
        workdir = Path(tempfile.mkdtemp(prefix="longdoc-fe-test-"))
        await server.start(workdir / "engine.sock")
        fronts = [RemoteModels(str(workdir / "engine.sock")) for _ in range(2)]
        try:
            models = [await f.open(SimpleNamespace(refresh_ready=lambda: None)) for f in fronts]
            fronts[0].serving()
            await until_async(lambda: len(server.serving) == 1, "the engine heard the first front end", 10)
            assert engine.is_ready() and not server.is_ready()
            fronts[1].serving()
            await until_async(lambda: models[0]["qa"].engine.healthy(), "the first front end saw the engine ready", 10)
            await fronts[1].close()
            await until_async(lambda: not server.is_ready(), "not ready without the second front end", 10)
        finally:
            for f in fronts:
                await f.close()
            server.close()
            await engine.stop()
            (workdir / "engine.sock").unlink(missing_ok=True)
            workdir.rmdir()

    asyncio.run(go())


def metrics_dir_of(engine_pid: int) -> str:
    """The PROMETHEUS_MULTIPROC_DIR a running `longdoc serve --front-ends N` set for its processes
    (as its front ends were started with it: the engine's own /proc environ is its first one)."""
    environ = Path(f"/proc/{front_end_pids(engine_pid)[0]}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))


def front_end_pids(engine_pid: int) -> list[int]:
    """The engine's children that run a front end (spawned interpreters)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == engine_pid and b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_serve_with_two_front_ends(tiny_qa_dir, tiny_summarize_dir, tmp_path):
    """A real `longdoc serve --front-ends 2`: concurrent requests on their own connections all
    answered alike, /metrics summed over the processes, a killed front end started again, and
    SIGTERM drains and exits 0, its metrics directory gone."""
    from tests.service.test_e2e import metric

    args = ["--model", f"qa={tiny_qa_dir}", "--model", f"sum={tiny_summarize_dir}", "--no-warmup",
            "--front-ends", "2"]
    key = {"Authorization": "Bearer k1"}  # the front ends get the engine's settings, keys included
    with ServeProcess(args, tmp_path / "serve.log", env={"LONGDOC_API_KEYS": "k1"}) as s:
        body = {"question": "where is the gold", "document": "the gold is in the cave by the sea"}
        results = [None] * 12
        assert httpx.post(s.url + "/v1/qa", json=body, timeout=60).status_code == 401

        def ask(i):
            with httpx.Client(headers=key) as client:  # a connection each: the kernel spreads them
                results[i] = client.post(s.url + "/v1/qa", json=body, timeout=60)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200] * 12
        assert len({json.dumps(r.json()["results"]) for r in results}) == 1
        with httpx.stream("POST", s.url + "/v1/summarize", json={"document": "the gold map", "stream": True,
                                                                 "max_new_tokens": 5}, headers=key, timeout=60) as r:
            assert sse_events(r.iter_lines())[-1][0] == "done"
        count = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(s.url + "/metrics").text.splitlines()
                    if line.startswith('longdoc_request_duration_seconds_count{endpoint="qa"'))
        assert count == 12  # each counted once, by the front end that answered it
        assert metric(s.url, 'longdoc_batch_size_count{model="qa"}') >= 1  # the engine's, summed in
        assert metric(s.url, "longdoc_ready") == 1

        pids = front_end_pids(s.proc.pid)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        until(lambda: "starting it again" in s.log_path.read_text() and len(front_end_pids(s.proc.pid)) == 2,
              "the killed front end started again", 60)
        for _ in range(6):
            assert httpx.post(s.url + "/v1/qa", json=body, headers=key, timeout=60).status_code == 200

        metrics_dir = Path(metrics_dir_of(s.proc.pid))  # the processes' metrics directory, made for them
        assert metrics_dir.parent == Path(tempfile.gettempdir()) and metrics_dir.is_dir()

        decoding, events, times = threading.Event(), [], []

        def summarize():  # a long summary, decoding when the signal comes: drained to its end
            with httpx.stream("POST", s.url + "/v1/summarize", timeout=60, headers=key,
                              json={"document": "the gold map", "stream": True, "max_new_tokens": 400}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        times.append(time.monotonic())
                        decoding.set()
                    events.append(line)

        reader = threading.Thread(target=summarize)
        reader.start()
        assert decoding.wait(30)
        sent = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert s.proc.wait(60) == 0
        assert sse_events(events)[-1][0] == "done" and times[-1] > sent  # it went on after the signal
        assert sse_events(events)[-1][1]["results"][0]["generated_tokens"] > 50  # not over at once
    assert not front_end_pids(s.proc.pid) and not metrics_dir.exists()


def test_front_ends_must_be_at_least_one():
    with pytest.raises(ValueError, match="front_ends"):
        Settings(front_ends=0)


def _inodes(pid: int) -> set[str]:
    """The socket inodes process `pid` holds open."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                out.add(link[8:-1])
    return out


def _serving_pid(client_ports: list[int], pids: list[int]) -> dict[int, int]:
    """client port -> the front end (of `pids`) whose end of that loopback connection it is."""
    peer_inode = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            peer_inode[int(fields[2].rsplit(":", 1)[1], 16)] = fields[9]  # rem_address's port -> inode
    owner = {inode: pid for pid in pids for inode in _inodes(pid)}
    return {port: owner.get(peer_inode.get(port)) for port in client_ports}


def test_every_front_end_serves_connections_opened_before_and_after_readiness(tiny_qa_dir, tmp_path):
    """Keep-alive connections opened as soon as the port takes them (front ends still starting) and
    after /readyz says yes are spread over every front end, and each front end answers the
    requests on its own (issue 37: opened before all listened, they piled onto the first one)."""
    import socket

    from tests.service.conftest import free_port

    port, n = free_port(), 3
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "longdoc", "serve", "--port", str(port), "--log-level", "warning",
                             "--model", f"qa={tiny_qa_dir}", "--no-warmup", "--front-ends", str(n)],
                            env=dict(os.environ, LONGDOC_THREADS="1"), stdout=log, stderr=subprocess.STDOUT)

    def connect():
        with contextlib.suppress(OSError):
            return socket.create_connection(("127.0.0.1", port), timeout=60)

    body = json.dumps({"question": "where is the gold", "document": "the gold is in the cave"}).encode()
    request = (f"POST /v1/qa HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    try:
        early = [until(connect, "the port takes connections", 120)]
        early += [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(29)]
        probe = early.pop()  # answered by whichever front end is up first: the others are not yet
        probe.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert probe.recv(64).startswith(b"HTTP/1.1 503"), "ready before every front end was serving"
        until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=60).status_code == 200, "ready", 120)
        late = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(30)]
        pids = front_end_pids(proc.pid)
        assert len(pids) == n
        for group in (early, late):
            for conn in group:
                conn.sendall(request)
            for conn in group:
                assert conn.recv(65536).startswith(b"HTTP/1.1 200"), log.name
            served = _serving_pid([c.getsockname()[1] for c in group], pids)
            assert set(served.values()) == set(pids), served  # 30 connections: each of 3 misses all with p 2e-5
        for conn in early + late + [probe]:
            conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()


def test_front_ends_exit_when_the_engine_is_killed(tiny_qa_dir, tmp_path):
    """kill -9 of the engine (issue 38, item 4): its front ends exit, and the port is free for a
    new server (they kept it, answering 503, before)."""
    import socket

    with ServeProcess(["--model", f"qa={tiny_qa_dir}", "--no-warmup", "--front-ends", "2"], tmp_path / "serve.log") as s:
        pids = front_end_pids(s.proc.pid)
        assert len(pids) == 2
        metrics_dir = metrics_dir_of(s.proc.pid)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)

        def gone(pid: int) -> bool:  # exited (a zombie until its new parent reaps it)
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True

        until(lambda: all(gone(p) for p in pids), "the front ends exited", 60)
        with socket.socket() as sock:  # as a new `longdoc serve` binds it (check_port, uvicorn)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", s.port))
            sock.listen()
    shutil.rmtree(metrics_dir)  # what a killed engine cannot remove


def test_a_front_end_embeds_as_the_one_process_app():
    """Issue 39: the embed model's windows cross the engine socket and come back as the same vectors."""
    models = {"embed": "embed"}
    requests = [("/v1/embeddings", {"input": ["the gold", "good " * 100 + "bad"]}),
                ("/embed", {"inputs": "good gold", "normalize": False}), ("/v1/embeddings", {"input": []})]

    async def answers(make):
        async with make(models=models) as client:
            client = client[0] if isinstance(client, tuple) else client
            return [((r := await client.post(path, json=body)).status_code, r.json()) for path, body in requests]

    local, remote = asyncio.run(answers(running_app)), asyncio.run(answers(front_end))
    assert [code for code, _ in local] == [200, 200, 422]
    assert remote == local
