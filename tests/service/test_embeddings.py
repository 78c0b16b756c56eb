"""POST /v1/embeddings (OpenAI's shape) and POST /embed (TEI's) on the fake embedding worker (issue
39): the response shapes, a text longer than the window embedded whole (its windows pooled, usage
counting every token) or its first window with `truncate`, normalization, base64, the default
model, errors in the one error shape, deadlines, batching across requests and per-endpoint
metrics. The fake model's vector of a window is the share of its tokens that are each of its words
(longdoc.testing.fake_worker.FakeWorker), so what a window holds shows in its vector."""

from __future__ import annotations

import asyncio
import base64
import threading

import numpy as np

from longdoc.export.windows import pool_window_embeddings
from longdoc.testing.fake_worker import FAKE_WORDS
from tests.polling import until_async
from tests.service.conftest import fake_factory, running_app

MODELS = {"qa": "qa", "embed": "embed", "other-embed": "embed"}


def run(coro):
    return asyncio.run(coro)


def filler(n):
    return " ".join(f"w{i % 200}" for i in range(n))


def post(path, body, **app_options):
    async def go():
        async with running_app(models=MODELS, **app_options) as c:
            return await c.post(path, json=body)

    return run(go())


def share(word: str, text: str) -> np.ndarray:
    """The fake model's unit vector of one short window of `text`."""
    words = text.lower().split()
    v = np.array([words.count(w) for w in FAKE_WORDS], np.float64)
    return v / np.linalg.norm(v)


def test_openai_shape_and_default_model():
    r = post("/v1/embeddings", {"input": ["the gold", "good bad bad"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "embed"  # the default embedding model
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    for d, text in zip(body["data"], ["the gold", "good bad bad"]):
        assert np.allclose(d["embedding"], share(None, text), atol=1e-6)  # normalized, as the model says
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    one = post("/v1/embeddings", {"input": "the gold", "model": "other-embed"})
    assert one.status_code == 200 and one.json()["model"] == "other-embed"
    assert np.allclose(one.json()["data"][0]["embedding"], body["data"][0]["embedding"])


def test_long_text_is_embedded_whole_or_truncated():
    """max_length 64: 62 text tokens per window; gold only in the third window"""
    text = filler(130) + " gold gold"
    whole = post("/v1/embeddings", {"input": text})
    cut = post("/v1/embeddings", {"input": text, "truncate": True})
    assert whole.status_code == cut.status_code == 200
    gold = FAKE_WORDS.index("gold")
    assert whole.json()["data"][0]["embedding"][gold] > 0 and cut.json()["data"][0]["embedding"][gold] == 0
    assert whole.json()["usage"]["prompt_tokens"] == 132 and cut.json()["usage"]["prompt_tokens"] == 62
    # the windows' vectors pooled as export/windows.py says: windows of 62, 62 and 8 tokens
    words = text.split()
    windows = [words[:62], words[62:124], words[124:]]
    vectors = [np.array([w.count(x) for x in FAKE_WORDS], np.float32) / (len(w) + 2) for w in windows]
    assert np.allclose(whole.json()["data"][0]["embedding"], pool_window_embeddings(vectors, True), atol=1e-6)


def test_base64_is_the_float32_vector():
    floats = post("/v1/embeddings", {"input": "good gold"}).json()["data"][0]["embedding"]
    encoded = post("/v1/embeddings", {"input": "good gold", "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), np.array(floats, np.float32))


def test_tei_embed_shape_normalize_and_truncate():
    r = post("/embed", {"inputs": ["the gold", "bad"]})
    assert r.status_code == 200, r.text
    vectors = r.json()
    assert len(vectors) == 2 and np.allclose(vectors[0], share(None, "the gold"), atol=1e-6)
    raw = post("/embed", {"inputs": "the gold the", "normalize": False}).json()
    the = FAKE_WORDS.index("the")
    assert len(raw) == 1 and abs(raw[0][the] - 2 / 5) < 1e-6  # [CLS] the gold the [SEP]: the mean share
    text = filler(130) + " gold"
    cut = post("/embed", {"inputs": text, "truncate": True}).json()[0]
    assert cut[FAKE_WORDS.index("gold")] == 0


def test_errors_in_the_one_shape():
    cases = [
        ({"input": []}, 422), ({"input": ""}, 422), ({"input": ["ok", " "]}, 422), ({"input": [1, 2]}, 422),
        ({"input": "x", "encoding_format": "int8"}, 422), ({"input": "x", "dimensions": 3}, 422),
        ({"input": "x", "model": "qa"}, 422), ({"input": "x", "model": "nope"}, 404),
        ({"input": ["x"] * 17}, 413), ({"input": "x", "truncate": "yes"}, 422), ({"input": "x", "extra": 1}, 422),
    ]
    for body, status in cases:
        r = post("/v1/embeddings", body)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"type", "message"}, r.text
    r = post("/v1/embeddings", {"input": ["ok", "bad\x00"]})
    assert r.status_code == 422 and "input[1]" in r.json()["error"]["message"]
    assert post("/v1/embeddings", {"input": "x", "dimensions": len(FAKE_WORDS)}).status_code == 200
    r = post("/embed", {"inputs": "x", "normalize": 1})
    assert r.status_code == 422 and set(r.json()) == {"error"}


def test_no_embedding_model_is_not_found():
    async def go():
        async with running_app(models={"qa": "qa"}) as c:
            return await c.post("/v1/embeddings", json={"input": "x"})

    r = run(go())
    assert r.status_code == 404 and "no embed model" in r.json()["error"]["message"]


def test_deadline():
    gate = threading.Event()

    async def go():
        async with running_app(factory=fake_factory(embed={"gate": gate}), models=MODELS, warmup=False) as c:
            r = await c.post("/v1/embeddings", json={"input": "gold", "timeout": 0.2})
            gate.set()
            return r

    r = run(go())
    assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"


def test_requests_share_batches_and_metrics_are_per_endpoint():
    gate = threading.Event()
    factory = fake_factory(embed={"gate": gate})

    async def go():
        async with running_app(factory=factory, models=MODELS, max_wait_ms=0, warmup=False) as c:
            first = asyncio.ensure_future(c.post("/v1/embeddings", json={"input": "gold"}))
            worker = next(w for w in factory.made if w.info.name == "embed")
            await until_async(worker.entered.is_set, "the first batch holds the worker")
            rest = [asyncio.ensure_future(c.post("/embed", json={"inputs": f"good {i}"})) for i in range(3)]
            engine = c.app.state.service.models["embed"].engine
            await until_async(lambda: engine.policy.queued_tokens >= 12, "the three /embed requests queued")
            gate.set()
            replies = [await first] + [await r for r in rest]
            metrics = (await c.get("/metrics")).text
            bad = await c.post("/embed", json={"inputs": []})
            metrics_after = (await c.get("/metrics")).text
            return worker, replies, metrics, bad, metrics_after

    worker, replies, metrics, bad, after = run(go())
    assert all(r.status_code == 200 for r in replies)
    assert [b[0] for b in worker.batches] == [1, 3]  # the three queued /embed requests ran as one batch
    assert 'longdoc_request_duration_seconds_count{endpoint="embeddings",length_bucket="le_8",model="embed"} 1.0' in metrics
    assert 'longdoc_request_duration_seconds_count{endpoint="embed",length_bucket="le_8",model="embed"} 3.0' in metrics
    assert 'longdoc_request_failures_total{endpoint="embed",reason="validation"} 1.0' in after
