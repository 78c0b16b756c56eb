"""Schemathesis against the OpenAPI schema (fake workers behind a real uvicorn): whatever it
generates, the service answers without a 5xx (504 only for a deadline the request itself set)
and every error has the one error shape. Bounded: a few examples per operation."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from longdoc.service.app import create_app
from longdoc.service.core import ERROR_RESPONSES as _ERRORS
from longdoc.service.settings import Settings
from tests.service.conftest import ThreadServer, fake_factory

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fake_server():
    s = Settings(models={"qa": "qa", "cls": "classify", "sum": "summarize", "emb": "embed"}, max_document_tokens=2000,
                 max_documents=4, max_document_bytes=20_000)
    with ThreadServer(s, worker_factory=fake_factory()) as server:
        yield server


def operations(url):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


def test_openapi_lists_every_route(fake_server):
    paths = httpx.get(fake_server.url + "/openapi.json").json()["paths"]
    assert {"/v1/qa", "/v1/summarize", "/v1/classify", "/v1/embeddings", "/embed", "/v1/models", "/livez", "/readyz",
            "/metrics"} <= set(paths)


@pytest.mark.parametrize("path", ["/v1/qa", "/v1/summarize", "/v1/classify", "/v1/embeddings", "/embed", "/v1/models",
                                  "/readyz"])
def test_no_server_errors(fake_server, path):
    (op,) = [o for o in operations(fake_server.url) if o.path == path]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(op.as_strategy())
    def check(case):
        r = case.call(base_url=fake_server.url, timeout=30)
        seen.append(r.status_code)
        body = case.body if isinstance(case.body, dict) else {}
        if r.status_code == 504:
            assert "timeout" in body, r.text  # only a deadline the request set itself
        else:
            assert r.status_code < 500, (case.body, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"type", "message"} and err["message"]

    seen = []
    check()
    assert len(seen) >= 1
    if path in ("/v1/models", "/readyz"):
        assert set(seen) == {200}


def test_schemathesis_all_checks_pass(fake_server, tmp_path):
    """`st run --checks all`: the schema says exactly what the server accepts and answers
    (positive data accepted, negative data rejected, statuses, content types, methods). The
    config adds 413 to the rejections and 504 (a deadline the request set) to the non-errors."""
    st = Path(sys.executable).with_name("st")
    config = Path(__file__).with_name("schemathesis.toml")
    proc = subprocess.run(
        [str(st), "--config-file", str(config), "run", fake_server.url + "/openapi.json", "--checks", "all",
         "--max-examples", "15", "--workers", "1", "--seed", "1", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "No issues found" in proc.stdout


def test_schema_states_the_choices_and_limits(fake_server):
    schema = httpx.get(fake_server.url + "/openapi.json").json()
    body = schema["components"]["schemas"]["SummarizeRequest"]
    assert body["oneOf"] == [{"required": ["document"]}, {"required": ["documents"]}]
    props = body["properties"]
    assert props["documents"]["maxItems"] == 4 and props["documents"]["minItems"] == 1
    assert props["document"]["minLength"] == 1 and props["document"]["maxLength"] == 20_000
    assert "type" not in props["document"] or props["document"]["type"] == "string"  # no null
    responses = schema["paths"]["/v1/summarize"]["post"]["responses"]
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {str(code) for code in _ERRORS} <= set(responses)
    embeddings = schema["components"]["schemas"]["EmbeddingsRequest"]["properties"]
    text, texts = sorted(embeddings["input"]["anyOf"], key=lambda o: o["type"] == "array")
    assert text["maxLength"] == 20_000 and texts["maxItems"] == 4 and texts["items"]["maxLength"] == 20_000
    assert [o for o in embeddings["dimensions"]["anyOf"] if o["type"] == "integer"][0]["enum"] == [11]
    # `model` names the loaded models of the operation's task (another task's model would be refused)
    for name, served in (("QARequest", ["qa"]), ("SummarizeRequest", ["sum"]), ("ClassifyRequest", ["cls"]),
                         ("EmbeddingsRequest", ["emb"]), ("EmbedRequest", ["emb"])):
        model = schema["components"]["schemas"][name]["properties"]["model"]
        assert [o for o in model["anyOf"] if o["type"] == "string"][0].get("enum") == served, name


def test_the_routers_give_the_same_operations():
    """Issue 26 (routes as routers, service/tasks/*.py and service/operations.py): the OpenAPI
    document keeps its paths, in order, their methods, operation ids (FastAPI's, from the function
    names), tags and descriptions (the task routes' docstrings)."""
    s = Settings(models={"qa": "qa", "cls": "classify", "sum": "summarize"})
    paths = create_app(s, worker_factory=fake_factory()).openapi()["paths"]
    listed = [(path, method, op["operationId"], op["tags"])
              for path, ops in paths.items() for method, op in ops.items()]
    assert listed == [
        ("/v1/qa", "post", "qa_v1_qa_post", ["tasks"]),
        ("/v1/classify", "post", "classify_v1_classify_post", ["tasks"]),
        ("/v1/summarize", "post", "summarize_v1_summarize_post", ["tasks"]),
        ("/v1/embeddings", "post", "embeddings_v1_embeddings_post", ["tasks"]),
        ("/embed", "post", "embed_embed_post", ["tasks"]),
        ("/v1/models", "get", "models_v1_models_get", ["operations"]),
        ("/livez", "get", "livez_livez_get", ["operations"]),
        ("/readyz", "get", "readyz_readyz_get", ["operations"]),
        ("/metrics", "get", "metrics_metrics_get", ["operations"]),
    ]
    assert paths["/v1/qa"]["post"]["description"].startswith("Answer a question from each document")
    assert paths["/v1/classify"]["post"]["description"].startswith("Label each document")
    assert paths["/v1/summarize"]["post"]["description"].startswith("Summarize each document")
    for path in ("/v1/qa", "/v1/classify", "/v1/summarize"):
        assert {str(code) for code in _ERRORS} <= set(paths[path]["post"]["responses"])
