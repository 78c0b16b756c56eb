"""Service test helpers: an app on fake workers, driven in-process through httpx's ASGI
transport with the app's lifespan running."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from service.app import create_app
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


@pytest.fixture
def anyio_backend():
    return "asyncio"
