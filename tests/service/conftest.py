"""Service test helpers: an app on fake workers (gated ones, for ordering without sleeps), driven
in-process through httpx's ASGI transport with the app's lifespan running, or behind uvicorn in a
thread; and a real `longdoc serve` subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import uvicorn

from longdoc.service.app import create_app
from longdoc.service.connections import limited_protocol
from longdoc.service.settings import Settings
from longdoc.testing.fake_worker import FakeWorker
from tests.polling import until


@pytest.fixture(scope="session")
def tiny_summarize_options_dir(tmp_path_factory):
    """A tiny summarizer whose checkpoint sets every generation option the search handles
    (longdoc/testing/tiny_models.py TINY_GENERATION: min_length, forced_eos_token_id, no_repeat_ngram_size,
    length_penalty) in its generation_config.json; exported, fp32."""
    from longdoc.testing.tiny_models import TINY_GENERATION, make_tiny_checkpoint, make_tiny_export

    root = tmp_path_factory.mktemp("tiny-summarize-options")
    checkpoint = make_tiny_checkpoint(root / "checkpoint", "summarize", generation=TINY_GENERATION)
    return make_tiny_export(root / "model", "summarize", checkpoint_dir=checkpoint)


class GatedWorker(FakeWorker):
    """A FakeWorker whose run/step/generate first wait for `gate` (a threading.Event), so a test
    decides when work proceeds; `entered` is set once a call is waiting at the gate."""

    def __init__(self, *, gate: threading.Event, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate
        self.entered = threading.Event()

    def _wait(self):
        self.entered.set()
        assert self.gate.wait(30), "gate never opened"

    def run(self, batch):
        self._wait()
        return super().run(batch)

    def step(self, states, tokens):
        self._wait()
        return super().step(states, tokens)

    def generate(self, input_ids, settings, should_stop=None):
        self._wait()
        return super().generate(input_ids, settings, should_stop)


def fake_factory(restarts_fail: bool = False, **per_task):
    """A worker factory: model name -> FakeWorker(task=name's task, **per_task[task]); a `gate`
    in per_task[task] makes it a GatedWorker. A restart (second worker of a name) does not fail,
    or, with `restarts_fail`, raises."""
    made = []

    def factory(name, directory, device, settings):
        task = str(directory)  # tests pass the task as the "directory"
        kwargs = dict(per_task.get(task, {}))
        if any(m.info.name == name for m in made):  # a restart
            factory.restarts += 1
            if restarts_fail:
                raise RuntimeError("fake restart failure")
            kwargs.pop("fail_runs", None)
        w = (GatedWorker if "gate" in kwargs else FakeWorker)(name=name, task=task, **kwargs)
        made.append(w)
        return w

    factory.restarts = 0

    factory.made = made
    return factory


@contextlib.asynccontextmanager
async def running_app(factory=None, source=None, **overrides):
    """The app in-process (httpx's ASGI transport); its models from `source` (service/engine.py
    `ModelSource`; e.g. a front end's `RemoteModels`), else `factory`'s workers in this process."""
    settings = Settings(models=overrides.pop("models", {"qa": "qa", "cls": "classify", "sum": "summarize"}),
                        **overrides)
    app = create_app(settings, worker_factory=factory or fake_factory(), models=source)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app
            yield client


def sse_events(lines) -> list[tuple[str, dict]]:
    """(event name, data) of server-sent event lines (comments skipped)."""
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def streamed_tokens(url: str, documents: list[str], max_new_tokens: int) -> list[list[int]]:
    """Each document summarized by a running server, streamed: its token ids, checking that
    every stream answered 200 and ended with `done`."""
    out = []
    for doc in documents:
        with httpx.stream("POST", url + "/v1/summarize",
                          json={"document": doc, "stream": True, "max_new_tokens": max_new_tokens}, timeout=60) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[-1][0] == "done"
        out.append([i for n, d in events if n == "token" for i in d["ids"]])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn in a background thread on 127.0.0.1 (no signal handlers off the main thread)."""

    def __init__(self, settings: Settings, worker_factory=None):
        self.app = create_app(settings, worker_factory=worker_factory)
        self.port = free_port()
        # the connection limits `longdoc serve` runs with (service/connections.py)
        http = limited_protocol(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, http=http, proxy_headers=False,
                                                    log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        until(lambda: self.server.started or not self.thread.is_alive(), "the server started", 60)
        assert self.server.started, "the server thread ended before it started"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


class ServeProcess:
    """A real `python -m longdoc serve` subprocess on a free loopback port (LONGDOC_THREADS=1 and
    `env` added to the environment, run in `cwd`), its output in `log_path`; entered once /readyz
    says ready, killed on exit if still running."""

    def __init__(self, args: list[str], log_path, env: dict[str, str] | None = None, cwd=None, ready_s: float = 60):
        self.env = dict(os.environ, LONGDOC_THREADS="1", **(env or {}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "longdoc", "serve", "--port", str(self.port), "--log-level", "warning",
                     *args]
        self.log_path = log_path
        self.cwd, self.ready_s = cwd, ready_s

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.cwd)

        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()  # it exited: fail at once, saying why
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(self.url + "/readyz").status_code == 200
            return False

        until(ready, f"/readyz said ready ({self.log_path})", self.ready_s, every_s=0.1)
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
