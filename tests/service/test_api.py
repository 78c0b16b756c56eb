"""The HTTP API on fake workers: routes, validation errors, windows, backpressure, deadlines,
worker failure, metrics. The fake QA model points at the token "gold"; the fake classifier
counts "good" and "bad"; the fake summarizer copies the document's first tokens."""

import asyncio
import json
import threading

import pytest

from tests.polling import until, until_async
from tests.service.conftest import fake_factory, running_app


def run(coro):
    return asyncio.run(coro)


def filler(n, start=0):
    return " ".join(f"w{(start + i) % 200}" for i in range(n))


def test_qa_finds_answer_in_a_later_window_with_char_offsets():
    # max_length 64: question "where is the gold" (4 tokens) leaves 57 per window; stride 28
    doc = filler(150) + " the Gold is here " + filler(20)

    async def go():
        async with running_app() as c:
            r = await c.post("/v1/qa", json={"question": "where is the gold", "document": doc})
            return r

    r = run(go())
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]
    ans = res["answers"][0]
    assert ans["text"] == "Gold" and doc[ans["start"] : ans["end"]] == "Gold"
    assert ans["start"] == doc.index("Gold")
    assert res["usage"]["windows"] > 2 and res["usage"]["tokens"] == 150 + 4 + 20
    for h in ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time"):
        assert float(r.headers[h]) >= 0


def test_qa_several_documents_and_top_k():
    async def go():
        async with running_app() as c:
            return await c.post("/v1/qa", json={"question": "what", "documents": ["a gold b", "x y gold gold"],
                                                 "top_k": 3, "max_answer_tokens": 1})

    r = run(go())
    assert r.status_code == 200, r.text
    first, second = r.json()["results"]
    assert [a["text"] for a in first["answers"]][0] == "gold"
    assert {a["start"] for a in second["answers"] if a["text"] == "gold"} == {4, 9}


def test_classify_pools_windows():
    doc = "good " * 10 + filler(200) + " bad" * 3

    async def go():
        async with running_app() as c:
            return await c.post("/v1/classify", json={"document": doc, "top_k": 1})

    r = run(go())
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]
    assert res["labels"][0]["label"] == "good" and res["usage"]["windows"] == 4
    assert 0.5 < res["labels"][0]["score"] <= 1.0


def test_summarize_and_usage_truncation():
    async def go():
        async with running_app() as c:
            short = await c.post("/v1/summarize", json={"document": "w1 w2 w3 w4 w5 w6 w7 w8"})
            long = await c.post("/v1/summarize", json={"document": filler(100), "max_new_tokens": 3})
            return short, long

    short, long = run(go())
    assert short.status_code == 200, short.text
    res = short.json()["results"][0]
    assert res["summary"] == "w1 w2 w3 w4 w5 w6" and res["generated_tokens"] == 6
    assert res["usage"]["truncated"] is False
    res = long.json()["results"][0]
    assert res["generated_tokens"] == 3 and res["usage"]["truncated"] is True and res["usage"]["tokens"] == 100


