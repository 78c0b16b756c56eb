"""Several HTTP front ends, one engine (issue 24, item 2): `longdoc serve --front-ends N`.

    engine process (this one):  models, workers, one batcher per model and device; no HTTP
        ^ Unix socket, one per front end: submissions, tokens and results as framed pickles
    N front-end processes:       HTTP, body checks, validation, tokenization, windows, answer
                                 shaping, responses (the same app, its models `RemoteModels`),
                                 each on its own listening socket of the port (SO_REUSEPORT: the
                                 kernel spreads the connections over them)

One process parses, validates, tokenizes and shapes every answer in front of the device otherwise,
on one event loop and its threads (what that costs per document and how each design scales with
cores: docs/benchmarks.md, "The host path (null engine)"). Every submission still reaches the one
batcher of its model, so batches form across all front ends. vLLM's API servers and engine core, and TEI's router and
backend, are split the same way.

The engine opens the N listening sockets before it starts any front end and hands front end i
the i-th: from the first connection on, the kernel spreads connections over all N (a socket
whose front end is still starting holds its connections until it accepts them), so keep-alive
clients that connect early do not pile onto the first front end up. `/readyz` says yes only once
every front end accepts connections. A front end that dies is started again on the same socket.

What a user sees does not change: the same API, errors (a `ServiceError` crosses as its class,
message and headers), deadlines (the monotonic clock is the machine's), cancellation (a front end
whose client goes away cancels its submission; a front end that dies cancels all of its),
metrics (prometheus-client's multiprocess mode: every process writes to one directory and
`/metrics` anywhere sums them) and the drain on SIGTERM (the engine forwards it, the front ends
drain their requests, then the engine stops). A front end exits when the engine dies (Linux's
parent-death signal), so a killed engine leaves no process holding the port.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import signal
import struct
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from longdoc.service import errors
from longdoc.service.batcher import RequestState
from longdoc.service.engine import ServedModel
from longdoc.service.errors import ServiceError, Unavailable
from longdoc.service.restarts import Backoff, NotUp, restart_until_up

log = logging.getLogger("longdoc.service")
_FRAME = struct.Struct("!I")
HEALTH_POLL_S = 0.5  # a front end asks the engine whether it is ready this often


# --- the wire: framed pickles ----------------------------------------------------------------

def send(writer: asyncio.StreamWriter, message: tuple) -> None:
    """One frame, written at once (a frame is never interleaved with another)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_FRAME.pack(len(payload)) + payload)


