"""Service test helpers: an app on fake workers, driven in-process through httpx's ASGI
transport with the app's lifespan running."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from service.app import create_app
from service.connections import limited_protocol
from service.settings import Settings
from service.workers import FakeWorker


def fake_factory(**per_task):
    """A worker factory: model name -> FakeWorker(task=name's task, **per_task[task])."""
    made = []

    def factory(name, directory, device, settings):
        task = str(directory)  # tests pass the task as the "directory"
        kwargs = dict(per_task.get(task, {}))
        if any(m.info.name == name for m in made):  # a restart: the new worker does not fail
            kwargs.pop("fail_runs", None)
        w = FakeWorker(name=name, task=task, **kwargs)
        made.append(w)
        return w

    factory.made = made
    return factory


@contextlib.asynccontextmanager
async def running_app(factory=None, **overrides):
    settings = Settings(models=overrides.pop("models", {"qa": "qa", "cls": "classify", "sum": "summarize"}),
                        **overrides)
    app = create_app(settings, worker_factory=factory or fake_factory())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app
            yield client


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
        http = limited_protocol(settings.header_timeout_s, settings.max_connections)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, http=http,
                                                    log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