def test_summarize_streams_server_sent_events():
    async def go():
        async with running_app() as c:
            async with c.stream("POST", "/v1/summarize", json={"document": "w5 w6 w7", "stream": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                return [line async for line in r.aiter_lines() if line]

    lines = run(go())
    events = [line.split(": ", 1)[1] for line in lines if line.startswith("event:")]
    assert events == ["token", "token", "token", "done"]
    assert '"summary": "w5 w6 w7"' in lines[-1]


def test_streamed_token_events_never_carry_empty_text():
    """Issue 38, item 9: a token whose text the decoding holds back (the shipped summarizer's
    WordPiece "-", which the next token may make a hyphen: "current-based") was sent as an event
    with "text": "". Its id now rides with the next event's text: every event has text, the texts
    make the summary and the ids the generated tokens."""
    import dataclasses
    from pathlib import Path

    from longdoc.model.tokenization import load_tokenizer
    from longdoc.testing.fake_worker import FakeWorker
    from tests.service.conftest import sse_events

    real = load_tokenizer(Path(__file__).resolve().parents[2] / "models" / "summarize")

    def factory(name, directory, device, settings):  # the fake summarizer, with the shipped tokenizer
        w = FakeWorker(name=name, task="summarize", summary_tokens=20)
        w.tokenizer, w.vocab_size = real, real.get_vocab_size()
        w.info = dataclasses.replace(w.info, tokenizer=real)
        return w

    doc = "a current-based and built-in name -"

    async def go():
        async with running_app(factory, models={"sum": "summarize"}) as c:
            async with c.stream("POST", "/v1/summarize", json={"document": doc, "stream": True}) as r:
                assert r.status_code == 200
                return sse_events([line async for line in r.aiter_lines()])

    events = run(go())
    tokens = [d for name, d in events if name == "token"]
    final = events[-1][1]["results"][0]
    assert final["summary"] == "a current-based and built-in name"
    assert all(d["text"] for d in tokens), tokens
    assert "".join(d["text"] for d in tokens) == final["summary"]
    ids = real.encode(doc, add_special_tokens=False).ids
    assert [i for d in tokens for i in d["ids"]] == ids[:-1]  # the dangling "-": no text, in no event
    assert final["generated_tokens"] == len(ids)


def test_iteration_level_batching_joins_running_batch():
    gate = threading.Event()
    factory = fake_factory(summarize={"gate": gate, "summary_tokens": 20})

    async def go():
        async with running_app(factory, warmup=False) as c:
            worker = [w for w in factory.made if w.info.task == "summarize"][0]
            scheduler = c.app.state.service.models["sum"].engine
            first = asyncio.create_task(c.post("/v1/summarize", json={"document": filler(30)}))
            await until_async(worker.entered.is_set, "the first request is decoding (held at its first step)")
            second = asyncio.create_task(c.post("/v1/summarize", json={"document": filler(30, 50), "max_new_tokens": 3}))
            await until_async(lambda: scheduler.pending, "the second request is queued behind the running batch")
            gate.set()
            return await first, await second

    first, second = run(go())
    assert first.status_code == second.status_code == 200
    steps = [w for w in factory.made if w.info.task == "summarize"][0].steps
    assert 2 in steps  # the second joined the first's batch
    assert steps[0] == 1 and steps[-1] == 1  # ... and left it when done


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"question": "q", "document": ""}, 422, "empty"),
        ({"question": "q", "document": " \n\t "}, 422, "whitespace"),
        ({"question": "q", "document": "a\x00b"}, 422, "control character U+0000"),
        ({"question": "q", "document": "a\x1bb"}, 422, "control character"),
        ({"question": "q", "document": "\ud800"}, 422, "UTF-8"),
        ({"question": "", "document": "gold"}, 422, "question is empty"),
        ({"question": "q"}, 422, "exactly one"),
        ({"question": "q", "document": "a", "documents": ["b"]}, 422, "exactly one"),
        ({"question": "q", "document": "a", "top_k": 0}, 422, "top_k"),
        ({"question": "q", "document": "a", "max_answer_tokens": -5}, 422, "max_answer_tokens"),
        ({"question": "q", "document": "a", "model": "nope"}, 404, "unknown model"),
        ({"question": "q", "document": "a", "model": "cls"}, 422, "classify model"),
        ({"question": "q", "document": "a", "bogus": 1}, 422, "bogus"),
        ({"question": "q", "document": "a", "timeout": 10_000}, 422, "maximum"),
        ({"question": " ".join(["w1"] * 60), "document": "gold"}, 422, "question has 60 tokens"),
        ({"question": "q", "document": "w1 " * 600}, 413, "limit is 500 tokens"),
        ({"question": "q", "documents": ["a"] * 5}, 413, "limit is 4"),
    ],
)
def test_qa_validation_errors(body, status, fragment):
    async def go():
        async with running_app(max_document_tokens=500, max_documents=4) as c:
            # json.dumps escapes lone surrogates (\ud800) as a client may; httpx's json= cannot
            r = await c.post("/v1/qa", content=json.dumps(body), headers={"content-type": "application/json"})
            ok = await c.post("/v1/qa", json={"question": "q", "document": "gold"})  # still serving
            return r, ok

    r, ok = run(go())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"type", "message"} and fragment in err["message"]
    assert ok.status_code == 200


