"""Access control (issue 12, item 9): optional API keys, a request rate per key, keys kept out of
logs and metrics."""

import asyncio
import logging

import pytest

from longdoc.service.access import TokenBucket
from longdoc.service.app import create_app
from longdoc.service.settings import Settings
from tests.service.conftest import running_app

KEY, OTHER = "sk-test-0123456789abcdef", "sk-other-fedcba9876543210"
DOC = {"document": "good good bad"}


def bearer(key):
    return {"authorization": f"Bearer {key}"}


def run(coro):
    return asyncio.run(coro)


def assert_error(r, status, type_):
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"type": type_, "message": r.json()["error"]["message"]}}
    assert r.json()["error"]["message"]


def test_token_bucket_allows_bursts_then_the_rate():
    b = TokenBucket(rate=2.0, burst=2)
    assert b.take(10.0) == 0.0 and b.take(10.0) == 0.0
    assert b.take(10.0) == pytest.approx(0.5)  # empty: a token in half a second
    assert b.take(10.25) == pytest.approx(0.25)
    assert b.take(10.5) == 0.0
    assert b.take(100.0) == 0.0 and b.take(100.0) == 0.0 and b.take(100.0) > 0  # refills to burst only


def test_without_a_valid_key_401_in_the_error_shape():
    async def go():
        async with running_app(api_keys=[KEY]) as c:
            return [await c.post("/v1/classify", json=DOC),
                    await c.post("/v1/classify", json=DOC, headers=bearer("wrong")),
                    await c.post("/v1/classify", json=DOC, headers={"authorization": KEY}),  # no scheme
                    await c.get("/v1/models"), await c.get("/openapi.json"),
                    await c.post("/v1/classify", json=DOC, headers=bearer(KEY))]

    *refused, ok = run(go())
    for r in refused:
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
    assert ok.status_code == 200, ok.text


def test_health_and_metrics_are_open_unless_configured_closed():
    async def go(**options):
        async with running_app(api_keys=[KEY], **options) as c:
            return [(await c.get(p)).status_code for p in ("/livez", "/readyz", "/metrics")]

    assert run(go()) == [200, 200, 200]
    assert run(go(open_paths=["/livez"])) == [200, 401, 401]


def test_keys_from_the_environment_and_a_file(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# longdoc API keys\n{OTHER}\n\n")
    monkeypatch.setenv("LONGDOC_API_KEYS", f"{KEY}, sk-third")
    monkeypatch.setenv("LONGDOC_API_KEY_FILE", str(key_file))

    async def go():
        async with running_app() as c:
            return [(await c.post("/v1/classify", json=DOC, headers=bearer(k))).status_code
                    for k in (KEY, "sk-third", OTHER, "# longdoc API keys", "")]

    assert run(go()) == [200, 200, 200, 401, 401]


def test_keys_as_a_json_list(monkeypatch):
    monkeypatch.setenv("LONGDOC_API_KEYS", f'["{KEY}", "k,2"]')
    assert Settings().all_api_keys() == [KEY, "k,2"]


def test_an_empty_key_file_does_not_switch_authentication_off(tmp_path):
    (tmp_path / "keys").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no keys"):
        create_app(Settings(api_key_file=tmp_path / "keys"))


def test_rate_limit_per_key_429_with_retry_after():
    async def go():
        async with running_app(api_keys=[KEY, OTHER], rate_limit_per_s=0.01, rate_limit_burst=2) as c:
            mine = [await c.post("/v1/classify", json=DOC, headers=bearer(KEY)) for _ in range(3)]
            other = await c.post("/v1/classify", json=DOC, headers=bearer(OTHER))
            metrics = (await c.get("/metrics")).text
            return mine, other, metrics

    mine, other, metrics = run(go())
    assert [r.status_code for r in mine[:2]] == [200, 200]
    assert_error(mine[2], 429, "rate_limited")
    assert 1 <= int(mine[2].headers["retry-after"]) <= 100
    assert other.status_code == 200  # each key has its own budget
    assert 'longdoc_request_failures_total{endpoint="classify",reason="rate_limited"} 1.0' in metrics


def test_keys_stay_out_of_logs_metrics_and_settings(caplog):
    async def go():
        async with running_app(api_keys=[KEY], host="0.0.0.0") as c:
            await c.post("/v1/classify", json=DOC, headers=bearer(KEY))
            await c.post("/v1/classify", json=DOC, headers=bearer(KEY[:-1]))
            await c.post("/v1/qa", json={"document": "x"}, headers=bearer(KEY))  # a validation error
            return (await c.get("/metrics")).text, c.app.state.service.settings

    with caplog.at_level(logging.DEBUG):
        metrics, settings = run(go())
    assert 'reason="unauthorized"} 1.0' in metrics
    for text in (caplog.text, metrics, repr(settings), str(settings.model_dump())):
        assert KEY not in text and KEY[:-1] not in text


def test_open_interface_without_keys_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="longdoc.service"):
        create_app(Settings(host="0.0.0.0"))
    assert "without API keys" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longdoc.service"):
        create_app(Settings(host="0.0.0.0", api_keys=[KEY]))
    assert "without API keys" not in caplog.text


