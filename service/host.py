"""The host path's CPU work: tokenization, windows and answer shaping, as pure functions of a
model's `ModelInfo` and a validated job, and the pool that runs them beside the event loop.

    event loop (one process): HTTP, body checks, validation, batchers, responses
        -> HostPool.call(fn, info, ...) -> prepare_qa / prepare_classify / prepare_summarize / prepare_embed
                                           / qa_spans

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
import collections
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import struct
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
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

    input_ids: list[np.ndarray]  # per window (S,) int32: [CLS] question [SEP] doc[a:b] [SEP]
    token_type_ids: list[np.ndarray]  # per window (S,) int32
    windows: np.ndarray  # (n_windows, 3) int64: doc_start, doc_end, offset (export/windows.py QAWindow)
    offsets: np.ndarray  # (n_tokens, 2) int32 (int64 past 2**31 characters): each document token's character span
    n_tokens: int


def _array(ints, n: int = -1, dtype=np.int32) -> np.ndarray:
    """(n,) int32 from an iterable of ints (np.fromiter: a third of np.asarray's time on tuples).
    int32 halves what crosses the pipe to the event loop (token ids and types; the batcher widens
    them to int64 as it copies them into the batch, at no extra pass)."""
    return np.fromiter(ints, dtype, n if n >= 0 else len(ints))


def prepare_qa(info, job, stride: int | None, limit: int) -> list[QADocument]:
    q, _ = encode(info, job.question, limit, "question")
    room, min_room = W.qa_room(info.max_length, len(q)), max(1, info.max_length // 4)
    if room < min_room:  # the document needs room in each window
        raise InvalidRequest(
            f"question has {len(q)} tokens; at most {len(q) - (min_room - room)} "
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
            _array(itertools.chain.from_iterable(offsets), 2 * len(offsets),
                   np.int32 if len(doc) < 2**31 else np.int64).reshape(-1, 2),
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


def prepare_embed(info, job, limit: int) -> list[tuple[list[np.ndarray], int]]:
    """Per text: its windows (`export/windows.py` embed_windows; the first only when the job
    truncates), (S,) int32 each, and the text tokens they hold (usage)."""
    sp = info.special_tokens
    out = []
    for doc in job.common.documents:
        ids, _ = encode(info, doc, limit)
        windows = W.embed_windows(ids, info.max_length, int(sp["cls"]), int(sp["sep"]), job.truncate)
        out.append(([_array(w) for w in windows], sum(len(w) - 2 for w in windows)))
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


def _pool_process_main(conn, models: dict[str, Any]) -> None:
    """A pool process: one frame in (fn, model name, args), one frame out ((True, result) or
    (False, exception)), in order, until the server closes its end."""
    _start_pool_process(models)
    try:
        conn.send_bytes(pickle.dumps((True, os.getpid())))
    except OSError:  # the server went away while this process started
        return
    while True:
        try:
            fn, model, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(_MODELS[model], *args))
        except Exception as e:  # the service's errors (TooLarge, InvalidRequest) travel as themselves
            reply = (False, e)
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            payload = pickle.dumps((False, RuntimeError(f"unpicklable host-pool reply: {e!r}")))
        try:
            conn.send_bytes(payload)
        except OSError:  # the server closed its end (shut down, or gave this process up)
            return


# ---------------------------------------------------------------------------------------------
# the pool (the event loop's side)

_FRAME = struct.Struct("!i")  # multiprocessing.Connection's frame header (payloads under 2 GiB)


class _PoolProcess:
    """One spawned pool process and the event loop's end of its pipe. The loop writes calls as
    frames (non-blocking; what the pipe does not take at once waits in a buffer, so a large
    document never blocks the loop) and reads the replies, in order, when the pipe is readable:
    no executor threads between the loop and the pipe (ProcessPoolExecutor's feeder and manager
    threads took the GIL from the loop for every call)."""

    def __init__(self, ctx, models: dict[str, Any], index: int):
        parent, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_pool_process_main, args=(child, models), daemon=True,
                                   name=f"longdoc-host-{index}")
        self.process.start()
        child.close()
        self.conn = parent
        self.fd = parent.fileno()
        self.ready = False  # its first frame (its pid) was read
        self.dead = False
        self.pending: collections.deque[tuple[asyncio.Future, str]] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._in = bytearray()
        self._out = bytearray()
        self.on_death: Callable[[_PoolProcess], None] | None = None

    def wait_ready(self, timeout: float) -> int:
        """Block until the process has loaded its models (off the event loop)."""
        if not self.conn.poll(timeout):
            raise RuntimeError(f"host pool process {self.process.pid} did not start in {timeout:.0f} s")
        ok, pid = pickle.loads(self.conn.recv_bytes())
        self.ready = True
        return pid

    def attach(self) -> None:
        """Watch the pipe from the running loop (again after a loop change: tests run several)."""
        loop = asyncio.get_running_loop()
        if self.loop is loop:
            return
        os.set_blocking(self.fd, False)
        self.loop = loop
        loop.add_reader(self.fd, self._readable)
        if self._out:
            loop.add_writer(self.fd, self._writable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the process is gone
            self._detach()
            if self._died() and self.on_death is not None:
                self.on_death(self)  # it failed calls: replaced now, so the next call is served
            return
        self._in += chunk
        while len(self._in) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self._in)
            if len(self._in) < _FRAME.size + n:
                break
            with memoryview(self._in) as frame:  # unpickled in place: no copy of the payload
                try:
                    ok, value = pickle.loads(frame[_FRAME.size:_FRAME.size + n])
                except Exception as e:
                    ok, value = False, RuntimeError(f"unreadable host-pool reply: {e!r}")
            del self._in[:_FRAME.size + n]
            if not self.ready:
                self.ready = True  # the pid frame of a process started after `start`
                continue
            future, _ = self.pending.popleft()
            if future.done():  # given up at its deadline
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def _writable(self) -> None:
        try:
            n = os.write(self.fd, self._out)
        except BlockingIOError:
            return
        except OSError:
            n = len(self._out)  # the reader sees the end and fails the calls
        del self._out[:n]
        if not self._out:
            self.loop.remove_writer(self.fd)

    def _detach(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)

    def _died(self) -> bool:
        """Fail the calls it held with 503; whether there were any."""
        self.dead = True
        held = bool(self.pending)
        while self.pending:
            future, what = self.pending.popleft()
            if not future.done():
                future.set_exception(Unavailable(f"a host process died during {what}; retry", {"Retry-After": "1"}))
        return held

    def send(self, fn: Callable, model: str, args: tuple, what: str) -> asyncio.Future:
        future = self.loop.create_future()
        self.pending.append((future, what))
        payload = pickle.dumps((fn, model, args), protocol=pickle.HIGHEST_PROTOCOL)
        header = _FRAME.pack(len(payload))
        if self._out:  # calls are waiting for the pipe: this one goes after them
            self._out += header
            self._out += payload
            return future
        try:  # most calls go out here at once, without a copy into the buffer
            n = os.writev(self.fd, [header, payload])
        except BlockingIOError:
            n = 0
        except OSError:
            return future  # the reader sees the end and fails the calls
        if n < len(header) + len(payload):
            with memoryview(payload) as rest:
                self._out += header[n:] if n < len(header) else b""
                self._out += rest[max(0, n - len(header)):]
            self.loop.add_writer(self.fd, self._writable)
        return future

    def close(self) -> None:
        self.dead = True
        self._detach()
        self.conn.close()  # the process reads EOF and exits
        self.process.join(timeout=0)


class HostPool:
    """Runs the host path's functions for the event loop: in `processes` spawned processes, or
    with `processes` 0 in `threads` threads of this process. `models`: name -> ModelInfo of
    every served model."""

    def __init__(self, models: dict[str, Any], processes: int, threads: int):
        self.models = dict(models)
        self.processes = processes
        self.threads = threads
        self._executor: Executor | None = None  # threads
        self._procs: list[_PoolProcess] = []  # processes
        self._ctx = multiprocessing.get_context("spawn")
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the pool; with processes, wait until every one has its models (blocking: call it
        off the event loop)."""
        if not self.processes:
            self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="tokenize")
        else:  # spawned and loaded now, not by the first requests
            self._procs = [self._new_process(i) for i in range(self.processes)]
            pids = [p.wait_ready(300) for p in self._procs]
            log.info("host pool: %d processes (%s)", self.processes, ", ".join(map(str, sorted(pids))))
        self._started = True

    def pids(self) -> list[int]:
        """The pool's live process ids (none with threads)."""
        return [p.process.pid for p in self._procs if p.process.is_alive()]

    async def call(self, deadline: float, what: str, fn: Callable, info, *args):
        """fn(info, *args) in the pool, given up at the request's deadline (504; the call finishes
        unseen); 503 if its pool process died (that process is replaced at once)."""
        if not self._started:
            raise Unavailable("server is not started")
        if self.processes:
            future = await self._send(fn, info.name, args, what)
        else:
            future = asyncio.get_running_loop().run_in_executor(self._executor, fn, info, *args)
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline exceeded during {what}") from None

    async def _send(self, fn: Callable, model: str, args: tuple, what: str) -> asyncio.Future:
        for proc in self._procs:
            if proc.dead or not proc.process.is_alive():  # died holding no call: this call finds it
                self._replace(proc)
                raise Unavailable(f"a host process died during {what}; retry", {"Retry-After": "1"})
        proc = min(self._procs, key=lambda p: len(p.pending))  # the least loaded
        proc.attach()
        return proc.send(fn, model, args, what)

    def _new_process(self, index: int) -> _PoolProcess:
        proc = _PoolProcess(self._ctx, self.models, index)
        proc.on_death = self._replace
        return proc

    def _replace(self, old: _PoolProcess) -> None:
        """A dead process's place goes to a new one (ready with its first frame; calls sent
        before that wait in its pipe)."""
        with self._lock:
            if old not in self._procs:
                return  # replaced already
            log.error("host pool process %s died; starting a new one", old.process.pid)
            old._died()
            old.close()
            index = self._procs.index(old)
            self._procs[index] = self._new_process(index)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for proc in self._procs:
            proc.close()