async def receive(reader: asyncio.StreamReader) -> tuple:
    (n,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    return pickle.loads(await reader.readexactly(n))


def error_payload(exc: BaseException) -> tuple[str, str, dict, int]:
    if isinstance(exc, ServiceError):
        return type(exc).__name__, exc.message, dict(exc.headers), exc.status
    return "ServiceError", "internal error", {}, 500


def error_from(payload: tuple[str, str, dict, int]) -> ServiceError:
    name, message, headers, status = payload
    cls = getattr(errors, name, ServiceError)
    exc = cls.__new__(cls)
    ServiceError.__init__(exc, message, headers)
    exc.status = status
    return exc


# --- the engine's side --------------------------------------------------------------------------

class EngineServer:
    """Serves the front ends' submissions to the service's engines (its batchers). Ready (what it
    answers a front end's health poll) when the service is and `front_ends` front ends accept
    connections."""

    def __init__(self, service, front_ends: int):
        self.service = service
        self.front_ends = front_ends
        self.serving: set[asyncio.StreamWriter] = set()  # the front ends that said they accept connections
        self.server: asyncio.AbstractServer | None = None

    async def start(self, path: Path) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path=str(path))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def is_ready(self) -> bool:
        return self.service.is_ready() and len(self.serving) >= self.front_ends

    def hello(self) -> tuple:
        s = self.service
        return ("hello", {n: (m.info, m.devices, m.length_bounds) for n, m in s.models.items()})

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        running: dict[int, tuple[asyncio.Task, RequestState]] = {}
        try:
            send(writer, self.hello())
            while True:
                message = await receive(reader)
                kind, rid = message[0], message[1]
                if kind in ("encode", "decode"):  # (kind, rid, model, *arguments, deadline, arrival)
                    state = RequestState(deadline=message[-2], started=message[-1])
                    task = asyncio.create_task(self._run(writer, kind, rid, state, *message[2:-2]))
                    running[rid] = (task, state)
                    task.add_done_callback(lambda _, rid=rid: running.pop(rid, None))
                elif kind == "cancel":
                    if rid in running:
                        task, state = running[rid]
                        state.cancelled = True
                        task.cancel()
                elif kind == "health":
                    send(writer, ("health", rid, self.is_ready()))
                elif kind == "serving":
                    self.serving.add(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front end is gone: whatever it submitted is nobody's now
        finally:
            self.serving.discard(writer)
            for task, state in list(running.values()):
                state.cancelled = True
                task.cancel()
            writer.close()

    async def _run(self, writer, kind: str, rid: int, state: RequestState, model: str, *args) -> None:
        try:
            engine = self.service.models[model].engine
            if kind == "encode":
                send(writer, ("done", rid, await engine.submit(args[0], state)))
                return
            stream = await engine.submit(args[0], args[1], state)
            try:
                async for token in stream:
                    send(writer, ("token", rid, token))
            finally:
                await stream.aclose()  # leaves the decode batch at its next step
            send(writer, ("done", rid, None))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            if not isinstance(exc, ServiceError):
                log.exception("engine: %s submission failed", kind)
            if not writer.is_closing():
                send(writer, ("error", rid, error_payload(exc)))


# --- a front end's side -------------------------------------------------------------------------

class EngineClient:
    """A front end's connection to the engine: submissions by id, replies routed back to them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.ids = itertools.count()
        self.waiting: dict[int, asyncio.Queue] = {}
        self.engine_ready = False
        self.on_health: Callable[[], None] = lambda: None  # the engine's readiness changed (longdoc_ready)
        self.lost = False
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def connect(cls, path: str) -> tuple[EngineClient, dict]:
        """The client and the engine's models: name -> (ModelInfo, devices, length bounds)."""
        reader, writer = await asyncio.open_unix_connection(path)
        _, models = await receive(reader)
        client = cls(reader, writer)
        client._tasks = [asyncio.create_task(client._read()), asyncio.create_task(client._poll_health())]
        return client, models

    async def _read(self) -> None:
        try:
            while True:
                kind, rid, value = await receive(self.reader)
                if kind == "health":
                    if self.engine_ready != bool(value):
                        self.engine_ready = bool(value)
                        self.on_health()
                    continue
                queue = self.waiting.get(rid)
                if queue is not None:
                    queue.put_nowait((kind, value))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.lost, self.engine_ready = True, False
            self.on_health()
            for queue in self.waiting.values():  # the engine is gone: everything in flight fails
                queue.put_nowait(("error", error_payload(Unavailable("the engine process is gone; retry",
                                                                     {"Retry-After": "1"}))))

    async def _poll_health(self) -> None:
        while not self.lost:
            send(self.writer, ("health", -1))
            await asyncio.sleep(HEALTH_POLL_S)  # a period, not an ordering: /readyz follows within it

    def open(self, message: tuple) -> tuple[int, asyncio.Queue]:
        if self.lost:
            raise Unavailable("the engine process is gone; retry", {"Retry-After": "1"})
        rid = next(self.ids)
        queue = self.waiting[rid] = asyncio.Queue()
        send(self.writer, (message[0], rid, *message[1:]))
        return rid, queue

    def close_request(self, rid: int, cancel: bool) -> None:
        self.waiting.pop(rid, None)
        if cancel and not self.lost and not self.writer.is_closing():
            send(self.writer, ("cancel", rid))

    def serving(self) -> None:
        """Tell the engine this front end accepts connections (it is ready once all of them do)."""
        if not self.lost:
            send(self.writer, ("serving", -1))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.writer.close()


class RemoteEncoder:
    """`EncoderBatcher.submit` across the socket: the engine's batcher for this model runs it."""

    def __init__(self, client: EngineClient, model: str):
        self.client, self.model = client, model

    async def submit(self, sequences, request: RequestState) -> list:
        rid, queue = self.client.open(("encode", self.model, sequences, request.deadline, request.started))
        finished = False
        try:
            kind, value = await queue.get()
            finished = True
            if kind == "error":
                raise error_from(value)
            return value
        finally:
            self.client.close_request(rid, cancel=not finished)

    def healthy(self) -> bool:
        return self.client.engine_ready

    async def drain(self, grace_s: float) -> None:
        pass  # the engine process drains its batchers

    async def close(self) -> None:
        pass  # RemoteModels.close closes the connection


class RemoteDecoder(RemoteEncoder):
    """`DecodeScheduler.submit` across the socket: tokens as the engine's decode batch makes them."""

    async def submit(self, input_ids, settings, request: RequestState) -> AsyncIterator[int]:
        rid, queue = self.client.open(("decode", self.model, list(input_ids), settings, request.deadline,
                                       request.started))
        return self._stream(rid, queue)

    async def _stream(self, rid: int, queue: asyncio.Queue) -> AsyncIterator[int]:
        finished = False
        try:
            while True:
                kind, value = await queue.get()
                if kind == "token":
                    yield value
                    continue
                finished = True
                if kind == "error":
                    raise error_from(value)
                return
        finally:  # done, failed, or its reader went away: the engine drops it at once
            self.client.close_request(rid, cancel=not finished)


class RemoteModels:
    """A front end's models (service/engine.py `ModelSource`): the engine process's, each behind a
    remote engine on one connection to it."""

    def __init__(self, path: str):
        self.path = path
        self.client: EngineClient | None = None

    async def open(self, metrics) -> dict[str, ServedModel]:
        self.client, models = await EngineClient.connect(self.path)
        self.client.on_health = metrics.refresh_ready
        return {name: ServedModel(info, devices, (RemoteDecoder if info.task == "summarize" else RemoteEncoder)(
                    self.client, name), bounds)
                for name, (info, devices, bounds) in models.items()}

    def serving(self) -> None:
        if self.client is not None:
            self.client.serving()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


# --- the processes --------------------------------------------------------------------------------

def listening_sockets(host: str, port: int, n: int) -> list:
    """`n` sockets listening on one port (SO_REUSEPORT; port 0: the one the first is given)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = []
    for _ in range(n):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, socks[0].getsockname()[1] if socks else port))
        sock.listen(2048)  # uvicorn's backlog
        socks.append(sock)
    return socks


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when its parent (the engine) dies, however it dies (kill -9, the
    OOM killer): a front end cannot serve without it and must not keep the port. Linux only
    (prctl); elsewhere a front end answers 503 until it is stopped."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # it died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)


def front_end_main(settings, engine_path: str, index: int, sock, parent_pid: int) -> None:
    """A front end (a spawned process): the app with remote models, HTTP on its listening socket
    `sock` (the engine's, inherited). `settings` arrive pickled (API keys included: a JSON dump
    would mask them)."""
    from longdoc.service.server import run_http

    exit_with_parent(parent_pid)
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[front end {index}]: %(message)s")
    models = RemoteModels(engine_path)
    raise SystemExit(run_http(settings, models=models, sockets=[sock], on_serving=models.serving))


UP_S = 60.0  # a started-again front end that has run this long is up: its next exit waits the first back-off


class FrontEnds:
    """The front-end processes, front end i on listening socket i (opened here, before any of them
    starts). One that exits while the engine runs is started again on its socket, with the workers'
    restart back-off (service/restarts.py: it doubles while a front end keeps exiting within `UP_S`)."""

    def __init__(self, settings, engine_path: str, stop: asyncio.Event):
        import multiprocessing

        self.settings, self.engine_path, self.stop = settings, engine_path, stop
        self.front = settings.model_copy(update={"front_ends": 1})  # what each front end runs
        self.context = multiprocessing.get_context("spawn")
        self.sockets = listening_sockets(settings.host, settings.port, settings.front_ends)
        self.processes = [self._spawn(i) for i in range(settings.front_ends)]
        self.keepers = [asyncio.create_task(self._keep(i)) for i in range(settings.front_ends)]

    def _spawn(self, i: int):
        p = self.context.Process(target=front_end_main, name=f"longdoc-front-end-{i}", daemon=False,
                                 args=(self.front, self.engine_path, i, self.sockets[i], os.getpid()))
        p.start()
        return p

    def _gone(self, i: int) -> str:
        """Front end i has exited: its live metrics go (prometheus multiprocess mode); what to log."""
        from prometheus_client import multiprocess

        p = self.processes[i]
        multiprocess.mark_process_dead(p.pid)
        return f"front end {i} (pid {p.pid}) exited with {p.exitcode}"

    async def _start(self, i: int):
        """Front end i again; up once it has run `UP_S` (or the engine is stopping)."""
        p = self.processes[i] = self._spawn(i)
        await asyncio.to_thread(p.join, UP_S)
        if p.exitcode is not None and not self.stop.is_set():
            raise NotUp(self._gone(i))
        return p

    async def _keep(self, i: int) -> None:
        backoff = Backoff(self.settings.worker_restart_backoff_s, self.settings.worker_restart_max_backoff_s)
        while True:
            await asyncio.to_thread(self.processes[i].join)
            if self.stop.is_set():
                return
            log.error("%s; starting it again in %.1f s", self._gone(i), backoff.delay)
            if await restart_until_up(lambda: self._start(i), backoff, f"front end {i}", self.stop) is None:
                return  # shutting down meanwhile

    def forward(self, sig: int) -> None:
        for p in self.processes:
            if p.is_alive():
                os.kill(p.pid, sig)

    async def drain(self, deadline: float) -> None:
        """SIGTERM to every front end; they drain their requests (the engine serves them meanwhile)
        and exit, waited for until `deadline` (monotonic clock)."""
        self.forward(signal.SIGTERM)
        for sock in self.sockets:  # new connections are refused now, not queued for front ends that drain
            sock.close()
        for p in self.processes:
            await asyncio.to_thread(p.join, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for t in self.keepers:
            t.cancel()
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for sock in self.sockets:
            sock.close()


async def run_engine(settings, worker_factory) -> int:
    """The engine process: load the models, serve the front ends, keep them running; on SIGTERM
    or SIGINT, forward it, let the front ends drain, then stop."""
    from longdoc.service.core import Service
    from longdoc.service.engine import LocalModels
    from longdoc.service.server import SHUTDOWN_MARGIN_S
    from longdoc.service.workers import onnx_worker_factory

    service = Service(settings, LocalModels(settings, worker_factory or onnx_worker_factory))
    server = EngineServer(service, settings.front_ends)
    workdir = Path(tempfile.mkdtemp(prefix="longdoc-engine-"))
    stop = asyncio.Event()
    front_ends: FrontEnds | None = None
    signals = 0

    def on_signal() -> None:  # the first: drain (forwarded once stopping); again: now
        nonlocal signals
        signals += 1
        service.begin_drain(grace_s=0 if signals > 1 else None)
        if signals > 1 and front_ends is not None:
            front_ends.forward(signal.SIGINT)  # a front end's second signal: what runs is answered 503 at once
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, on_signal)
    try:
        try:
            await service.start()
        except Exception:
            log.exception("engine: the models did not start")
            return 1
        await server.start(workdir / "engine.sock")
        front_ends = FrontEnds(settings, str(workdir / "engine.sock"), stop)
        log.info("engine: %d front ends on %s:%d", settings.front_ends, settings.host,
                 front_ends.sockets[0].getsockname()[1])
        await stop.wait()
        log.info("engine: waiting for the front ends to drain")
        await front_ends.drain(time.monotonic() + settings.shutdown_grace_s + SHUTDOWN_MARGIN_S)  # as their uvicorn
        return 0
    finally:
        if front_ends is not None:
            front_ends.close()
        server.close()
        await service.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def serve_front_ends(settings, worker_factory=None) -> int:
    return asyncio.run(run_engine(settings, worker_factory))