def test_summarize_absurd_params():
    async def go():
        async with running_app() as c:
            return [await c.post("/v1/summarize", content=json.dumps({"document": "w1", **p}),
                                 headers={"content-type": "application/json"})
                    for p in ({"num_beams": 10**6}, {"max_new_tokens": -1}, {"max_new_tokens": 4000},
                              {"length_penalty": float("inf")}, {"stream": True, "documents": ["a", "b"]})]

    for r in run(go()):
        assert r.status_code == 422, r.text
        assert r.json()["error"]["type"] == "invalid_request"


def test_transport_errors():
    async def go():
        async with running_app(max_document_bytes=1000, max_documents=2) as c:
            return [
                await c.post("/v1/qa", content=b'{"question": "q", "document": "gold"}',
                             headers={"content-type": "text/plain"}),
                await c.post("/v1/qa", content=b'{"question": "q", "document": "\xff\xfe"}',
                             headers={"content-type": "application/json"}),
                await c.post("/v1/qa", content=b"{not json", headers={"content-type": "application/json"}),
                await c.post("/v1/qa", json={"question": "q", "document": "gold " * 300}),
                await c.post("/v1/qa", json={"question": "q", "documents": ["x" * 999] * 70}),
                await c.get("/v1/nothing"),
            ]

    ctype, utf8, notjson, big_doc, big_body, missing = run(go())
    assert ctype.status_code == 415
    assert utf8.status_code == 422 and "UTF-8" in utf8.json()["error"]["message"]
    assert notjson.status_code == 422  # where the JSON breaks, not a bare "0: ..." location
    assert notjson.json()["error"]["message"] == (
        "body is not valid JSON: Expecting property name enclosed in double quotes at character 1")
    assert big_doc.status_code == 413 and "limit is 1000 bytes" in big_doc.json()["error"]["message"]
    assert big_body.status_code == 413 and big_body.json()["error"]["type"] == "too_large"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"


def test_overload_gives_429_with_retry_after():
    factory = fake_factory(qa={"delay_s": 0.05})

    async def go():
        async with running_app(factory, max_queue_tokens=200, max_batch_size=1) as c:
            reqs = [c.post("/v1/qa", json={"question": "q", "document": filler(50)}) for _ in range(20)]
            return await asyncio.gather(*reqs)

    responses = run(go())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    r = [r for r in responses if r.status_code == 429][0]
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "overloaded"


def test_deadline_gives_504_and_skips_queued_windows():
    factory = fake_factory(qa={"delay_s": 0.1})

    async def go():
        async with running_app(factory, max_batch_size=1) as c:
            r = await c.post("/v1/qa", json={"question": "q", "document": filler(400)},
                             headers={"x-request-timeout": "0.25"})
            # the queue empties once the batcher has dropped the expired windows (had it run them
            # instead, all 14 would have been taken by then)
            queue = c.app.state.service.models["qa"].engine.policy
            await until_async(lambda: len(queue) == 0, "the expired request's windows left the queue")
            return r

    r = run(go())
    assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
    qa = [w for w in factory.made if w.info.task == "qa"][0]
    assert 1 <= len(qa.batches) < 8  # 400 tokens = 14 windows; the rest were dropped


async def ready(client) -> bool:
    return (await client.get("/readyz")).status_code == 200


