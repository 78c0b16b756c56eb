"""The host pool (service/host.py): tokenization, windows and answer shaping in processes beside
the event loop give the same answers and errors as in the server process; a deadline still
holds while a pool process works; a pool process that dies is a 503, and the next request is
served. And bench/host_path.py (the host path's capacity with a null engine) runs end to end."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longdoc.service import host as H
from longdoc.service.errors import DeadlineExceeded, TooLarge, Unavailable
from longdoc.service.settings import Settings
from longdoc.testing.fake_worker import FakeWorker
from tests.service.conftest import running_app, sse_events

ROOT = Path(__file__).resolve().parents[2]
LONG = " ".join(["w1 the w2 a"] * 30 + ["gold answer is good"] + ["w3 of w4"] * 20)  # several 64-token windows

REQUESTS = [
    ("/v1/qa", {"question": "where is the gold", "documents": [LONG, "the gold", "w5 w6 gold w7"], "top_k": 3}),
    ("/v1/qa", {"question": "what", "document": LONG, "max_answer_tokens": 2}),
    ("/v1/classify", {"documents": [LONG, "bad bad good", "good"]}),
    ("/v1/classify", {"document": LONG, "top_k": 1}),
    ("/v1/summarize", {"documents": ["w1 w2 w3 w4 w5 w6 w7 w8", LONG]}),
    ("/v1/summarize", {"document": LONG, "num_beams": 2}),
    ("/v1/summarize", {"document": "w9 w8 w7 w6 w5", "stream": True}),
    # errors raised in the pool: too many tokens (413), a question that leaves no room (422)
    ("/v1/classify", {"document": " ".join(["w1"] * 300)}),
    ("/v1/qa", {"question": " ".join(["w2"] * 60), "document": "gold"}),
    ("/v1/qa", {"question": "gold", "document": "gold", "timeout": 0.0005}),
]


async def _answers(processes: int) -> list:
    async with running_app(host_processes=processes, max_document_tokens=200) as c:
        if processes:
            assert len(c.app.state.service.host.pids()) == processes
        out = []
        for path, body in REQUESTS:
            r = await c.post(path, json=body)
            if r.headers["content-type"].startswith("text/event-stream"):
                out.append((r.status_code, sse_events(r.text.splitlines())))
            else:
                out.append((r.status_code, r.json()))
        return out


def test_the_pool_answers_as_the_server_process_does():
    in_process, pooled = asyncio.run(_answers(0)), asyncio.run(_answers(2))
    assert [status for status, _ in in_process] == [200] * 7 + [413, 422, 422]
    assert len(in_process[0][1]["results"]) == 3 and in_process[0][1]["results"][0]["usage"]["windows"] > 1
    assert in_process[0][1]["results"][0]["answers"][0]["text"] == "gold"
    assert pooled == in_process


def _die(info):
    os._exit(3)  # a pool process killed mid-call (out of memory, say)


def _wait_on_fifo(info, path: str) -> str:
    with open(path) as f:  # blocks until the test opens the other end
        return f.read()


def _pool(processes: int = 1) -> H.HostPool:
    worker = FakeWorker(task="classify")
    pool = H.HostPool({worker.info.name: worker.info}, processes, 1)
    pool.start()
    return pool


def _classify_job(text: str):
    from longdoc.service.validation import ClassifyRequest, Limits, validate_classify

    return validate_classify(ClassifyRequest(document=text), None, Limits(10_000, 4, 60.0, 600.0))


def test_a_pool_process_that_dies_mid_call_is_a_503_and_the_pool_is_replaced():
    pool = _pool()
    info = FakeWorker(task="classify").info
    try:
        async def go():
            with pytest.raises(Unavailable, match="a host process died during tokenization"):
                await pool.call(time.monotonic() + 60, "tokenization", _die, info)
            # the next call runs in a new pool
            return await pool.call(time.monotonic() + 60, "tokenization", H.prepare_classify, info,
                                   _classify_job("good bad good"), None, 100)

        ((windows, n),) = asyncio.run(go())
        assert n == 3 and [list(w) for w in windows] == [[2, *info.tokenizer.encode("good bad good").ids, 3]]
        with pytest.raises(TooLarge):  # the service's errors come back as themselves
            asyncio.run(pool.call(time.monotonic() + 60, "tokenization", H.prepare_classify, info,
                                  _classify_job("good bad good"), None, 2))
    finally:
        pool.shutdown()


def _echo(info, payload: bytes, tag: int) -> tuple[int, bytes]:
    return tag, payload[::-1]


def test_calls_larger_than_the_pipe_come_back_whole_and_in_order():
    """Frames of several MB (the socket takes a fraction at a time: the rest waits in the loop's
    buffer, and the reply arrives in many reads) interleaved with small ones, all in flight at once."""
    pool = _pool()
    info = FakeWorker(task="classify").info
    big = [os.urandom(3_000_000 + i) for i in range(3)]
    try:
        async def go():
            calls = []
            for i, payload in enumerate([big[0], b"a", big[1], b"bc", big[2]]):
                calls.append(pool.call(time.monotonic() + 60, "tokenization", _echo, info, payload, i))
            return await asyncio.gather(*calls)

        got = asyncio.run(go())
        assert [tag for tag, _ in got] == [0, 1, 2, 3, 4]
        assert [reply for _, reply in got] == [big[0][::-1], b"a", big[1][::-1], b"cb", big[2][::-1]]
    finally:
        pool.shutdown()


def test_qa_arrays_cross_the_pipe_as_int32():
    """prepare_qa's ids, types and offsets are int32: half the bytes the event loop reads from the
    pool (the batcher widens them as it copies them into its int64 batch; the pooled answers above
    are the in-process ones)."""
    from longdoc.service.validation import Limits, QARequest, validate_qa

    worker = FakeWorker(task="qa")
    job = validate_qa(QARequest(question="where is the gold", document=LONG), None, Limits(100_000, 4, 60.0, 600.0))
    (doc,) = H.prepare_qa(worker.info, job, None, 10_000)
    assert {a.dtype.name for a in (*doc.input_ids, *doc.token_type_ids, doc.offsets)} == {"int32"}
    enc = worker.info.tokenizer.encode(LONG, add_special_tokens=False)
    assert doc.offsets.tolist() == [list(o) for o in enc.offsets]


def test_the_deadline_holds_while_a_pool_process_works(tmp_path):
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    pool = _pool()
    info = FakeWorker(task="classify").info
    try:
        async def go():
            with pytest.raises(DeadlineExceeded, match="during tokenization"):
                await pool.call(time.monotonic() + 0.05, "tokenization", _wait_on_fifo, info, str(fifo))

        asyncio.run(go())
    finally:
        with open(fifo, "w") as f:  # let the call finish, unseen
            f.write("done")
        pool.shutdown()


def test_a_killed_pool_process_answers_503_then_the_service_recovers():
    async def go():
        async with running_app(host_processes=1) as c:
            host = c.app.state.service.host
            (pid,) = host.pids()
            os.kill(pid, signal.SIGKILL)
            r = await c.post("/v1/classify", json={"document": "good"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "unavailable" and "host process died" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
            r = await c.post("/v1/classify", json={"document": "good"})
            assert r.status_code == 200, r.text
            assert (await c.get("/readyz")).status_code == 200
            metrics = (await c.get("/metrics")).text
            assert 'longdoc_request_failures_total{endpoint="classify",reason="unavailable"} 1.0' in metrics

    asyncio.run(go())


@pytest.mark.parametrize("prepare", ["qa", "classify", "summarize"])
def test_a_document_over_the_token_limit_is_refused_after_its_first_limit_tokens(prepare):
    """Issue 38, item 3: a 1.9 MB document under the byte limit but over the token limit was
    tokenized whole (1.6-1.9 s of CPU on the shipped tokenizer) before its 413. Now the tokenizer
    is given about the characters of its first `limit` tokens (and one chunk), counted here."""
    import dataclasses

    from tokenizers import Tokenizer

    from longdoc.service.validation import ClassifyJob, Common, QAJob, SummarizeJob
    from tests.counting_tokenizer import CountingTokenizer

    counting = CountingTokenizer(Tokenizer.from_file(str(ROOT / "models" / "qa" / "tokenizer.json")))
    info = dataclasses.replace(FakeWorker(task=prepare, max_length=512).info, tokenizer=counting)
    doc = ("The quick brown fox jumps over the lazy dog. " * 44_000)[:1_900_000]
    common = Common(None, (doc,), float("inf"))
    call = {"qa": lambda: H.prepare_qa(info, QAJob(common, "where is the fox", 1, 30), None, 65536),
            "classify": lambda: H.prepare_classify(info, ClassifyJob(common, None), None, 65536),
            "summarize": lambda: H.prepare_summarize(info, SummarizeJob(common, None, None, None, None, False), 65536)}
    with pytest.raises(TooLarge, match=r"document has over 65536 tokens \(\d+ in its first \d+ of 1900000 "
                                       r"characters\); the limit is 65536 tokens; the server's max_document_tokens"):
        call[prepare]()
    assert counting.characters < len(doc) / 4


def test_host_processes_default_to_the_usable_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(H, "CGROUP_CPU_MAX", str(tmp_path / "absent"))
    monkeypatch.setattr(H.os, "sched_getaffinity", lambda pid: {0})
    assert Settings().host_process_count() == 0  # one core: threads, nothing to hand work to
    monkeypatch.setattr(H.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    assert Settings().host_process_count() == 4
    assert Settings(host_processes=0).host_process_count() == 0
    assert Settings(host_processes=3).host_process_count() == 3
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(H, "CGROUP_CPU_MAX", str(cpu_max))
    cpu_max.write_text("250000 100000\n")  # a container limited to 2.5 CPUs
    assert Settings().host_process_count() == 3
    cpu_max.write_text("max 100000\n")
    assert Settings().host_process_count() == 4


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_host_path_bench_runs(tmp_path):
    """bench/host_path.py end to end on tiny settings: the null-engine server starts, answers,
    and the results file and plot are written (numbers are not checked: tests do not time)."""
    out, plot = tmp_path / "host.json", tmp_path / "host.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_path.py"), "--model-dir", str(ROOT / "models" / "qa"),
         "--doc-tokens", "300", "--documents", "2", "--concurrency", "2", "--cores", "1", "--duration", "1",
         "--warmup", "0.3", "--mode", "pool=--host-processes 1", "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    (row,) = results["results"]
    assert row["mode"] == "pool" and row["cores"] == 1 and row["requests"] > 0 and row["docs_per_s"] > 0
    assert row["pool_cpu_ms_per_doc"] > 0  # the host work ran in the pool process
    assert plot.stat().st_size > 0
