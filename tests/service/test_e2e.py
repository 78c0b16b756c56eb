"""End to end: real ONNX Runtime sessions on the tiny exported models (tests/conftest.py),
behind a real uvicorn on a loopback port, driven over HTTP. The tiny models are random, so
answers are checked against the same model run offline (one window or sequence at a time),
which is what batching, padding, windows and iteration-level decoding must not change."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import numpy as np
import pytest

from longdoc.service.settings import Settings
from longdoc.export.evaluate import classify_probs, qa_spans
from longdoc.export.windows import pool_logits
from longdoc.service.workers import OnnxWorker
from tests.polling import until
from tests.service.conftest import ServeProcess, ThreadServer

WORDS = ("the river is near the old tree and the gold lies under water where people often walk to "
         "find food for the children of the city").split()


def text_of(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


@pytest.fixture(scope="module")
def server(tiny_qa_dir, tiny_classify_dir, tiny_summarize_dir):
    settings = Settings(models={"qa": tiny_qa_dir, "cls": tiny_classify_dir, "sum": tiny_summarize_dir},
                        threads=1, max_wait_ms=5, qa_stride=100)
    with ThreadServer(settings) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_qa_dir, tiny_classify_dir, tiny_summarize_dir):
    from longdoc.export.runtime import OnnxModel

    return {"qa": OnnxModel(tiny_qa_dir, threads=1), "cls": OnnxModel(tiny_classify_dir, threads=1),
            "sum": OnnxModel(tiny_summarize_dir, threads=1)}


def test_ready_and_models(server):
    r = httpx.get(server.url + "/readyz")
    assert r.status_code == 200
    models = {m["name"]: m for m in httpx.get(server.url + "/v1/models").json()["models"]}
    assert models["qa"]["max_length"] == 512 and models["qa"]["block_size"] == 16
    assert models["cls"]["labels"] == ["negative", "neutral", "positive"]


def test_qa_across_window_boundaries_matches_offline(server, offline):
    question = "where is the gold"
    docs = [text_of(1300, seed=1), text_of(200, seed=2)]  # several windows (block-sparse) + one short
    r = httpx.post(server.url + "/v1/qa", json={"question": question, "documents": docs, "top_k": 3}, timeout=60)
    assert r.status_code == 200, r.text
    for doc, result in zip(docs, r.json()["results"]):
        # `longdoc eval`'s QA path (longdoc.export.evaluate.qa_spans) must answer what the service answers
        expected, n_windows = qa_spans(offline["qa"], question, doc, 512, 30, stride=100, top_k=3)
        got = result["answers"]
        assert result["usage"]["windows"] == n_windows
        assert [(a["start"], a["end"]) for a in got] == [(s.start, s.end) for s in expected]
        assert np.allclose([a["score"] for a in got], [s.score for s in expected], atol=1e-4)
        for a in got:
            assert doc[a["start"] : a["end"]] == a["text"]
    assert n_windows == 1 and r.json()["results"][0]["usage"]["windows"] > 3


def test_classification_matches_offline_mean_pooling(server, offline):
    doc = text_of(1100, seed=3)
    r = httpx.post(server.url + "/v1/classify", json={"document": doc}, timeout=60)
    assert r.status_code == 200, r.text
    m = offline["cls"]
    ids = m.tokenizer.encode(doc, add_special_tokens=False).ids
    cls, sep = m.manifest.special_tokens["cls"], m.manifest.special_tokens["sep"]
    logits = [m.run_encoder(np.array([[cls, *ids[a : a + 510], sep]]))["logits"][0] for a in range(0, len(ids), 510)]
    probs = pool_logits(logits)
    got = {x["label"]: x["score"] for x in r.json()["results"][0]["labels"]}
    assert r.json()["results"][0]["usage"]["windows"] == 3
    # `longdoc eval`'s classify path (longdoc.export.evaluate.classify_probs) answers what the service answers
    eval_probs, eval_windows = classify_probs(m, doc)
    assert eval_windows == 3 and np.allclose(eval_probs, probs, atol=1e-9)
    assert np.allclose([got[k] for k in ("negative", "neutral", "positive")], probs, atol=1e-5)


def greedy_offline(model, doc: str, max_new: int) -> list[int]:
    ids = model.tokenizer.encode(doc, add_special_tokens=False).ids[:511] + [model.manifest.special_tokens["eos"]]
    out = model.generate(np.array([ids]), np.ones((1, len(ids)), np.int64), max_new_tokens=max_new)[0][1:]
    eos = model.manifest.special_tokens["eos"]
    return list(out[: out.index(eos)] if eos in out else out)


class HeldSteps(OnnxWorker):
    """Decoder steps wait for `go`: requests that arrive meanwhile queue up and join the running
    batch at the next step, however fast the machine is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.encoded = 0  # sequences begun

    def begin(self, input_ids):
        states = super().begin(input_ids)
        self.encoded += len(input_ids)
        return states

    def step(self, states, tokens):
        assert self.go.wait(30), "the test never let the decoder go"
        return super().step(states, tokens)


