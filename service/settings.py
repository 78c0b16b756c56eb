"""Service settings: one pydantic-settings object. Environment variables `LONGDOC_<FIELD>`
(e.g. `LONGDOC_MAX_BATCH_TOKENS=8192`, `LONGDOC_MODELS='{"qa": "models/qa"}'`,
`LONGDOC_DEVICES='["cuda:0"]'`); `longdoc serve` flags override them; tests build it directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from longdoc.export.runtime import parse_device


# Default padded-token budget of one batch, per worker device (`max_batch_tokens` unset). On a
# GPU a batch costs little more than one sequence until the device is full, so batches are big.
# On a CPU a batch costs about the sum of its sequences (ONNX Runtime's threads are busy with one
# sequence already), and beyond a small batch the larger working set costs more than batching
# saves: measured in docs/service.md ("CPU batching defaults"), so a CPU worker batches only
# short sequences (e.g. four of 256 tokens) and runs longer ones alone.
CPU_MAX_BATCH_TOKENS = 1024
GPU_MAX_BATCH_TOKENS = 16384


class Settings(BaseSettings):
    """Every field is a `LONGDOC_<FIELD>` variable and a `longdoc serve --<field>` flag (service/cli.py
    derives the flags from these fields: a field's description is its help). `json_schema_extra`
    "flag" names a repeatable flag in the singular (`--model qa=models/qa --model ...`)."""

    model_config = SettingsConfigDict(env_prefix="LONGDOC_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="port; 0 = any free port")
    models: dict[str, Path] = Field(
        default_factory=dict, json_schema_extra={"flag": "model", "metavar": "NAME=DIR"},
        description="a model directory written by `longdoc export`, served as NAME (repeatable); "
                    "unset: every model directory under models/")
    default_models: dict[str, str] = Field(
        default_factory=dict, json_schema_extra={"flag": "default-model", "metavar": "TASK=NAME"},
        description="the model that answers a TASK request naming no model (repeatable); unset: the model "
                    "named after its task (the shipped models/qa, models/summarize, models/classify), "
                    "else the task's first model in --model order")
    devices: list[str] = Field(
        default_factory=lambda: ["cpu"], json_schema_extra={"flag": "device", "metavar": "cpu|cuda|cuda:N"},
        description="one worker per device for each encoder model (repeatable)")
    threads: int | None = Field(None, ge=1, description="intra-op threads per CPU worker; unset: ONNX Runtime's")
    tokenizer_threads: int = Field(2, ge=1, description="threads per server process that tokenize, window and "
                                                        "shape answers beside its event loop")

    # dynamic batching (per model)
    batching: bool = Field(True, description="dynamic batching; off: every sequence runs alone (for comparison)")
    max_batch_tokens: int | None = Field(
        None, ge=1, description=f"padded tokens per batch; unset: per device, {CPU_MAX_BATCH_TOKENS} on cpu "
                                f"and {GPU_MAX_BATCH_TOKENS} on cuda")
    max_batch_size: int = Field(32, ge=1, description="sequences per batch")
    max_wait_ms: float = Field(2.0, ge=0, description="how long a batch waits to fill up")
    max_queue_tokens: int = Field(262144, ge=1, description="queued tokens per model before 429")
    # the same queue bounded in time: at the measured drain rate, a request that would wait longer
    # gets 429 with an honest Retry-After (docs/service.md, "Admission and fairness")
    max_queue_wait_s: float = Field(10.0, gt=0, description="seconds a request may wait in a model's queue "
                                                            "before 429 (at the measured drain rate)")
    # the share of max_queue_tokens that only small requests may fill (docs/service.md, "Admission
    # and fairness"); a request over the rest is refused with 413
    small_request_share: float = Field(
        0.25, ge=0, lt=1, description="share of max_queue_tokens kept for small requests")
    max_decode_batch: int = Field(16, ge=1, description="sequences decoding together (summarize)")
    overlap_encoding: bool | None = Field(
        None, description="summarize: encode newcomers on a second thread while the decode batch steps; "
                          "unset: on for cuda, off for cpu (where both would share the same cores)")

    decoder_steps: Literal["auto", "dynamic", "fixed", "captured"] = Field(
        "auto", description="summarize: how decoder steps run: fixed (every shape fixed, greedy chosen on the "
                            "device; on cpu a summary does not depend on the load), captured (fixed, replayed as "
                            "CUDA graphs; cuda only) or dynamic (each step at the batch's own lengths; a summary "
                            "can change with the other sequences in its batch); auto: captured on cuda, fixed on cpu")

    # request limits
    max_document_bytes: int = Field(2_000_000, ge=1, description="bytes per document (413 beyond)")
    max_document_tokens: int = Field(65536, ge=1, description="tokens per document (413 beyond)")
    max_documents: int = Field(16, ge=1, description="documents per request")
    qa_stride: int | None = Field(None, ge=1, description="QA window stride in tokens; unset: half a window")
    classify_stride: int | None = Field(None, ge=1, description="classify window stride; unset: windows do not "
                                                                "overlap")
    request_timeout_s: float = Field(60.0, gt=0, description="deadline of a request without X-Request-Timeout")
    max_request_timeout_s: float = Field(600.0, gt=0, description="the largest X-Request-Timeout accepted")

    # slow or huge uploads (service/connections.py, longdoc.service.app.BodyLimitMiddleware)
    header_timeout_s: float = Field(10.0, gt=0, description="request line and headers within this, else 408")
    body_timeout_s: float = Field(60.0, gt=0, description="a whole request body within this, else 408")
    max_connections: int = Field(
        512, ge=1, description="open connections; over it a new one closes a dawdling connection or the slowest "
                               "body of the client holding the most, or gets 503 (a probe is answered)")
    max_connections_per_client: int = Field(
        128, ge=1, description="open connections from one client address (behind a trusted proxy: the forwarded "
                               "client's requests); over it a new one closes one of that client's dawdling "
                               "connections or its slowest body, or gets 503 (a probe is answered)")
    min_upload_bytes_per_s: float = Field(
        1024, gt=0, description="a request body must arrive at this rate on average after its first second, "
                                "else 408 and the connection closes")
    trusted_proxies: list[str] = Field(
        default_factory=list, json_schema_extra={"flag": "trusted-proxy", "metavar": "ADDRESS|NETWORK"},
        description="proxies whose X-Forwarded-For names the client (repeatable; e.g. 10.0.0.0/8): per-client "
                    "limits then count that client; from any other address the header is ignored; unset: "
                    "ignored from every address")
    max_body_bytes_in_flight: int = Field(
        256 * 2**20, ge=1, description="request body bytes buffered by all unanswered requests; over it 503")

    # access (service/access.py): with keys, every path but `open_paths` needs `Authorization:
    # Bearer KEY`. Keys: LONGDOC_API_KEYS="k1,k2" and/or a file (one per line, e.g. a mounted
    # Kubernetes Secret); SecretStr keeps them out of reprs and logs.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, json_schema_extra={"no_flag": True},
        description="API keys, comma-separated or a JSON list (a variable only: a flag would show in `ps`)")
    api_key_file: Path | None = Field(None, description="a file of API keys, one per line (e.g. a mounted Secret)")
    open_paths: list[str] = Field(default_factory=lambda: ["/livez", "/readyz", "/metrics"],
                                  json_schema_extra={"flag": "open-path", "metavar": "PATH"},
                                  description="paths answered without an API key (repeatable)")
    rate_limit_per_s: float | None = Field(None, gt=0, description="requests per second per API key")
    rate_limit_burst: int | None = Field(
        None, ge=1, description="requests one key may send at once; unset: the rate, rounded up")
    auth_failures_per_s: float = Field(
        1.0, gt=0, description="failed authentications per second per client address, after the burst; over "
                               "it every keyed request from that client gets 429")
    auth_failure_burst: int = Field(10, ge=1, description="failed authentications one client may make at once")

    front_ends: int = Field(
        1, ge=1, description="HTTP front-end processes: over 1, that many processes serve HTTP on the port "
                             "(parsing, validation, tokenization, answers) and send their batches to one "
                             "engine process that runs the models (docs/service.md, \"Front ends\")")

    # lifecycle
    warmup: bool = Field(True, description="run each worker once at the maximum length before /readyz says yes")
    shutdown_grace_s: float = Field(30.0, ge=0, description="seconds to finish in-flight work on SIGTERM")
    worker_restart_backoff_s: float = Field(0.5, ge=0, description="pause before restarting a failed worker")
    stream_keepalive_s: float = Field(15.0, gt=0, description="SSE comment after this long without a token")
    worker_restart_max_backoff_s: float = Field(10.0, ge=0, description="restart back-off doubles up to this")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="critical, error, warning, info or debug")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # A value given directly (a flag, a test) replaces the variable's value whole: pydantic-settings
        # would merge a dict's keys from both (LONGDOC_MODELS plus --model would serve both sets).
        def env_not_given() -> dict:
            given = init_settings()
            return {k: v for k, v in env_settings().items() if k not in given}

        return init_settings, env_not_given, dotenv_settings, file_secret_settings

    @model_validator(mode="after")
    def _check_timeouts(self) -> Settings:
        if self.request_timeout_s > self.max_request_timeout_s:
            raise ValueError(f"request_timeout_s {self.request_timeout_s} exceeds max_request_timeout_s "
                             f"{self.max_request_timeout_s}")
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value):
        if isinstance(value, str):  # LONGDOC_API_KEYS="k1,k2" (or a JSON list, like the other list settings)
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    def all_api_keys(self) -> list[str]:
        """`api_keys` and the lines of `api_key_file` (read now: a rotated Secret needs a restart)."""
        from longdoc.service.access import read_key_file

        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_key_file is not None:
            from_file = read_key_file(self.api_key_file)
            if not from_file:  # an empty Secret must not switch authentication off
                raise ValueError(f"api_key_file {self.api_key_file} holds no keys")
            keys += from_file
        return keys

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, proxies: list[str]) -> list[str]:
        import ipaddress

        for proxy in proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(f"{proxy!r} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/8)") from None
        return proxies

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, devices: list[str]) -> list[str]:
        for d in devices:
            parse_device(d)  # raises on anything but cpu, cuda, cuda:N
        if not devices:
            raise ValueError("at least one device")
        return devices

    def batch_tokens_for(self, device: str) -> int:
        """The padded-token budget of a batch on a worker of this device: `max_batch_tokens` if
        set, else CPU_MAX_BATCH_TOKENS for cpu and GPU_MAX_BATCH_TOKENS for cuda / cuda:N."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return CPU_MAX_BATCH_TOKENS if device == "cpu" else GPU_MAX_BATCH_TOKENS


def choose_default_models(given: dict[str, str], tasks: dict[str, str]) -> dict[str, str]:
    """task -> the model answering that task's requests that name no model. `given` is
    `default_models` (task -> name), `tasks` the served models (name -> task, in settings order).
    Unset for a task: the model named after its task (the shipped models/qa, models/summarize,
    models/classify: a user's models/myqa beside them does not take over), else its first model."""
    for task, name in given.items():
        if task not in tasks.values():
            raise ValueError(f"--default-model {task}={name}: no {task} model is served "
                             f"(tasks: {', '.join(sorted(set(tasks.values()))) or 'none'})")
        if tasks.get(name) != task:
            why = f"{name} is a {tasks[name]} model" if name in tasks else f"no model is named {name!r}"
            raise ValueError(f"--default-model {task}={name}: {why}")
    defaults: dict[str, str] = {}
    for name, task in tasks.items():
        defaults.setdefault(task, name)
    for task in defaults:
        if tasks.get(task) == task:
            defaults[task] = task
    return defaults | given
