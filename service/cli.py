"""`longdoc serve`: run the HTTP service under uvicorn. Imports nothing heavy at module level."""

from __future__ import annotations

import argparse
from pathlib import Path

SHUTDOWN_MARGIN_S = 5.0  # after the shutdown grace: time to write the 503s and close connections


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve exported models over HTTP",
        description="Serve exported model directories over HTTP (QA, summarization, classification). "
                    "Flags override LONGDOC_* environment variables; see docs/service.md.",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument("--model", action="append", metavar="NAME=DIR", default=[],
                   help="a model directory written by `longdoc export` (repeatable); default: every model "
                        "under <repo>/models/")
    p.add_argument("--device", action="append", default=[], metavar="cpu|cuda|cuda:N",
                   help="repeatable: one worker per device for each encoder model (default cpu)")
    p.add_argument("--threads", type=int, help="intra-op threads per CPU worker (default: ONNX Runtime's choice)")
    p.add_argument("--max-batch-tokens", type=int,
                   help="padded tokens per batch (default per device: 1024 on cpu, 16384 on cuda)")
    p.add_argument("--max-batch-size", type=int, help="sequences per batch (default 32)")
    p.add_argument("--max-wait-ms", type=float,
                   help="how long the oldest sequence waits for a fuller batch (default 2)")
    p.add_argument("--max-queue-tokens", type=int,
                   help="queued tokens per model (default 262144; a share of it, LONGDOC_SMALL_REQUEST_SHARE "
                        "default 0.25, is kept for small requests)")
    p.add_argument("--no-batching", action="store_true",
                   help="run every sequence alone, for comparison (default: batching on)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up pass at the maximum length (default: warm up)")
    p.add_argument("--shutdown-grace-s", type=float,
                   help="seconds to finish in-flight work on SIGTERM; what is left is answered 503 "
                        "shutting_down (default 30)")
    p.add_argument("--log-level", default="info", help="uvicorn and service log level (default info)")
    p.set_defaults(func=serve)


def default_model_dirs() -> dict[str, Path]:
    """Every exported model under <repo>/models/ (or ./models/), named by its directory."""
    roots = [Path(__file__).resolve().parents[1] / "models", Path.cwd() / "models"]
    for root in roots:
        found = {d.name: d for d in sorted(root.glob("*")) if (d / "manifest.json").is_file()}
        if found:
            return found
    raise SystemExit(
        "longdoc serve: no models. Pass --model NAME=DIR with a directory written by `longdoc export` "
        "(e.g. `longdoc export CHECKPOINT_DIR models/qa --task qa`), or put exported model directories "
        f"under {roots[0]}/ (see docs/service.md)."
    )


def build_settings(args: argparse.Namespace):
    from service.settings import Settings, parse_model_flags

    flags = {
        "host": args.host, "port": args.port, "threads": args.threads,
        "max_batch_tokens": args.max_batch_tokens, "max_batch_size": args.max_batch_size,
        "max_wait_ms": args.max_wait_ms, "max_queue_tokens": args.max_queue_tokens,
        "shutdown_grace_s": args.shutdown_grace_s,
    }
    overrides = {k: v for k, v in flags.items() if v is not None}
    if args.device:
        overrides["devices"] = args.device
    if args.no_batching:
        overrides["batching"] = False
    if args.no_warmup:
        overrides["warmup"] = False
    settings = Settings(**overrides)  # flags win over LONGDOC_* variables
    if args.model:  # replace, not merge with, LONGDOC_MODELS (pydantic-settings merges dicts)
        settings = settings.model_copy(update={"models": parse_model_flags(args.model)})
    if not settings.models:
        settings = settings.model_copy(update={"models": default_model_dirs()})
    return settings


def serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    import uvicorn

    from service.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = build_settings(args)
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: /readyz says no at once, then drain
            app.state.service.begin_drain()
            super().handle_exit(sig, frame)

    # the service answers whatever is still running when the grace is over (503 shutting_down,
    # `event: error` on streams); uvicorn's own limit comes later, so it never cancels a request
    # and answers its plain-text 500 instead
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s + SHUTDOWN_MARGIN_S,
                            access_log=False)
    server = Server(config)
    # uvicorn re-raises the signal it caught once it has shut down; a drained shutdown exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
