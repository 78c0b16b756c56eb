"""The queue owners: one task per model. Callers `submit` sequences that carry their own futures;
only the batcher task touches the queue (a `BatchingPolicy`) and the workers.

- `EncoderBatcher` (qa, classify): forms batches by the policy, runs each on a free worker in
  that worker's own thread, answers the futures. A request's windows are separate sequences, so
  a request cancelled or past its deadline has its remaining windows skipped.
- `DecodeScheduler` (summarize): iteration-level batching. Every decoder step runs all live
  sequences together; new requests are encoded and join at the next step; finished, cancelled
  or expired sequences leave after the step that finished them. Each sequence's next token is
  model/search.py's greedy choice for that sequence alone (its own length and `SearchSettings`),
  so the answer is the one `OnnxModel.generate` gives. Beam search runs alone through the
  worker's `generate`, which checks the request between decoder steps and stops it too.

A worker whose run raises is replaced (restarted from its factory, in the background, with a
capped back-off); the requests of the failed batch get 503 and the queue keeps going on the other
workers. While a model has no worker up, its queued and new requests get 503 at once with a
`Retry-After` of the next restart attempt, rather than waiting out their deadline.

Admission (`QueueBudget`, service/batching.py) charges a request's whole token cost before
accepting it; `Retry-After` on 429 is the time until a request like it would be admitted, at the
queue's measured drain rate (`DrainRate.departed`: tokens leaving the queue while it has a backlog).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np

from longdoc.export.manifest import PER_TOKEN_OUTPUTS
from longdoc.model.search import GenerationStopped, SearchSettings, is_finished, step_constraints
from longdoc.service.batching import BatchingPolicy, DrainRate, Entry, QueueBudget
from longdoc.service.errors import Cancelled, DeadlineExceeded, Overloaded, TooLarge, Unavailable
from longdoc.service.metrics import Metrics
from longdoc.service.restarts import Backoff, restart_until_up
from longdoc.service.workers import EncoderBatch, Worker

log = logging.getLogger("longdoc.service")


class RequestState:
    """Per request: its deadline (monotonic clock) and whether its client went away."""

    def __init__(self, deadline: float, started: float | None = None):
        self.deadline = deadline
        self.started = time.monotonic() if started is None else started  # its arrival, monotonic clock
        self.cancelled = False

    def is_done(self) -> bool:
        return self.cancelled or time.monotonic() >= self.deadline

    def error(self) -> Exception:
        if self.cancelled:
            return Cancelled("client disconnected")
        return DeadlineExceeded("deadline exceeded")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class WorkerSlot:
    """One worker and the single thread that runs it; replaced on failure. Restart attempts
    back off (service/restarts.py `Backoff`) from `backoff_s`, doubling up to `max_backoff_s`."""

    def __init__(self, factory: Callable[[], Worker], worker: Worker, index: int, backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0):
        self.factory = factory
        self.worker = worker
        self.index = index
        self.backoff = Backoff(backoff_s, max_backoff_s)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{index}")
        self._aside: ThreadPoolExecutor | None = None  # a second thread, for work that overlaps (call_aside)
        self.healthy = True
        self.next_attempt = 0.0  # monotonic time of the next restart attempt, while not healthy

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def call_aside(self, fn, *args):
        """`fn` on the slot's second thread, beside whatever `call` runs (a worker whose
        `overlaps_encoding` is true encodes there while its decoder steps go on)."""
        if self._aside is None:
            self._aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{self.index}-aside")
        return await asyncio.get_running_loop().run_in_executor(self._aside, fn, *args)

    def retry_after(self) -> int:
        """Whole seconds until the next restart attempt (at least 1), for Retry-After."""
        return max(1, math.ceil(self.next_attempt - time.monotonic()))

    def mark_down(self) -> None:
        """Not healthy; the first restart attempt is due after `backoff_s`."""
        self.healthy = False
        self.next_attempt = time.monotonic() + self.backoff.delay

    async def restart(self, metrics: Metrics, model: str) -> None:
        """Replace the worker from its factory (service/restarts.py: its back-off, until one is made)."""
        if self.healthy:
            self.mark_down()
        metrics.refresh_ready()
        old = self.worker

        async def replace() -> Worker:
            try:
                await self.call(old.close)
            except Exception:  # noqa: BLE001 - a broken worker may fail to close too
                pass
            return await self.call(self.factory)

        def waiting(delay: float) -> None:
            self.next_attempt = time.monotonic() + delay

        self.worker = await restart_until_up(replace, self.backoff, f"worker {self.index} of {model}", waiting=waiting)
        metrics.worker_restarts.labels(model).inc()
        self.healthy = True
        metrics.refresh_ready()

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self._aside is not None:
                self._aside.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class Sequence:
    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None
    request: RequestState
    future: asyncio.Future
    enqueued: float = 0.0
    started: float = 0.0
    finished: float = 0.0


@dataclass(frozen=True)
class SequenceResult:
    outputs: dict[str, np.ndarray]  # this sequence's outputs, (S, ...) for its own length S
    queue_s: float
    inference_s: float


def admit(model: str, budget: QueueBudget, rate: DrainRate, queued: int, cost: int, running: int = 0) -> None:
    """Raise 413 for a request that can never be admitted, 429 for one that cannot be admitted yet,
    with Retry-After = the time until a request like it would be admitted: until enough of the
    queue has drained, at the measured rate, for its tokens to fit and its wait to be within
    `max_wait_s`. (The time for the whole queue and the request to drain, used before, said 11-12 s
    while the next request after a 429 was admitted 0.2-0.5 s later: clients that obeyed it lost
    their turn to clients that retried at once.) `running`: tokens of batches under way, which a
    new request waits for too (not charged to the token budget)."""
    if cost > budget.max_request_tokens:
        raise TooLarge(f"request needs {cost} tokens of model {model}'s queue; the limit per request is "
                       f"{budget.max_request_tokens} tokens: max_queue_tokens {budget.max_tokens} less the "
                       f"share kept for small requests (small_request_share)", "max_queue_tokens")
    excess, late = budget.excess(queued, cost), budget.late(queued + running, cost, rate.tokens_per_s)
    if excess >= late and excess:
        raise Overloaded(f"model {model} has {queued} tokens queued; this request needs {cost} "
                         f"(limit {budget.max_tokens}, small requests {budget.reserve} of them)",
                         rate.retry_after(excess))
    if late:
        raise Overloaded(f"model {model} has {queued} tokens queued: this request would wait about "
                         f"{rate.seconds(queued + running + cost):.1f} s (limit {budget.max_wait_s:g} s)",
                         rate.retry_after(late))


def worker_down(model: str, slots: list[WorkerSlot]) -> Unavailable:
    soonest = min(s.retry_after() for s in slots)
    return Unavailable(f"model {model}: no worker is up (restarting); retry", {"Retry-After": str(soonest)})


class EncoderBatcher:
    def __init__(self, model: str, slots: list[WorkerSlot], policy: BatchingPolicy, metrics: Metrics,
                 max_queue_tokens: int, pad_id: int, small_share: float = 0.25, *, endpoint: str,
                 max_queue_wait_s: float = math.inf):
        self.model = model
        self.endpoint = endpoint  # the task this model serves, for longdoc_input_tokens_total
        metrics.input_tokens.labels(model, endpoint)  # exported from 0 on
        self.slots = slots
        self.policy = policy
        self.metrics = metrics
        self.budget = QueueBudget(max_queue_tokens, small_share, max_queue_wait_s)
        self.pad_id = pad_id
        self.rate = DrainRate()  # for Retry-After
        self.running_tokens = 0  # of the batches the workers run now
        self._wake = asyncio.Event()
        self._idle: asyncio.Queue[WorkerSlot] = asyncio.Queue()
        for s in slots:
            self._idle.put_nowait(s)
        self._tasks: set[asyncio.Task] = set()  # batches running
        self._restarts: set[asyncio.Task] = set()  # not waited for by drain: nothing is in flight there
        self._loop_task: asyncio.Task | None = None
        self.draining = False

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name=f"batcher-{self.model}")

    def healthy(self) -> bool:
        return all(s.healthy and s.worker.health() for s in self.slots)

    def _gauges(self) -> None:
        self.metrics.queue_requests.labels(self.model).set(len(self.policy))
        self.metrics.queue_tokens.labels(self.model).set(self.policy.queued_tokens)

    async def submit(self, sequences: list[tuple[tuple[int, ...], tuple[int, ...] | None]],
                     request: RequestState) -> list[SequenceResult]:
        """Queue a request's sequences; wait for all (or for its deadline/cancellation)."""
        if not any(s.healthy for s in self.slots):
            raise worker_down(self.model, self.slots)
        admit(self.model, self.budget, self.rate, self.policy.queued_tokens, sum(len(ids) for ids, _ in sequences),
              running=self.running_tokens)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        seqs = [Sequence(ids, types, request, loop.create_future(), enqueued=now) for ids, types in sequences]
        for s in seqs:
            self.policy.append(Entry(len(s.input_ids), now, s, lambda s=s: s.future.done() or request.is_done(),
                                     owner=request))
        self._gauges()
        self._wake.set()
        try:
            async with asyncio.timeout(max(request.remaining(), 0.0)):
                await asyncio.gather(*(s.future for s in seqs))
        except TimeoutError:  # its queued windows are skipped: request.is_done() is now true
            raise DeadlineExceeded(f"deadline exceeded {time.monotonic() - request.started:.3f} s after the request "
                                   f"arrived") from None
        finally:
            if any(not s.future.done() for s in seqs):  # cancelled/timed out: leave nothing behind
                for s in seqs:
                    if not s.future.done():
                        s.future.cancel()
                self._wake.set()
        first = min(s.started for s in seqs)
        return [
            SequenceResult(s.future.result(), queue_s=first - now, inference_s=max(x.finished for x in seqs) - first)
            for s in seqs
        ]

    async def _loop(self) -> None:
        while True:
            slot = await self._idle.get()
            batch = await self._next_batch(slot)
            task = asyncio.create_task(self._run(slot, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _next_batch(self, slot: WorkerSlot):
        while True:
            self._wake.clear()
            for e in self.policy.drop_cancelled():
                if not e.payload.future.done():
                    e.payload.future.set_exception(e.payload.request.error())
            now = time.monotonic()
            batch = self.policy.next_batch(now, budget=slot.worker.max_batch_tokens, force=self.draining)
            self._gauges()
            if batch is not None:
                return batch
            wake = self.policy.next_wakeup()
            try:
                async with asyncio.timeout(None if wake is None else max(wake - now, 0.0)):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _run(self, slot: WorkerSlot, batch) -> None:
        seqs: list[Sequence] = [e.payload for e in batch.entries if not e.payload.future.done()]
        if not seqs:
            self._idle.put_nowait(slot)
            return
        longest = max(len(s.input_ids) for s in seqs)
        ids = np.full((len(seqs), longest), self.pad_id, dtype=np.int64)  # (B, S)
        mask = np.zeros((len(seqs), longest), dtype=np.int64)
        types = None if seqs[0].token_type_ids is None else np.zeros((len(seqs), longest), dtype=np.int64)
        for i, s in enumerate(seqs):
            n = len(s.input_ids)
            ids[i, :n], mask[i, :n] = s.input_ids, 1
            if types is not None:
                types[i, :n] = s.token_type_ids
        started = time.monotonic()
        for s in seqs:
            s.started = started
        tokens = int(mask.sum())
        self.running_tokens += tokens
        try:
            out = await slot.call(slot.worker.run, EncoderBatch(ids, mask, types))
        except Exception as exc:
            log.exception("worker %d of %s failed on a batch of %d", slot.index, self.model, len(seqs))
            for s in seqs:
                if not s.future.done():
                    s.future.set_exception(Unavailable(f"model {self.model}: worker failed ({type(exc).__name__}); retry"))
            task = asyncio.create_task(self._restart(slot))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)
            return
        finally:
            self.running_tokens -= tokens
        finished = time.monotonic()
        # tokens leave when their batch is answered: with a backlog, the pace of all workers together
        self.rate.departed(tokens, finished, still_queued=len(self.policy) > 0 or self.running_tokens > 0)
        real = tokens
        padded = batch.bucket_length * len(seqs)
        self.metrics.batch_size.labels(self.model).observe(len(seqs))
        self.metrics.batch_tokens.labels(self.model).observe(padded)
        self.metrics.padding_waste.labels(self.model).observe(1.0 - real / padded)
        self.metrics.input_tokens.labels(self.model, self.endpoint).inc(real)
        per_token = PER_TOKEN_OUTPUTS[self.endpoint]  # (B, S, ...): cut to each length
        for i, s in enumerate(seqs):
            s.finished = finished
            if not s.future.done():
                n = len(s.input_ids)
                s.future.set_result({k: v[i, :n] if k in per_token else v[i] for k, v in out.items()})
        self._idle.put_nowait(slot)
        self._wake.set()

    async def _restart(self, slot: WorkerSlot) -> None:
        slot.mark_down()
        if not any(s.healthy for s in self.slots):  # nobody can run the queue: answer it now
            error = worker_down(self.model, self.slots)
            while (b := self.policy.next_batch(time.monotonic(), force=True)) is not None:
                for e in b.entries:
                    if not e.payload.future.done():
                        e.payload.future.set_exception(error)
            self._gauges()
        await slot.restart(self.metrics, self.model)
        self._idle.put_nowait(slot)
        self._wake.set()

    async def drain(self, grace_s: float) -> None:
        """Run what is queued (without waiting for fuller batches) until empty or grace is over."""
        self.draining = True
        self._wake.set()
        end = time.monotonic() + grace_s
        while (len(self.policy) or self._tasks) and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        for t in list(self._tasks) + list(self._restarts):
            t.cancel()
        for e in self.policy.drop_cancelled():
            pass
        while (b := self.policy.next_batch(time.monotonic(), force=True)) is not None:
            for e in b.entries:
                if not e.payload.future.done():
                    e.payload.future.set_exception(Unavailable("server shutting down"))
        for s in self.slots:
            s.close()


# ---------------------------------------------------------------------------------------------
# summarization


@dataclass(eq=False)
class DecodeJob:
    input_ids: list[int]
    settings: SearchSettings
    request: RequestState
    tokens: asyncio.Queue  # ints, then None (done) or an Exception
    enqueued: float
    started: float = 0.0
    state: Any = None
    sequence: list[int] = field(default_factory=list)  # decoder tokens so far, decoder_start first
    abandoned: bool = False  # its consumer is gone

    def is_done(self) -> bool:
        return self.abandoned or self.request.is_done()


class DecodeScheduler:
    def __init__(self, model: str, slot: WorkerSlot, metrics: Metrics, max_decode_batch: int,
                 max_queue_tokens: int, small_share: float = 0.25, *, endpoint: str,
                 max_queue_wait_s: float = math.inf):
        self.model = model
        self.endpoint = endpoint  # the task this model serves, for longdoc_input_tokens_total
        metrics.input_tokens.labels(model, endpoint)  # exported from 0 on
        self.slot = slot
        self.slots = [slot]
        self.metrics = metrics
        self.max_decode_batch = max_decode_batch
        self.budget = QueueBudget(max_queue_tokens, small_share, max_queue_wait_s)
        self.rate = DrainRate()  # tokens leaving `pending` per second, for Retry-After
        self.pending: list[DecodeJob] = []
        self.running: list[DecodeJob] = []
        self._joining: list[DecodeJob] = []  # being encoded beside the steps (a worker that overlaps_encoding)
        self._encoding: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.draining = False

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name=f"decoder-{self.model}")

    def healthy(self) -> bool:
        return self.slot.healthy and self.slot.worker.health()

    def _queued_tokens(self) -> int:
        return sum(len(j.input_ids) for j in self.pending)

    async def submit(self, input_ids: list[int], settings: SearchSettings,
                     request: RequestState) -> AsyncIterator[int]:
        """Yields generated token ids as they come (not the eos that ends them); raises the
        request's error if it fails."""
        if not self.slot.healthy:
            raise worker_down(self.model, self.slots)
        admit(self.model, self.budget, self.rate, self._queued_tokens(), len(input_ids))
        job = DecodeJob(list(input_ids), settings, request, asyncio.Queue(), time.monotonic())
        self.pending.append(job)
        self._gauges()
        self._wake.set()
        return self._stream(job)

    async def _stream(self, job: DecodeJob) -> AsyncIterator[int]:
        try:
            while True:
                try:
                    async with asyncio.timeout(max(job.request.remaining(), 0.0)):
                        item = await job.tokens.get()
                except TimeoutError:
                    raise DeadlineExceeded("deadline exceeded while summarizing") from None
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # finished, failed, or the consumer stopped reading: leave the batch
            job.abandoned = True
            self._wake.set()

    def _gauges(self) -> None:
        self.metrics.queue_requests.labels(self.model).set(len(self.pending))
        self.metrics.queue_tokens.labels(self.model).set(self._queued_tokens())

    def _left_queue(self, tokens: int) -> None:
        """Jobs left `pending` for the decoding batch."""
        self.rate.departed(tokens, time.monotonic(), still_queued=bool(self.pending))
        self._gauges()

    def _finish(self, job: DecodeJob, item) -> None:
        job.tokens.put_nowait(item)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            if not (self.pending or self.running or self._encoding):
                await self._wake.wait()
                continue
            try:
                self._join_encoded()
                await self._admit()
                if self.running:
                    await self._step()
                elif self._encoding is not None and not self._encoding.done():
                    await self._wake.wait()  # nothing to step until the encoder (or a new request) is done
            except Exception as exc:  # the worker failed: everyone in flight gets 503
                log.exception("decoder worker of %s failed", self.model)
                failed = Unavailable(f"model {self.model}: worker failed ({type(exc).__name__}); retry")
                if self._encoding is not None:
                    self._encoding.cancel()
                for job in self.running + self._joining:
                    self._finish(job, failed)
                self.running, self._joining, self._encoding = [], [], None
                self.slot.mark_down()
                error = worker_down(self.model, self.slots)
                for job in self.pending:  # nobody can run them until the restart: answer them now
                    self._finish(job, error)
                self.pending = []
                self._gauges()
                await self.slot.restart(self.metrics, self.model)

    def _join_encoded(self) -> None:
        """The group encoded beside the steps joins the running batch (or its failure is raised)."""
        if self._encoding is not None and self._encoding.done():
            task, self._encoding = self._encoding, None
            joined, self._joining = self._joining, []
            if task.exception() is not None:
                exc = task.exception()
                for j in joined:
                    self._finish(j, Unavailable(f"model {self.model}: worker failed ({type(exc).__name__}); retry"))
                raise exc
            self.running.extend(joined)

    async def _encode(self, joining: list[DecodeJob]) -> None:
        states = await self.slot.call_aside(self.slot.worker.begin, [j.input_ids for j in joining])
        self._started(joining, states)

    def _started(self, joining: list[DecodeJob], states: list) -> None:
        self.metrics.input_tokens.labels(self.model, self.endpoint).inc(sum(len(j.input_ids) for j in joining))
        now = time.monotonic()
        for j, s in zip(joining, states):
            j.state, j.sequence, j.started = s, [j.settings.decoder_start_token_id], now

    async def _admit(self) -> None:
        # drop requests that ended while queued
        for job in [j for j in self.pending if j.is_done()]:
            self.pending.remove(job)
            self._finish(job, job.request.error())
        room = self.max_decode_batch - len(self.running)
        if room <= 0 or not self.pending:
            self._gauges()
            return
        if self._encoding is not None:  # one group is encoded at a time
            return
        head = self.pending[0]
        if head.settings.num_beams > 1:  # beam search runs alone and whole, in FIFO order:
            if self.running:  # let the running batch finish first, admit nobody past it
                return
            job = self.pending.pop(0)
            self._left_queue(len(job.input_ids))
            job.started = time.monotonic()
            try:  # job.is_done reads a flag and the clock: safe from the worker thread
                out = await self.slot.call(self.slot.worker.generate, job.input_ids, job.settings, job.is_done)
            except GenerationStopped:  # past its deadline or its client left: stopped between steps
                self.metrics.input_tokens.labels(self.model, self.endpoint).inc(len(job.input_ids))
                self._finish(job, job.request.error())
                return
            except Exception as exc:
                self._finish(job, Unavailable(f"model {self.model}: worker failed ({type(exc).__name__}); retry"))
                raise
            self.metrics.input_tokens.labels(self.model, self.endpoint).inc(len(job.input_ids))
            self.metrics.generated_tokens.labels(self.model).inc(len(out))
            for t in out:
                job.tokens.put_nowait(int(t))
            self._finish(job, None)
            return
        joining = []
        for j in self.pending:  # greedy requests up to the next beam-search one
            if j.settings.num_beams > 1 or len(joining) == room:
                break
            joining.append(j)
        for j in joining:
            self.pending.remove(j)
        self._left_queue(sum(len(j.input_ids) for j in joining))
        if self.slot.worker.overlaps_encoding:  # encode beside the running batch's steps
            self._joining = joining
            self._encoding = asyncio.create_task(self._encode(joining), name=f"encoder-{self.model}")
            self._encoding.add_done_callback(lambda _: self._wake.set())
            return
        try:
            states = await self.slot.call(self.slot.worker.begin, [j.input_ids for j in joining])
        except Exception as exc:
            for j in joining:
                self._finish(j, Unavailable(f"model {self.model}: worker failed ({type(exc).__name__}); retry"))
            raise
        self._started(joining, states)
        self.running.extend(joining)

    async def _step(self) -> None:
        live = []
        for job in self.running:  # leave before the step: cancelled or past deadline
            if job.is_done():
                self._finish(job, job.request.error())
            else:
                live.append(job)
        self.running = live
        if not live:
            await self.slot.call(self.slot.worker.release)
            return
        self.metrics.batch_size.labels(self.model).observe(len(live))  # sequences in this decoder step
        # each sequence's greedy choice under its own settings (model/search.py's processors as
        # constraints, which the worker applies on the device or to the logits on the host)
        constraints = [step_constraints(j.sequence, j.settings) for j in live]
        chosen = await self.slot.call(self.slot.worker.step_greedy, [j.state for j in live],
                                      [j.sequence[-1] for j in live], constraints)
        still = []
        for job, tok in zip(live, chosen):
            s = job.settings
            job.sequence.append(tok)
            if tok not in s.eos_token_ids:  # the eos that ends a summary is not part of it
                job.tokens.put_nowait(tok)
                self.metrics.generated_tokens.labels(self.model).inc()
            if is_finished(len(job.sequence), tok, s):
                self._finish(job, None)
            else:
                still.append(job)
        self.running = still
        if not still:  # the last sequence left: its device state goes with it
            await self.slot.call(self.slot.worker.release)

    async def drain(self, grace_s: float) -> None:
        self.draining = True
        end = time.monotonic() + grace_s
        while (self.pending or self.running or self._joining) and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        if self._encoding is not None:
            self._encoding.cancel()
        for job in self.pending + self.running + self._joining:
            self._finish(job, Unavailable("server shutting down"))
        self.slot.close()
