"""The host path (service/host.py): tokenization, windows and answer shaping in the server's host
threads answer and refuse as the API says; and bench/host_path.py (the host path's capacity with
a null engine) runs end to end."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longdoc.service import host as H
from longdoc.service.errors import TooLarge
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


async def _answers() -> list:
    async with running_app(max_document_tokens=200) as c:
        out = []
        for path, body in REQUESTS:
            r = await c.post(path, json=body)
            if r.headers["content-type"].startswith("text/event-stream"):
                out.append((r.status_code, sse_events(r.text.splitlines())))
            else:
                out.append((r.status_code, r.json()))
        return out


def test_the_host_functions_answer_and_refuse_through_the_app():
    answers = asyncio.run(_answers())
    assert [status for status, _ in answers] == [200] * 7 + [413, 422, 422]
    assert len(answers[0][1]["results"]) == 3 and answers[0][1]["results"][0]["usage"]["windows"] > 1
    assert answers[0][1]["results"][0]["answers"][0]["text"] == "gold"


def test_a_document_over_the_token_limit_is_the_services_413():
    from longdoc.service.validation import ClassifyRequest, Limits, validate_classify

    info = FakeWorker(task="classify").info
    job = validate_classify(ClassifyRequest(document="good bad good"), None, Limits(10_000, 4, 60.0, 600.0))
    ((windows, n),) = H.prepare_classify(info, job, None, 100)
    assert n == 3 and [list(w) for w in windows] == [[2, *info.tokenizer.encode("good bad good").ids, 3]]
    with pytest.raises(TooLarge, match="3 tokens; the limit is 2"):
        H.prepare_classify(info, job, None, 2)


def test_qa_arrays_are_int32():
    """prepare_qa's ids, types and offsets are int32: half the bytes that cross the engine socket
    with --front-ends (the batcher widens them as it copies them into its int64 batch)."""
    from longdoc.service.validation import Limits, QARequest, validate_qa

    worker = FakeWorker(task="qa")
    job = validate_qa(QARequest(question="where is the gold", document=LONG), None, Limits(100_000, 4, 60.0, 600.0))
    (doc,) = H.prepare_qa(worker.info, job, None, 10_000)
    assert {a.dtype.name for a in (*doc.input_ids, *doc.token_type_ids, doc.offsets)} == {"int32"}
    enc = worker.info.tokenizer.encode(LONG, add_special_tokens=False)
    assert doc.offsets.tolist() == [list(o) for o in enc.offsets]


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


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_host_path_bench_runs(tmp_path):
    """bench/host_path.py end to end on tiny settings: the null-engine server starts, answers,
    and the results file and plot are written (numbers are not checked: tests do not time)."""
    out, plot = tmp_path / "host.json", tmp_path / "host.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_path.py"), "--model-dir", str(ROOT / "models" / "qa"),
         "--doc-tokens", "300", "--documents", "2", "--concurrency", "2", "--cores", "2", "--duration", "1",
         "--warmup", "0.3", "--mode", "fe=--front-ends {cores}", "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    (row,) = results["results"]
    assert row["mode"] == "fe" and row["cores"] == 2 and row["requests"] > 0 and row["docs_per_s"] > 0
    assert row["flags"] == "--front-ends {cores}" and "--front-ends 2" in row["command"]
    assert row["pool_cpu_ms_per_doc"] > 0  # the host work ran in the front end, a child process
    assert plot.stat().st_size > 0
