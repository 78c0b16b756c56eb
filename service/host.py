"""The host path's CPU work: tokenization, windows and answer shaping, as pure functions of a
model's `ModelInfo` and a validated job, and the pool that runs them beside the event loop.

    event loop (one process): HTTP, body checks, validation, batchers, responses
        -> HostPool.call(fn, info, ...) -> prepare_qa / prepare_classify / prepare_summarize / qa_spans

Per 4096-token QA document the tokenizer takes about 20 ms of CPU and answer shaping 2 ms,
against well under a millisecond for the rest of the request (docs/service.md, "Host path"); in
one process that work is serialized in front of the device. So it runs in a pool:

- processes (`host_processes` > 0, the default on more than one core): a spawned
  ProcessPoolExecutor. Each process receives every served model's `ModelInfo` (its tokenizer
  included) once, when it starts; a call sends the model's name and the job (the documents' text)
  and gets compact numpy arrays back. The event loop only shuttles them: the one batcher per
  model still sees every request, so batches form across all of them, and the metrics stay in
  one process. (vLLM splits its API server from its engine core the same way, by role.)
- threads (`host_processes` 0): the same functions in a thread pool of the server process
  (`tokenizer_threads`); tokenizers' `encode_batch` releases the GIL, the rest holds it.

One set of functions either way, so the answers are the same. A pool process that dies (killed,
out of memory) fails the calls it held with 503 `unavailable`, and the pool is replaced at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from longdoc.export import windows as W
from longdoc.service.errors import DeadlineExceeded, InvalidRequest, TooLarge, Unavailable

log = logging.getLogger("longdoc.service")


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD" (a container's CPU limit)


def usable_cores() -> int:
    """The CPU cores this process may use, not the machine's: its affinity (taskset, cpusets),
    and at most its cgroup's CPU quota, rounded up (a Kubernetes pod limited to 2 CPUs on a
    64-core node gets 2 pool processes, not 64)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


# ---------------------------------------------------------------------------------------------
# the work: pure functions of (ModelInfo, job, ...), run in the pool


def encode(info, text: str, limit: int, what: str = "document"):
    # encode_batch releases the GIL while it runs (encode holds it: 2.2 s for a 2 MB document, and
    # every thread, the event loop and the request's deadline included, waits); the token count is
    # checked before the ids and offsets become Python lists
    (enc,) = info.tokenizer.encode_batch([text], add_special_tokens=False)
    if len(enc) == 0:  # e.g. only characters this tokenizer's normalizer drops: nothing to answer from
        raise InvalidRequest(f"{what} has no tokens (only characters the model's tokenizer drops)")
    if len(enc) > limit:
        raise TooLarge(f"{what} has {len(enc)} tokens; the limit is {limit} tokens")
    return enc.ids, enc.offsets


@dataclass(frozen=True)
class QADocument:
    """A QA document's windows as arrays (what crosses the process boundary)."""

    input_ids: list[np.ndarray]  # per window (S,) int64: [CLS] question [SEP] doc[a:b] [SEP]
    token_type_ids: list[np.ndarray]  # per window (S,) int64
    windows: np.ndarray  # (n_windows, 3) int64: doc_start, doc_end, offset (export/windows.py QAWindow)
    offsets: np.ndarray  # (n_tokens, 2) int64: each document token's character span
    n_tokens: int


def _array(ints, n: int = -1) -> np.ndarray:
    """(n,) int64 from an iterable of ints (np.fromiter: a third of np.asarray's time on tuples)."""
    return np.fromiter(ints, np.int64, n if n >= 0 else len(ints))


