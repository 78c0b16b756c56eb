"""Service settings: one pydantic-settings object. Environment variables `LONGDOC_<FIELD>`
(e.g. `LONGDOC_MAX_BATCH_TOKENS=8192`, `LONGDOC_MODELS='{"qa": "models/qa"}'`,
`LONGDOC_DEVICES='["cuda:0"]'`); `longdoc serve` flags override them; tests build it directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


# Default padded-token budget of one batch, per worker device (`max_batch_tokens` unset). On a
# GPU a batch costs little more than one sequence until the device is full, so batches are big.
# On a CPU a batch costs about the sum of its sequences (ONNX Runtime's threads are busy with one
# sequence already), and beyond a small batch the larger working set costs more than batching
# saves: measured in docs/service.md ("CPU batching defaults"), so a CPU worker batches only
# short sequences (e.g. four of 256 tokens) and runs longer ones alone.
CPU_MAX_BATCH_TOKENS = 1024
GPU_MAX_BATCH_TOKENS = 16384


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LONGDOC_", frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # name -> model directory (export/ layout, manifest.json). Order matters: the first model of
    # a task is that task's default.
    models: dict[str, Path] = Field(default_factory=dict)
    # "cpu", "cuda" or "cuda:N"; each encoder model gets one worker per device.
    devices: list[str] = Field(default_factory=lambda: ["cpu"])
    threads: int | None = Field(None, ge=1, description="intra-op threads per CPU worker")
    tokenizer_threads: int = Field(2, ge=1)

    # dynamic batching (per model)
    batching: bool = True  # False: every sequence runs alone (max_batch_size 1, no wait)
    max_batch_tokens: int | None = Field(
        None, ge=1, description="padded tokens per batch; unset: per device (batch_tokens_for)")
    max_batch_size: int = Field(32, ge=1)
    max_wait_ms: float = Field(2.0, ge=0)
    max_queue_tokens: int = Field(262144, ge=1, description="queued tokens per model before 429")
    max_decode_batch: int = Field(16, ge=1, description="sequences decoding together (summarize)")

    # request limits
    max_document_bytes: int = Field(2_000_000, ge=1)
    max_document_tokens: int = Field(65536, ge=1)
    max_documents: int = Field(16, ge=1)
    qa_stride: int | None = Field(None, ge=1, description="QA window stride in tokens; default half a window")
    classify_stride: int | None = Field(None, ge=1, description="default: windows do not overlap")
    request_timeout_s: float = Field(60.0, gt=0)
    max_request_timeout_s: float = Field(600.0, gt=0)

    # slow or huge uploads (service/connections.py, service.app.BodyLimitMiddleware)
    header_timeout_s: float = Field(10.0, gt=0, description="request line and headers within this, else 408")
    body_timeout_s: float = Field(60.0, gt=0, description="a whole request body within this, else 408")
    max_connections: int = Field(512, ge=1, description="open connections; over it a new one gets 503")
    max_body_bytes_in_flight: int = Field(
        256 * 2**20, ge=1, description="request body bytes buffered by all unanswered requests; over it 503")

    # access (service/access.py): with keys, every path but `open_paths` needs `Authorization:
    # Bearer KEY`. Keys: LONGDOC_API_KEYS="k1,k2" and/or a file (one per line, e.g. a mounted
    # Kubernetes Secret); SecretStr keeps them out of reprs and logs.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    api_key_file: Path | None = None
    open_paths: list[str] = Field(default_factory=lambda: ["/livez", "/readyz", "/metrics"])
    rate_limit_per_s: float | None = Field(None, gt=0, description="requests per second per API key")
    rate_limit_burst: int | None = Field(None, ge=1, description="default: the rate, rounded up")

    # lifecycle
    warmup: bool = True  # run each worker once at the maximum length before /readyz says yes
    shutdown_grace_s: float = Field(30.0, ge=0)
    worker_restart_backoff_s: float = Field(0.5, ge=0)

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
        from service.access import read_key_file

        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_key_file is not None:
            from_file = read_key_file(self.api_key_file)
            if not from_file:  # an empty Secret must not switch authentication off
                raise ValueError(f"api_key_file {self.api_key_file} holds no keys")
            keys += from_file
        return keys

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


def parse_device(device: str) -> tuple[str, int]:
    """"cpu" -> ("cpu", 0); "cuda" -> ("cuda", 0); "cuda:N" -> ("cuda", N)."""
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    return "cuda", int(index)


def parse_model_flags(flags: list[str]) -> dict[str, Path]:
    """`NAME=DIR` flags (repeatable) -> ordered mapping."""
    models: dict[str, Path] = {}
    for flag in flags:
        name, sep, directory = flag.partition("=")
        if not sep or not name or not directory:
            raise ValueError(f"--model {flag!r}: expected NAME=DIR")
        if name in models:
            raise ValueError(f"--model {name!r} given twice")
        models[name] = Path(directory)
    return models
