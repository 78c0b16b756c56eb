"""`longdoc serve`: run the HTTP service under uvicorn. Imports nothing heavy at module level."""

from __future__ import annotations

import argparse
from pathlib import Path


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
    p.add_argument("--threads", type=int, help="intra-op threads per CPU worker")
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-wait-ms", type=float)
    p.add_argument("--max-queue-tokens", type=int)
    p.add_argument("--no-batching", action="store_true", help="run every sequence alone (for comparison)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up pass at the maximum length")
    p.add_argument("--shutdown-grace-s", type=float, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--header-timeout-s", type=float,
                   help="seconds for a request's line and headers, else 408 and close (default 10)")
    p.add_argument("--body-timeout-s", type=float, help="seconds for a whole request body, else 408 (default 60)")
    p.add_argument("--max-connections", type=int, help="open connections; over it a new one gets 503 (default 512)")
    p.add_argument("--max-body-bytes-in-flight", type=int,
                   help="request body bytes buffered by all unanswered requests; over it 503 (default 268435456)")
    p.add_argument("--api-key-file", type=Path,
                   help="file of API keys, one per line; callers send `Authorization: Bearer KEY` (default: "
                        "none, or LONGDOC_API_KEYS=k1,k2; keys are never taken as flags, which `ps` shows)")
    p.add_argument("--rate-limit-per-s", type=float,
                   help="requests per second per API key, over it 429 (default: no limit)")
    p.add_argument("--rate-limit-burst", type=int, help="requests one key may send at once (default: the rate, "
                                                        "rounded up)")
    p.add_argument("--log-level", default="info")
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
        "shutdown_grace_s": args.shutdown_grace_s, "api_key_file": args.api_key_file,
        "rate_limit_per_s": args.rate_limit_per_s, "rate_limit_burst": args.rate_limit_burst,
        "header_timeout_s": args.header_timeout_s, "body_timeout_s": args.body_timeout_s,
        "max_connections": args.max_connections, "max_body_bytes_in_flight": args.max_body_bytes_in_flight,
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
    from service.connections import limited_protocol

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = build_settings(args)
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: /readyz says no at once, then drain
            app.state.service.begin_drain()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s, access_log=False,
                            http=limited_protocol(settings.header_timeout_s, settings.max_connections))
    server = Server(config)
    # uvicorn re-raises the signal it caught once it has shut down; a drained shutdown exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
