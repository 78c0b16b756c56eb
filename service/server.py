"""One server process's HTTP: the app under uvicorn, until SIGTERM/SIGINT and its drain
(`longdoc serve`, and each front end of `longdoc serve --front-ends N`)."""

from __future__ import annotations

import signal
from typing import Callable

import uvicorn

from longdoc.service.app import create_app
from longdoc.service.connections import limited_protocol
from longdoc.service.engine import ModelSource

SHUTDOWN_MARGIN_S = 5.0  # after the shutdown grace: time to write the 503s and close connections


def run_http(settings, worker_factory=None, models: ModelSource | None = None, sockets: list | None = None,
             on_serving: Callable[[], None] | None = None) -> int:
    """The app (create_app's `worker_factory` and `models`) under uvicorn on `sockets` (a front
    end's, listening already) or its own of settings.host and port; `on_serving()` once it accepts
    connections."""
    app = create_app(settings, worker_factory, models)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # the first SIGTERM/SIGINT: /readyz says no at once, then drain for the grace period. A
            # second (Ctrl-C twice) ends the grace now: what is running is answered 503 shutting_down
            # and the server stops as usual. (uvicorn's own second SIGINT, `force_exit`, cancels
            # every request, answering each with its plain-text 500 and logging a traceback.)
            if self.should_exit:
                app.state.service.begin_drain(grace_s=0)
                return
            app.state.service.begin_drain()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and on_serving is not None:
                on_serving()

    # the service answers whatever is still running when the grace is over (503 shutting_down,
    # `event: error` on streams); uvicorn's own limit comes later, so it never cancels a request
    # and answers its plain-text 500 instead
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s + SHUTDOWN_MARGIN_S,
                            access_log=False, proxy_headers=False,  # the client is the peer (docs/service.md)
                            http=limited_protocol(settings))
    server = Server(config)
    # uvicorn re-raises the signal it caught once it has shut down; a drained shutdown exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
