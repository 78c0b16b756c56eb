"""Hostile and malformed requests (issue 12, item 6): every one gets the documented status in the
one error shape, types are JSON's, and a deadline holds during tokenization."""

import asyncio
import re
import sys
import threading
from pathlib import Path

import pytest

from longdoc.service import host
from longdoc.service.workers import onnx_worker_factory
from tests.service.conftest import running_app

SHIPPED = Path(__file__).resolve().parents[2] / "models"
JSON = {"content-type": "application/json"}


def run(coro):
    return asyncio.run(coro)


def post_all(requests, **app_options):
    """[(path, kwargs for client.post)] -> responses, on one app."""
    async def go():
        async with running_app(**app_options) as c:
            return [await c.post(path, **kwargs) for path, kwargs in requests]

    return run(go())


def assert_error(r, status, type_, message=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == type_
    if message is not None:
        assert message in body["error"]["message"], body


def test_deep_nesting_is_refused_in_the_error_shape_before_any_parse():
    """100k nested arrays: more JSON separators than any request has, refused by the pre-parse
    scan (413) before json.loads could hit its recursion limit (FastAPI answered a bare 400)."""
    body = b'{"document": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (r,) = post_all([("/v1/classify", {"content": body, "headers": JSON})])
    assert_error(r, 413, "too_large", "JSON strings and separators")


@pytest.mark.parametrize("body, message", [
    (b'{"document": "a b", "top_k": ' + b"1" * 5000 + b"}", "an integer over 4300 digits"),
    # a leading NUL makes json guess UTF-16: odd lengths fail to decode, even ones to parse
    (b'\x00{"document":"a"}', "body is not valid JSON"), (b'\x00{"document": "a b"}', "body is not valid JSON"),
])
def test_bodies_that_do_not_parse_are_422_in_the_error_shape(body, message):
    (r,) = post_all([("/v1/classify", {"content": body, "headers": JSON})])
    assert_error(r, 422, "invalid_request", message)


@pytest.mark.parametrize("header", ["inf", "-inf", "nan", "1e999", "Infinity", "0", "-1"])
def test_a_timeout_header_that_is_no_deadline_says_what_is_accepted(header):
    """Issue 38, item 9: `X-Request-Timeout: inf` was answered "must be at least 0.001 seconds"."""
    (r,) = post_all([("/v1/classify", {"json": {"document": "good"}, "headers": {"x-request-timeout": header}})],
                    max_request_timeout_s=120)
    assert_error(r, 422, "invalid_request",
                 f"X-Request-Timeout {header!r}: give a number of seconds from 0.001 to 120 (the server's "
                 f"max_request_timeout_s)")


@pytest.mark.parametrize("request_, settings, setting", [
    ({"content": b'{"document": "' + b"a " * 40_000 + b'"}', "headers": JSON},
     {"max_document_bytes": 100, "max_documents": 1}, "max_document_bytes"),  # the body
    ({"content": b'{"documents": [' + b'"a",' * 200 + b'"a"]}', "headers": JSON}, {}, "max_documents"),  # JSON
    ({"json": {"document": "a " * 100}}, {"max_document_bytes": 100}, "max_document_bytes"),
    ({"json": {"documents": ["a"] * 3}}, {"max_documents": 2}, "max_documents"),
    ({"json": {"document": "good " * 100}}, {"max_document_tokens": 50}, "max_document_tokens"),
    ({"json": {"document": "good " * 1000}}, {"max_queue_tokens": 400}, "max_queue_tokens"),
])
def test_every_413_names_the_setting_that_raises_the_limit(request_, settings, setting):
    """Issue 38, item 9: a 413 said "the limit is N" without saying which setting sets it."""
    from longdoc.service.settings import Settings

    (r,) = post_all([("/v1/classify", request_)], **settings)
    assert_error(r, 413, "too_large", f"the server's {setting}")
    named = re.findall(r"LONGDOC_([A-Z_]+)", r.json()["error"]["message"])
    assert setting.upper() in named and all(n.lower() in Settings.model_fields for n in named), named


def test_wrong_method_is_405_and_unknown_path_404_whatever_the_content_type():
    rs = post_all([("/livez", {}), ("/livez", {"content": b"{}", "headers": JSON}),
                   ("/v1/models", {"content": b"x", "headers": {"content-type": "text/plain"}}),
                   ("/nope", {}), ("/v1/nope", {"content": b"{}", "headers": JSON})])
    for r in rs[:3]:
        assert_error(r, 405, "method_not_allowed")
    for r in rs[3:]:
        assert_error(r, 404, "not_found")


@pytest.mark.parametrize("text", ["\u200b", "\u200b\u2060\ufeff", " \u200b\n\u2060 ", "\u200d\u200c"])
def test_text_of_only_invisible_characters_is_422_like_whitespace(text):
    rs = post_all([("/v1/classify", {"json": {"document": text}}),
                   ("/v1/summarize", {"json": {"documents": ["a", text]}}),
                   ("/v1/qa", {"json": {"document": "the gold", "question": text}})])
    for r in rs:
        assert_error(r, 422, "invalid_request", "only whitespace or invisible characters")


def test_a_document_the_tokenizer_reduces_to_nothing_is_422():
    # the shipped tokenizer drops combining marks: no tokens, nothing to classify
    (r,) = post_all([("/v1/classify", {"json": {"document": "\u0301\u0301"}})], factory=onnx_worker_factory,
                    models={"classify": SHIPPED / "classify"}, warmup=False)
    assert_error(r, 422, "invalid_request", "document has no tokens")


@pytest.mark.parametrize("path, field, value", [
    ("/v1/classify", "top_k", True), ("/v1/classify", "top_k", "1"), ("/v1/qa", "top_k", False),
    ("/v1/summarize", "max_new_tokens", True), ("/v1/summarize", "num_beams", "2"),
    ("/v1/summarize", "length_penalty", "1.0"), ("/v1/summarize", "stream", "yes"),
    ("/v1/summarize", "stream", 1), ("/v1/classify", "timeout", "5"), ("/v1/classify", "timeout", True),
])
def test_types_are_strict(path, field, value):
    body = {"document": "good", field: value}
    if path == "/v1/qa":
        body["question"] = "what"
    (r,) = post_all([(path, {"json": body})])
    assert_error(r, 422, "invalid_request", field)


def test_type_errors_read_as_sentences():
    rs = post_all([("/v1/classify", {"json": {"document": "good", "top_k": True}}),
                   ("/v1/classify", {"json": {"document": "a", "documents": ["b"]}})])
    assert [r.json()["error"]["message"] for r in rs] == [
        "top_k: expected a number, got true", "give exactly one of `document` or `documents`"]


def test_an_integral_number_is_an_integer_as_json_schema_says():
    (r,) = post_all([("/v1/classify", {"json": {"document": "good bad", "top_k": 1.0}})])
    assert r.status_code == 200 and len(r.json()["results"][0]["labels"]) == 1, r.text


@pytest.mark.parametrize("body", [{"document": None, "documents": ["a"]}, {"documents": None, "document": "a"},
                                  {"document": "a", "documents": ["b"]}, {}])
def test_exactly_one_of_document_or_documents_and_never_null(body):
    (r,) = post_all([("/v1/classify", {"json": body})])
    assert_error(r, 422, "invalid_request", "document")


def test_deadline_holds_while_tokenizing(monkeypatch):
    """Tokenization blocked on a gate: a 0.05 s deadline is answered 504 while it still runs."""
    gate, entered = threading.Event(), threading.Event()
    prepare = host.prepare_classify

    def blocked(*args):
        entered.set()
        gate.wait(10)  # released by the test once it has its answer
        return prepare(*args)

    monkeypatch.setattr(host, "prepare_classify", blocked)

    async def go():
        async with running_app() as c:
            try:
                return await c.post("/v1/classify", json={"document": "good", "timeout": 0.05})
            finally:
                gate.set()

    r = run(go())
    assert entered.is_set()
    assert_error(r, 504, "deadline_exceeded", "during tokenization")


def test_a_real_tokenizer_lets_the_deadline_and_other_requests_run(monkeypatch):
    """A 2 MB document on the shipped tokenizer (about 2 s of tokenizing) with a 0.05 s deadline:
    504, and while it tokenizes the event loop keeps answering /livez (tokenizers' `encode`
    holds the GIL throughout, which froze both: the deadline was answered after the tokenizing)."""
    encode = host.encode
    livez_answered, during = [0], []

    def counted_encode(*args):
        before = livez_answered[0]
        try:
            return encode(*args)
        finally:
            during.append(livez_answered[0] - before)

    monkeypatch.setattr(host, "encode", counted_encode)
    doc = ("The quick brown fox jumps over the lazy dog. " * 44_000)[:1_999_000]

    async def go():
        # a token limit over the document's ~440k tokens: all of it is tokenized (an over-limit
        # document stops at the limit, tests/service/test_host.py)
        async with running_app(factory=onnx_worker_factory, models={"classify": SHIPPED / "classify"},
                               warmup=False, max_document_tokens=1_000_000) as c:
            async def poll_livez():
                while not during:
                    assert (await c.get("/livez")).status_code == 200
                    livez_answered[0] += 1
                    await asyncio.sleep(0)  # in-process transport: yield, or the POST never runs

            poller = asyncio.ensure_future(poll_livez())
            r = await c.post("/v1/classify", json={"document": doc, "timeout": 0.05})
            await asyncio.wait_for(poller, 60)  # polls until the tokenizing (which outlives the 504) ends
            return r

    # a long switch interval: a thread holding the GIL keeps it from the call through the count,
    # so with `encode` none are counted, however loaded the machine; a call that releases the
    # GIL lets the loop run throughout
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        r = run(go())
    finally:
        sys.setswitchinterval(interval)
    assert_error(r, 504, "deadline_exceeded", "during tokenization")
    assert during[0] >= 100, during