def test_schema_declares_the_bearer_key():
    async def go():
        async with running_app(api_keys=[KEY]) as c:
            return (await c.get("/openapi.json", headers=bearer(KEY))).json()

    schema = run(go())
    assert schema["components"]["securitySchemes"] == {"apiKey": {"type": "http", "scheme": "bearer"}}
    assert schema["paths"]["/v1/qa"]["post"]["security"] == [{"apiKey": []}]
    assert "401" in schema["paths"]["/v1/qa"]["post"]["responses"]
    assert "security" not in schema["paths"]["/livez"]["get"]


def test_serve_flags(tmp_path):
    import argparse

    from longdoc.service import cli

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    (tmp_path / "keys").write_text(KEY + "\n")
    s = cli.build_settings(parser.parse_args(["serve", "--model", "q=/m", "--api-key-file", str(tmp_path / "keys"),
                                              "--rate-limit-per-s", "5", "--rate-limit-burst", "10"]))
    assert (s.api_key_file, s.rate_limit_per_s, s.rate_limit_burst) == (tmp_path / "keys", 5.0, 10)
    assert s.all_api_keys() == [KEY]


def test_failed_authentication_is_throttled_per_client_with_429_and_retry_after():
    """40 wrong keys in a row (issue 29, item 5): the first `auth_failure_burst` (10) get 401, then
    429 with Retry-After; while throttled the client's keys are not even checked (so the 429s
    say nothing about a guess, a right one included). Another client is not affected."""
    import httpx

    async def go():
        async with running_app(api_keys=[KEY]) as c:
            guesses = [await c.post("/v1/classify", json=DOC, headers=bearer(f"sk-guess-{i}")) for i in range(40)]
            right_one = await c.post("/v1/classify", json=DOC, headers=bearer(KEY))
            transport = httpx.ASGITransport(app=c.app, client=("127.0.0.2", 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as other:
                elsewhere = await other.post("/v1/classify", json=DOC, headers=bearer(KEY))
            metrics = (await c.get("/metrics")).text
            return guesses, right_one, elsewhere, metrics

    guesses, right_one, elsewhere, metrics = run(go())
    for r in guesses[:10]:
        assert_error(r, 401, "unauthorized")
    for r in guesses[10:] + [right_one]:
        assert_error(r, 429, "rate_limited")
        assert "failed authentications from this client" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 2  # one failure a second refills
    assert elsewhere.status_code == 200, elsewhere.text
    assert 'longdoc_request_failures_total{endpoint="classify",reason="rate_limited"} 31.0' in metrics


def test_the_failure_throttle_forgets_clients_whose_budget_is_full():
    from longdoc.service.access import AccessControl
    from longdoc.service.errors import Unauthorized

    access = AccessControl([KEY], failures_per_s=1.0, failure_burst=2, max_clients=100)
    for i in range(300):  # 300 clients, one failure each, a second apart: all refilled but the last
        with pytest.raises(Unauthorized):
            access.check("Bearer nope", float(i), client=f"10.0.{i // 256}.{i % 256}")
    assert len(access._failures) <= 101