def test_worker_failure_gives_503_then_recovers():
    factory = fake_factory(qa={"fail_runs": 1})

    async def go():
        async with running_app(factory, warmup=False, worker_restart_backoff_s=0.0) as c:
            bad = await c.post("/v1/qa", json={"question": "q", "document": "gold"})
            await until_async(lambda: ready(c), "the restarted worker made the server ready", 10)
            good = await c.post("/v1/qa", json={"question": "q", "document": "gold"})
            metrics = (await c.get("/metrics")).text
            return bad, good, metrics

    bad, good, metrics = run(go())
    assert bad.status_code == 503 and bad.json()["error"]["type"] == "unavailable"
    assert good.status_code == 200
    assert 'longdoc_worker_restarts_total{model="qa"} 1.0' in metrics
    assert len(factory.made) == 4  # qa, cls, sum, and the restarted qa


def test_models_health_and_metrics():
    async def go():
        async with running_app() as c:
            await c.post("/v1/qa", json={"question": "q", "document": "gold"})
            await c.post("/v1/qa", json={"question": "q", "document": ""})
            return (await c.get("/v1/models"), await c.get("/livez"), await c.get("/readyz"),
                    await c.get("/metrics"), c.app)

    models, live, ready, metrics, app = run(go())
    names = {m["name"]: m for m in models.json()["models"]}
    assert names["qa"]["task"] == "qa" and names["qa"]["default"] and names["cls"]["labels"] == ["bad", "good"]
    assert live.status_code == 200 and ready.status_code == 200
    text = metrics.text
    for name in ("longdoc_request_duration_seconds_bucket", "longdoc_tokenize_duration_seconds",
                 "longdoc_queue_duration_seconds", "longdoc_inference_duration_seconds", "longdoc_batch_size",
                 "longdoc_batch_tokens", "longdoc_padding_waste_ratio", "longdoc_queue_depth_requests",
                 "longdoc_queue_depth_tokens", "longdoc_in_flight_requests", "longdoc_windows_per_request",
                 "longdoc_generated_tokens", "longdoc_request_failures_total"):
        assert name in text, name
    assert 'longdoc_request_failures_total{endpoint="qa",reason="validation"} 1.0' in text
    assert 'length_bucket="le_8"' in text
    from prometheus_client.parser import text_string_to_metric_families  # what a scraper parses

    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"longdoc_request_duration_seconds", "longdoc_request_failures", "longdoc_queue_depth_tokens"} <= families
    assert not app.state.service.is_ready()  # lifespan over: shut down


def test_batching_puts_concurrent_requests_in_one_batch():
    factory = fake_factory(qa={"delay_s": 0.05})

    async def go():
        async with running_app(factory, max_wait_ms=20) as c:
            return await asyncio.gather(*(c.post("/v1/qa", json={"question": "q", "document": "a gold"})
                                          for _ in range(6)))

    assert all(r.status_code == 200 for r in run(go()))
    qa = [w for w in factory.made if w.info.task == "qa"][0]
    assert max(shape[0] for shape in qa.batches) >= 3


def test_batching_off_runs_one_by_one():
    factory = fake_factory()

    async def go():
        async with running_app(factory, batching=False) as c:
            return await asyncio.gather(*(c.post("/v1/qa", json={"question": "q", "document": "a gold"})
                                          for _ in range(6)))

    assert all(r.status_code == 200 for r in run(go()))
    qa = [w for w in factory.made if w.info.task == "qa"][0]
    assert {shape[0] for shape in qa.batches} == {1}


def test_draining_is_not_ready_and_refuses_new_work():
    async def go():
        async with running_app() as c:
            c.app.state.service.begin_drain()  # what SIGTERM does first (service/cli.py)
            return await c.get("/readyz"), await c.post("/v1/qa", json={"question": "q", "document": "gold"})

    ready, post = run(go())
    assert ready.status_code == 503 and "shutting down" in ready.json()["error"]["message"]
    assert post.status_code == 503