def prepare_qa(info, job, stride: int | None, limit: int) -> list[QADocument]:
    q, _ = encode(info, job.question, limit, "question")
    room = info.max_length - len(q) - 3
    if room < max(1, info.max_length // 4):  # the document needs room in each window
        raise InvalidRequest(
            f"question has {len(q)} tokens; at most {info.max_length - 3 - max(1, info.max_length // 4)} "
            f"fit with a {info.max_length}-token window"
        )
    sp = info.special_tokens
    out = []
    for doc in job.common.documents:
        ids, offsets = encode(info, doc, limit)
        windows = W.qa_windows(q, ids, info.max_length, stride, int(sp["cls"]), int(sp["sep"]))
        out.append(QADocument(
            [_array(w.input_ids) for w in windows],
            [_array(w.token_type_ids) for w in windows],
            np.asarray([(w.doc_start, w.doc_end, w.offset) for w in windows], np.int64).reshape(-1, 3),
            _array(itertools.chain.from_iterable(offsets), 2 * len(offsets)).reshape(-1, 2),
            len(ids),
        ))
    return out


def qa_spans(info, documents: list[tuple[np.ndarray, np.ndarray]], start_logits: list[list[np.ndarray]],
             end_logits: list[list[np.ndarray]], top_k: int, max_answer_tokens: int) -> list[list[tuple]]:
    """Per document ((windows, offsets) of its QADocument, its windows' logits): the best spans
    (export/windows.py best_spans) as (char start, char end, score)."""
    out = []
    for (windows, offsets), starts, ends in zip(documents, start_logits, end_logits):
        spans = W.best_spans([W.QAWindow((), (), int(a), int(b), int(o)) for a, b, o in windows],
                             starts, ends, offsets, top_k, max_answer_tokens)
        out.append([(int(s.start), int(s.end), s.score) for s in spans])
    return out


def prepare_classify(info, job, stride: int | None, limit: int) -> list[tuple[list[np.ndarray], int]]:
    """Per document: its windows, (S,) int64 each, and its token count."""
    sp = info.special_tokens
    out = []
    for doc in job.common.documents:
        ids, _ = encode(info, doc, limit)
        windows = W.classify_windows(ids, info.max_length, stride, int(sp["cls"]), int(sp["sep"]))
        out.append(([_array(w) for w in windows], len(ids)))
    return out


def prepare_summarize(info, job, limit: int) -> list[tuple[list[int], int, bool]]:
    """Per document: the encoder input, its token count, whether it was truncated."""
    out = []
    for doc in job.common.documents:
        ids, _ = encode(info, doc, limit)
        window, truncated = W.summarize_window(ids, info.max_length, info.special_tokens, info.summarize_input)
        out.append((window, len(ids), truncated))
    return out


# ---------------------------------------------------------------------------------------------
# the pool process's side

_MODELS: dict[str, Any] = {}  # in a pool process only: model name -> ModelInfo, set once at its start


def _start_pool_process(models: dict[str, Any]) -> None:
    # the server process owns the lifecycle (drain on SIGTERM, then it shuts the pool down): a
    # signal to the whole process group (Ctrl-C) must not kill the pool under the drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _MODELS.update(models)


def _call_in_pool_process(fn: Callable, model: str, args: tuple):
    return fn(_MODELS[model], *args)


def _pool_process_ready() -> int:
    return os.getpid()


# ---------------------------------------------------------------------------------------------
# the pool (the event loop's side)


class HostPool:
    """Runs the host path's functions for the event loop: in `processes` spawned processes, or
    with `processes` 0 in `threads` threads of this process. `models`: name -> ModelInfo of
    every served model."""

    def __init__(self, models: dict[str, Any], processes: int, threads: int):
        self.models = dict(models)
        self.processes = processes
        self.threads = threads
        self._executor: Executor | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the pool; with processes, wait until every one has its models (blocking: call it
        off the event loop)."""
        self._executor = self._new_executor()
        if self.processes:  # spawned and loaded now, not by the first requests
            futures = [self._executor.submit(_pool_process_ready) for _ in range(self.processes)]
            pids = {f.result(timeout=300) for f in futures}
            log.info("host pool: %d processes (%s)", self.processes, ", ".join(map(str, sorted(pids))))

    def _new_executor(self) -> Executor:
        if not self.processes:
            return ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="tokenize")
        return ProcessPoolExecutor(max_workers=self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_pool_process, initargs=(self.models,))

    def pids(self) -> list[int]:
        """The pool's live process ids (none with threads)."""
        procs = getattr(self._executor, "_processes", None) or {}
        return [p.pid for p in list(procs.values()) if p.is_alive()]

    async def call(self, deadline: float, what: str, fn: Callable, info, *args):
        """fn(info, *args) in the pool, given up at the request's deadline (504; a call already
        running finishes unseen, one still queued is dropped); 503 if its pool process died."""
        loop = asyncio.get_running_loop()
        executor = self._executor
        if executor is None:
            raise Unavailable("server is not started")
        try:
            if self.processes:
                future = loop.run_in_executor(executor, _call_in_pool_process, fn, info.name, args)
            else:
                future = loop.run_in_executor(executor, fn, info, *args)
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline exceeded during {what}") from None
        except BrokenProcessPool:
            self._replace(executor)
            raise Unavailable(f"a host process died during {what}; retry", {"Retry-After": "1"}) from None

    def _replace(self, broken: Executor) -> None:
        """A broken process pool fails every call it held and every later one: a new pool
        takes its place (its processes start with the next calls)."""
        with self._lock:
            if self._executor is not broken:
                return  # replaced already, by a call that failed with it
            log.error("a host pool process died; starting a new pool")
            self._executor = self._new_executor()
        broken.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
