"""`longdoc serve`: run the HTTP service under uvicorn. Imports nothing heavy at module level.

Its flags are derived from `longdoc.service.settings.Settings`: one flag per field (`max_batch_tokens` ->
`--max-batch-tokens`), the field's description as help, its default and its `LONGDOC_*` variable
shown, so a new setting is reachable by flag and by variable without touching this file."""

from __future__ import annotations

import argparse
import sys
import types
import typing

from longdoc.default_models import default_model_dirs, served_from

def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve exported models over HTTP",
        description="Serve exported model directories over HTTP (QA, summarization, classification). "
                    "Every flag is also a LONGDOC_* environment variable; flags win. See docs/service.md.",
    )
    try:
        from longdoc.service.settings import Settings
    except ModuleNotFoundError as exc:  # pydantic-settings & co. come with the serve extra
        p.set_defaults(func=lambda args, exc=exc: _raise(exc))  # longdoc.cli names the extra to install
        return
    for name, field in Settings.model_fields.items():
        if not (field.json_schema_extra or {}).get("no_flag"):  # secrets: a flag would show in `ps`
            _add_setting_flag(p, name, field)
    p.set_defaults(func=serve)


def _raise(exc: Exception) -> int:
    raise exc


def _kind(annotation) -> str:
    """"bool" | "dict" | "list" | "scalar" for a Settings field's type (Optional unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    origin = typing.get_origin(annotation) or annotation
    return {bool: "bool", dict: "dict", list: "list"}.get(origin, "scalar")


def flag_of(name: str, field) -> str:
    """A Settings field's flag: --max-batch-tokens for max_batch_tokens, or json_schema_extra's "flag"."""
    return "--" + (field.json_schema_extra or {}).get("flag", name.replace("_", "-"))


def _metavar(name: str, field) -> str:
    default = {"dict": "KEY=VALUE", "list": "VALUE"}.get(_kind(field.annotation), name.upper())
    return (field.json_schema_extra or {}).get("metavar", default)


def _shown_default(field) -> str:
    default = field.get_default(call_default_factory=True)
    if default is None or default == {}:
        return "unset"
    if isinstance(default, list):
        return " ".join(map(str, default))
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _add_setting_flag(p: argparse.ArgumentParser, name: str, field) -> None:
    help_text = (f"{field.description} (default: {_shown_default(field)}; env LONGDOC_{name.upper()})"
                 .replace("%", "%%"))
    kind = _kind(field.annotation)
    if kind == "bool":
        kwargs = dict(action=argparse.BooleanOptionalAction)
    else:
        kwargs = dict(action="append" if kind in ("dict", "list") else "store", metavar=_metavar(name, field))
    p.add_argument(flag_of(name, field), dest=name, default=None, help=help_text, **kwargs)


def _pairs(flag: str, values: list[str], metavar: str) -> dict[str, str]:
    """`KEY=VALUE` flags (repeatable) -> ordered mapping."""
    pairs: dict[str, str] = {}
    for value in values:
        key, sep, item = value.partition("=")
        if not sep or not key or not item:
            raise ValueError(f"{flag} {value!r}: expected {metavar}")
        if key in pairs:
            raise ValueError(f"{flag} {key!r} given twice")
        pairs[key] = item
    return pairs


def build_settings(args: argparse.Namespace):
    """Settings from LONGDOC_* variables with the flags given on top (a flag replaces a variable's
    value whole); with no models at all, the default models (./models, else longdoc-models)."""
    from pydantic import ValidationError

    from longdoc.service.settings import Settings

    overrides = {}
    for name, field in Settings.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if _kind(field.annotation) == "dict":
            value = _pairs(flag_of(name, field), value, _metavar(name, field))
        overrides[name] = value
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise ValueError(settings_error(exc)) from None
    if not settings.models:
        settings = settings.model_copy(update={"models": default_model_dirs()})
    return settings


def settings_error(exc) -> str:
    """A pydantic ValidationError of Settings as one line naming the flag and the variable."""
    from longdoc.service.settings import Settings

    parts = []
    for e in exc.errors():
        name = str(e["loc"][0]) if e["loc"] else ""
        field = Settings.model_fields.get(name)
        if field is None:  # a check across fields (model validator)
            parts.append(e["msg"].removeprefix("Value error, "))
            continue
        parts.append(f"{flag_of(name, field)} (LONGDOC_{name.upper()}) {e['input']!r}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def check_models(settings) -> None:
    """Every model directory is an export (a readable manifest.json) and every --default-model names
    a served model of its task: one clear line before start-up, not a traceback from the lifespan."""
    from longdoc.export.manifest import Manifest, ManifestError
    from longdoc.export.runtime import parse_device, require_device
    from longdoc.service.settings import choose_default_models

    tasks = {}
    for name, directory in settings.models.items():
        try:
            tasks[name] = Manifest.load(directory).task
        except ManifestError as exc:
            raise ValueError(f"model {name}: {exc}") from None
    choose_default_models(settings.default_models, tasks)
    for device in settings.devices:  # before any model loads, not a traceback from the lifespan
        try:
            require_device(parse_device(device)[0])
        except RuntimeError as exc:
            raise ValueError(f"--device {device}: {exc}; install longdoc[gpu] instead of longdoc[serve]") from None


def check_port(host: str, port: int) -> None:
    """A port another process listens on is one clear line at once, not after every model has
    loaded and warmed up (uvicorn binds only then)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def serve(args: argparse.Namespace, worker_factory=None) -> int:
    """`worker_factory`: create_app's (benchmarks serve a null engine through this same path)."""
    import logging

    settings = build_settings(args)
    check_models(settings)
    check_port(settings.host, settings.port)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("longdoc.service").info("serving models from %s", served_from(settings.models))
    if settings.front_ends > 1:  # one engine process, the front ends serve HTTP (service/frontends.py)
        import shutil

        made = multiprocess_metrics_dir()  # before prometheus-client is imported
        try:
            from longdoc.service.frontends import serve_front_ends

            return serve_front_ends(settings, worker_factory)
        finally:
            if made:
                shutil.rmtree(made, ignore_errors=True)
    from longdoc.service.server import run_http

    return run_http(settings, worker_factory)


def multiprocess_metrics_dir() -> str | None:
    """Metrics summed over the processes of `--front-ends`: prometheus-client reads
    PROMETHEUS_MULTIPROC_DIR when it is imported, so this runs first. The user's directory if set,
    else a new one (returned, to be removed at the end)."""
    import os
    import tempfile

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before the metrics directory was set")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = made = tempfile.mkdtemp(prefix="longdoc-metrics-")
    return made