def test_a_second_signal_says_the_grace_was_cut_short():
    """Issue 38, item 9: after a second Ctrl-C at 0.5 s the 503 said "did not finish within the
    30 s grace period". It now says that a second signal ended the grace, and when; a stream's
    `event: error` says the same."""
    import httpx

    from longdoc.service.settings import Settings
    from tests.service.conftest import ThreadServer, sse_events

    gate = threading.Event()
    factory = fake_factory(qa={"gate": gate}, summarize={"gate": gate})
    settings = Settings(models={"qa": "qa", "sum": "summarize"}, warmup=False, shutdown_grace_s=30)
    got = {}

    def ask(url):
        got["qa"] = httpx.post(url + "/v1/qa", json={"question": "q", "document": "a gold"}, timeout=30)

    def stream(url):  # beam search: headers at once, the tokens at its end
        with httpx.stream("POST", url + "/v1/summarize", timeout=30,
                          json={"document": "w1 w2", "stream": True, "num_beams": 2}) as r:
            got["stream"] = sse_events(r.iter_lines())

    try:
        with ThreadServer(settings, worker_factory=factory) as server:
            threads = [threading.Thread(target=f, args=(server.url,)) for f in (ask, stream)]
            for t in threads:
                t.start()
            until(lambda: len(factory.made) == 2 and all(w.entered.is_set() for w in factory.made),
                  "both requests held by their workers")
            service = server.app.state.service
            service.begin_drain()  # the first Ctrl-C (service/cli.py)
            service.begin_drain(grace_s=0)  # the second
            for t in threads:
                t.join(30)
    finally:
        gate.set()
    assert got["qa"].status_code == 503, got["qa"].text
    messages = [got["qa"].json()["error"]["message"], got["stream"][-1][1]["error"]["message"]]
    for message in messages:
        assert "within the 30 s grace period" not in message
        assert "a second signal ended the 30 s grace period after 0." in message, message


def test_settings_from_environment_and_flags(monkeypatch):
    import argparse

    from longdoc.service import cli

    monkeypatch.setenv("LONGDOC_MAX_BATCH_TOKENS", "1234")
    monkeypatch.setenv("LONGDOC_MODELS", '{"a": "/x"}')
    monkeypatch.setenv("LONGDOC_PORT", "9000")
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    s = cli.build_settings(parser.parse_args(["serve", "--port", "9001", "--device", "cpu", "--no-batching"]))
    assert (s.max_batch_tokens, s.port, s.batching, str(s.models["a"])) == (1234, 9001, False, "/x")
    s = cli.build_settings(parser.parse_args(["serve", "--model", "q=/m1", "--model", "c=/m2"]))
    assert list(s.models) == ["q", "c"]
    with pytest.raises(ValueError, match="NAME=DIR"):
        cli.build_settings(parser.parse_args(["serve", "--model", "nodir"]))
    with pytest.raises(ValueError, match="cuda:N"):
        cli.build_settings(parser.parse_args(["serve", "--model", "q=/m", "--device", "gpu7"]))


def test_decoder_failure_gives_503_then_recovers():
    factory = fake_factory(summarize={"fail_runs": 1})

    async def go():
        async with running_app(factory, warmup=False, worker_restart_backoff_s=0.0) as c:
            bad = await c.post("/v1/summarize", json={"document": "w1 w2"})
            await until_async(lambda: ready(c), "the restarted decoder made the server ready", 10)
            good = await c.post("/v1/summarize", json={"document": "w1 w2"})
            return bad, good

    bad, good = run(go())
    assert bad.status_code == 503 and good.status_code == 200
    assert good.json()["results"][0]["summary"] == "w1 w2"


