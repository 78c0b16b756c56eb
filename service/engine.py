"""The seam between the routes and the devices: a served model's `Engine`, and where a Service's
models come from (`ModelSource`), chosen where the app is assembled (service/app.py).

    routes -> Service.model_for(task) -> ServedModel.engine.submit(...)
        LocalModels:   the engines are this process's batchers (service/batcher.py) over its workers
        RemoteModels:  a front end's: the engine process's batchers, across its socket (service/frontends.py)

The routes, the Service and the front ends see only these protocols; what is behind them is
decided once, by the `ModelSource` the app is built with (as TEI's router sees one backend trait).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from longdoc.service.batcher import DecodeScheduler, EncoderBatcher, WorkerSlot
from longdoc.service.batching import BatchingPolicy
from longdoc.service.metrics import Metrics, length_buckets
from longdoc.service.settings import Settings
from longdoc.service.workers import ModelInfo, Worker

TASKS = ("qa", "summarize", "classify", "embed")
WorkerFactory = Callable[[str, Path, str, Settings], Worker]


class Engine(Protocol):
    """One model's queue to its workers, started when built: `EncoderBatcher` / `DecodeScheduler`
    here, `RemoteEncoder` / `RemoteDecoder` in a front end (the engine process's, across its socket)."""

    async def submit(self, *work: Any) -> Any:
        """One request's work, its `RequestState` last. An encoder: (sequences, request) -> one
        `SequenceResult` per sequence; a decoder: (input_ids, SearchSettings, request) -> an async
        iterator of token ids. Raises the request's `ServiceError` (429, 503, 504, ...)."""
        ...

    def healthy(self) -> bool:
        """Whether it can serve now (a worker is up; for a remote engine: the engine process is ready)."""
        ...

    async def drain(self, grace_s: float) -> None:
        """Run what is queued, for up to `grace_s` seconds (shutdown)."""
        ...

    async def close(self) -> None:
        """Stop; whatever is still queued fails with 503."""
        ...


@dataclass(eq=False)
class ServedModel:
    info: ModelInfo
    devices: list[str]
    engine: Engine
    length_bounds: tuple[int, ...]


class ModelSource(Protocol):
    """Where a Service's models and their engines come from."""

    async def open(self, metrics: Metrics) -> dict[str, ServedModel]:
        """The served models, name -> ServedModel, their engines started (recording into `metrics`)."""
        ...

    async def close(self) -> None:
        """After every engine is closed."""
        ...


class LocalModels:
    """Every model of `settings` on every device: a worker per device (warmed up at the maximum
    length unless `warmup` is off) and one engine per model."""

    def __init__(self, settings: Settings, worker_factory: WorkerFactory):
        self.settings = settings
        self.worker_factory = worker_factory

    async def open(self, metrics: Metrics) -> dict[str, ServedModel]:
        models = {}
        for name, directory in self.settings.models.items():
            slots = []
            for i, device in enumerate(self.settings.devices):
                factory = lambda name=name, directory=directory, device=device: self._load(name, directory, device)  # noqa: E731
                slots.append(WorkerSlot(factory, await asyncio.to_thread(factory), i,
                                        self.settings.worker_restart_backoff_s,
                                        self.settings.worker_restart_max_backoff_s))
            models[name] = self._serve(name, slots, metrics)
        return models

    def _serve(self, name: str, slots: list[WorkerSlot], metrics: Metrics) -> ServedModel:
        s = self.settings
        info = slots[0].worker.info
        if info.task not in TASKS:
            raise ValueError(f"model {name}: task {info.task!r} is not served (serving {', '.join(TASKS)})")
        if info.task == "summarize":
            for extra in slots[1:]:  # one decoding loop per model (see docs/service.md)
                extra.close()
            engine = DecodeScheduler(name, slots[0], metrics, s.max_decode_batch, s.max_queue_tokens,
                                     small_share=s.small_request_share, endpoint=info.task,
                                     max_queue_wait_s=s.max_queue_wait_s)
            devices = [s.devices[0]]
        else:
            policy = BatchingPolicy(
                # each worker passes its own budget (batch_tokens_for its device); this is the fallback
                max_batch_tokens=max(s.batch_tokens_for(d) for d in s.devices),
                max_batch_size=s.max_batch_size if s.batching else 1,
                max_wait_s=s.max_wait_ms / 1000.0 if s.batching else 0.0,
                bucket_size=info.block_size,
            )
            engine = EncoderBatcher(name, slots, policy, metrics, s.max_queue_tokens,
                                    pad_id=int(info.special_tokens.get("pad") or 0),
                                    small_share=s.small_request_share, endpoint=info.task,
                                    max_queue_wait_s=s.max_queue_wait_s)
            devices = list(s.devices)
        engine.start()
        return ServedModel(info, devices, engine, length_buckets(info.max_length, info.block_size))

    def _load(self, name: str, directory: Path, device: str) -> Worker:
        worker = self.worker_factory(name, directory, device, self.settings)
        if self.settings.warmup:
            worker.warmup()
        return worker

    async def close(self) -> None:
        pass