def test_summarize_streaming_and_joining_match_offline_greedy(tiny_summarize_dir, offline):
    docs = [text_of(300, seed=4), text_of(40, seed=5), text_of(700, seed=6)]  # the last is truncated
    results = {}
    workers = []

    def factory(name, directory, device, settings):
        workers.append(HeldSteps(name, directory, device, threads=1))
        return workers[-1]

    def stream(i):
        events = []
        with httpx.stream("POST", server.url + "/v1/summarize",
                          json={"document": docs[i], "stream": True, "max_new_tokens": 40}, timeout=60) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
        results[i] = events

    settings = Settings(models={"sum": tiny_summarize_dir}, threads=1, warmup=False)
    with ThreadServer(settings, worker_factory=factory) as server:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        # the first request(s) begun and held at their first step, the others queued behind them
        until(lambda: workers[0].encoded + metric(server.url, 'longdoc_queue_depth_requests{model="sum"}') >= 3,
              "the requests all arrived", 30)
        workers[0].go.set()
        for t in threads:
            t.join(60)
        one = metric(server.url, 'longdoc_batch_size_bucket{le="1.0",model="sum"}')
        assert metric(server.url, 'longdoc_batch_size_count{model="sum"}') > one  # they shared decoder steps
    for i, doc in enumerate(docs):
        events = results[i]
        tokens = [i for name, d in events if name == "token" for i in d["ids"]]
        assert events[-1][0] == "done"
        final = events[-1][1]["results"][0]
        assert tokens == greedy_offline(offline["sum"], doc, 40), i
        assert final["generated_tokens"] == len(tokens)
        assert final["usage"]["truncated"] == (i == 2)
        assert "".join(d["text"] for name, d in events if name == "token") == final["summary"]


def test_summarize_beam_search(server, offline):
    doc = text_of(60, seed=7)
    r = httpx.post(server.url + "/v1/summarize", json={"document": doc, "num_beams": 3, "max_new_tokens": 12},
                   timeout=60)
    assert r.status_code == 200, r.text
    m = offline["sum"]
    ids = m.tokenizer.encode(doc, add_special_tokens=False).ids + [m.manifest.special_tokens["eos"]]
    out = m.generate(np.array([ids]), np.ones((1, len(ids)), np.int64), max_new_tokens=12, num_beams=3)[0][1:]
    eos = m.manifest.special_tokens["eos"]
    out = out[: out.index(eos)] if eos in out else out
    assert r.json()["results"][0]["generated_tokens"] == len([t for t in out if t != 0])


def test_deadline_gives_504(server):
    r = httpx.post(server.url + "/v1/qa", json={"question": "where", "document": text_of(3000), "timeout": 0.001},
                   timeout=30)
    assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
    assert httpx.get(server.url + "/readyz").status_code == 200


def metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_stops_decoding(server):
    key = 'longdoc_request_failures_total{endpoint="summarize",reason="cancelled"}'
    before_cancelled = metric(server.url, key)
    before_tokens = metric(server.url, 'longdoc_generated_tokens_total{model="sum"}')
    with httpx.stream("POST", server.url + "/v1/summarize",
                      json={"document": text_of(400, seed=8), "stream": True, "max_new_tokens": 500,
                            "no_repeat_ngram_size": 0}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token, then hang up
    until(lambda: metric(server.url, key) != before_cancelled, "the hang-up counted", timeout_s=10)
    assert metric(server.url, key) == before_cancelled + 1
    # the decoder has nothing left to run: the hung-up sequence left its batch (had it not been
    # stopped, it would have left only after its 500 tokens)
    scheduler = server.app.state.service.models["sum"].engine
    until(lambda: not (scheduler.running or scheduler.pending), "the decoder batch is empty", timeout_s=60)
    generated = metric(server.url, 'longdoc_generated_tokens_total{model="sum"}') - before_tokens
    assert generated < 500  # stopped early, not decoded to the end


def test_flood_gets_429_and_others_still_served(tiny_qa_dir):
    # one request (about 3000 tokens of windows) fits the 4500 a request may take, two do not
    settings = Settings(models={"qa": tiny_qa_dir}, threads=1, max_queue_tokens=6000, max_batch_size=2,
                        warmup=False)
    with ThreadServer(settings) as s:
        doc = text_of(1500, seed=9)

        def post(_):
            return httpx.post(s.url + "/v1/qa", json={"question": "where", "document": doc}, timeout=60)

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(post, range(16)))
        codes = [r.status_code for r in responses]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        rejected = [r for r in responses if r.status_code == 429][0]
        assert int(rejected.headers["retry-after"]) >= 1
        assert metric(s.url, 'longdoc_request_failures_total{endpoint="qa",reason="overloaded"}') >= 1
        assert post(0).status_code == 200  # served again once the flood is over


def test_sigterm_drains_in_flight_work_then_exits(tiny_summarize_dir, tmp_path):
    args = ["--model", f"sum={tiny_summarize_dir}", "--no-warmup", "--shutdown-grace-s", "20"]
    with ServeProcess(args, tmp_path / "serve.log") as s:
        box = {}

        def slow():
            box["r"] = httpx.post(s.url + "/v1/summarize", timeout=60,
                                  json={"documents": [text_of(500, seed=i) for i in range(4)], "max_new_tokens": 300})

        t = threading.Thread(target=slow)
        t.start()
        until(lambda: metric(s.url, 'longdoc_in_flight_requests{endpoint="summarize"}') >= 1,
              "the request got in flight", 30)
        s.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                httpx.get(s.url + "/livez", timeout=2)
            except httpx.TransportError:
                return True
            return False

        until(refused, "SIGTERM closed the listener (no longer accepting)", timeout_s=10)
        t.join(60)
        assert box["r"].status_code == 200, box["r"].text
        assert all(x["generated_tokens"] > 0 for x in box["r"].json()["results"])
        assert s.proc.wait(30) == 0


def test_io_binding_encoder_matches_run_encoder(offline):
    """The CUDA worker's I/O-binding path, run on the CPU provider: same outputs as run_encoder,
    at a full-attention and a block-sparse length, twice (the second from the layout cache)."""
    from longdoc.service.workers import EncoderBatch, IoBindingEncoder

    m = offline["qa"]
    enc = IoBindingEncoder(m, "cpu")
    rng = np.random.default_rng(0)
    for length in (100, 300, 300):
        ids = rng.integers(7, 200, (2, length))
        mask = np.ones_like(ids)
        mask[1, length // 2 :] = 0
        types = np.zeros_like(ids)
        got = enc.run(EncoderBatch(ids, mask, types))
        want = m.run_encoder(ids, mask, types)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
    assert len(enc._layouts) == 2


def test_generate_should_stop_is_checked_between_decoder_steps(offline):
    """The real beam search: a callback that never fires changes nothing; one that fires on its
    4th call stops the search with GenerationStopped after the encoder check and 3 decoder steps."""
    from longdoc.export.generation import GenerationStopped

    m = offline["sum"]
    ids = m.tokenizer.encode(text_of(60, seed=7), add_special_tokens=False).ids + [m.manifest.special_tokens["eos"]]
    ids, mask = np.array([ids]), np.ones((1, len(ids)), np.int64)
    for beams in (1, 3):
        plain = m.generate(ids, mask, max_new_tokens=12, num_beams=beams)
        assert m.generate(ids, mask, max_new_tokens=12, num_beams=beams, should_stop=lambda: False) == plain
        calls = []

        def stop():
            calls.append(1)
            return len(calls) == 4

        with pytest.raises(GenerationStopped):
            m.generate(ids, mask, max_new_tokens=12, num_beams=beams, should_stop=stop)
        assert len(calls) == 4