def test_disconnect_drops_queued_windows():
    """A real client hanging up (httpx read timeout) over a real socket: the rest of its
    windows never reach the worker."""
    import httpx

    from longdoc.service.settings import Settings
    from tests.service.conftest import ThreadServer

    factory = fake_factory(qa={"delay_s": 0.05})
    settings = Settings(models={"qa": "qa"}, max_batch_size=1, warmup=False)
    with ThreadServer(settings, worker_factory=factory) as s:
        with pytest.raises(httpx.ReadTimeout):  # 400 tokens = 14 windows = 0.7 s of work
            httpx.post(s.url + "/v1/qa", json={"question": "q", "document": filler(400)}, timeout=0.2)

        def settled():  # the hang-up counted, and the queue empty: the windows left were dropped
            text = httpx.get(s.url + "/metrics").text  # (run instead, all 14 would have been taken by then)
            lines = text.splitlines()
            if 'longdoc_queue_depth_requests{model="qa"} 0.0' in lines and any(
                    line.startswith('longdoc_request_failures_total{endpoint="qa",reason="cancelled"}') for line in lines):
                return text

        metrics = until(settled, "the hang-up counted and the queue empty")
    assert 'longdoc_request_failures_total{endpoint="qa",reason="cancelled"} 1.0' in metrics
    assert len(factory.made[0].batches) <= 6


def test_metrics_multiprocess_mode(tmp_path):
    import subprocess
    import sys

    code = (
        "from longdoc.service.metrics import Metrics\n"
        "m = Metrics()\n"
        "m.failures.labels('qa', 'timeout').inc(3)\n"
        "m.in_flight.labels('qa').inc()\n"
        "body, _ = m.render()\n"
        "print(body.decode())\n"
    )
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr
    assert 'longdoc_request_failures_total{endpoint="qa",reason="timeout"} 3.0' in out.stdout
    assert list(tmp_path.glob("*.db"))  # values live in the shared directory


def test_beam_search_waits_its_turn_and_is_not_starved():
    gate = threading.Event()
    factory = fake_factory(summarize={"gate": gate, "summary_tokens": 10})

    async def go():
        async with running_app(factory, warmup=False) as c:
            worker = [w for w in factory.made if w.info.task == "summarize"][0]
            scheduler = c.app.state.service.models["sum"].engine
            post = lambda **kw: c.post("/v1/summarize", json={"document": filler(20), **kw})  # noqa: E731
            first = asyncio.create_task(post())
            await until_async(worker.entered.is_set, "the first request is decoding (held at its first step)")
            beam = asyncio.create_task(post(num_beams=4, max_new_tokens=5))
            await until_async(lambda: len(scheduler.pending) == 1, "the beam request is queued")
            later = asyncio.create_task(post(max_new_tokens=3))
            await until_async(lambda: len(scheduler.pending) == 2, "the later request is queued behind it")
            gate.set()
            return await first, await beam, await later

    first, beam, later = run(go())
    assert [r.status_code for r in (first, beam, later)] == [200, 200, 200]
    assert beam.json()["results"][0]["summary"] == filler(5)
    steps = [w for w in factory.made if w.info.task == "summarize"][0].steps
    assert max(steps) == 1  # the later greedy request did not join past the beam request


def test_one_worker_per_device_both_get_batches():
    factory = fake_factory(qa={"delay_s": 0.05})

    async def go():
        async with running_app(factory, models={"qa": "qa"}, devices=["cpu", "cpu"], batching=False) as c:
            rs = await asyncio.gather(*(c.post("/v1/qa", json={"question": "q", "document": "a gold"})
                                        for _ in range(6)))
            models = (await c.get("/v1/models")).json()["models"]
            return rs, models

    rs, models = run(go())
    assert all(r.status_code == 200 for r in rs)
    assert models[0]["devices"] == ["cpu", "cpu"]
    workers = [w for w in factory.made if w.info.task == "qa"]
    assert len(workers) == 2 and all(w.batches for w in workers)


def test_beam_search_past_deadline_stops_between_decoder_steps():
    """60 beam steps of 0.02 s under a 0.2 s deadline: 504, and the worker stops stepping (the
    decoder loop is free again) instead of running the search to the end."""
    factory = fake_factory(summarize={"delay_s": 0.02, "summary_tokens": 60})

    async def go():
        async with running_app(factory) as c:
            r = await c.post("/v1/summarize", json={"document": filler(80), "num_beams": 2, "max_new_tokens": 60},
                             headers={"x-request-timeout": "0.2"})
            # runs only once the beam search has left the decoder (FIFO, beam search runs alone)
            after = await c.post("/v1/summarize", json={"document": "w1 w2"})
            return r, after

    r, after = run(go())
    assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
    assert after.status_code == 200 and after.json()["results"][0]["summary"] == "w1 w2"
    steps = len([w for w in factory.made if w.info.task == "summarize"][0].steps) - 3  # greedy: w1, w2, eos
    assert 1 <= steps < 40  # stopped near 0.2 s / 0.02 s, not at 60


def test_disconnect_stops_beam_search_between_decoder_steps():
    import httpx

    from longdoc.service.settings import Settings
    from tests.service.conftest import ThreadServer

    factory = fake_factory(summarize={"delay_s": 0.02, "summary_tokens": 60})
    settings = Settings(models={"sum": "summarize"}, warmup=False)
    with ThreadServer(settings, worker_factory=factory) as s:
        with pytest.raises(httpx.ReadTimeout):  # 60 steps = 1.2 s of work
            httpx.post(s.url + "/v1/summarize", json={"document": filler(80), "num_beams": 2, "max_new_tokens": 60},
                       timeout=0.2)
        after = httpx.post(s.url + "/v1/summarize", json={"document": "w1 w2"}, timeout=30)  # runs after it
        metrics = httpx.get(s.url + "/metrics").text
    assert after.status_code == 200
    assert 'longdoc_request_failures_total{endpoint="summarize",reason="cancelled"} 1.0' in metrics
    steps = len(factory.made[0].steps) - 3  # the greedy request: w1, w2, eos
    assert 1 <= steps < 40  # stopped soon after the hang-up at 0.2 s, not at 60


def test_the_default_model_of_a_task_is_explicit_not_alphabetical(caplog):
    """A user's models/myqa beside the shipped models/qa (sorted first) does not answer requests
    that name no model; --default-model picks one; /v1/models and the start-up log say which."""
    async def go(**settings):
        async with running_app(models={"myqa": "qa", "qa": "qa", "cls": "classify"}, **settings) as c:
            listed = (await c.get("/v1/models")).json()["models"]
            answered = (await c.post("/v1/qa", json={"question": "q", "document": "gold"})).json()["model"]
            return {m["name"]: m["default"] for m in listed}, answered

    with caplog.at_level("INFO", logger="longdoc.service"):
        assert run(go()) == ({"myqa": False, "qa": True, "cls": True}, "qa")
    assert "default models: qa=qa, classify=cls" in caplog.text
    assert run(go(default_models={"qa": "myqa"})) == ({"myqa": True, "qa": False, "cls": True}, "myqa")
    for given, why in (({"qa": "cls"}, "cls is a classify model"), ({"qa": "nope"}, "no model is named 'nope'"),
                       ({"summarize": "qa"}, "no summarize model is served")):
        with pytest.raises(ValueError, match=why):
            run(go(default_models=given))


def test_docs_load_without_a_network():
    """/docs and /redoc name no other host: their scripts and styles come from this server."""
    import re

    async def go():
        async with running_app() as c:
            pages = [(await c.get(path)).text for path in ("/docs", "/redoc")]
            assets = [link for page in pages for link in re.findall(r'(?:src|href)="([^"]+)"', page)]
            return pages, assets, [(a, (await c.get(a)).status_code) for a in assets]

    pages, assets, fetched = run(go())
    assert len(assets) >= 4 and not [a for a in assets if not a.startswith("/")], assets
    assert all(code == 200 for _, code in fetched), fetched
