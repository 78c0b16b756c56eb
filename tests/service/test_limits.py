"""Slow and huge uploads (issue 12, item 5): header and body read timeouts (408), a connection cap
(503) and a cap on request-body bytes in flight (503), all in the error shape, against a real
uvicorn on a loopback port (and the body middleware driven directly where ordering matters)."""

import asyncio
import json
import socket
import threading

import h11

import pytest

from longdoc.service.app import BodyLimitMiddleware
from longdoc.service.settings import Settings
from tests.polling import until
from tests.service.conftest import ThreadServer, fake_factory

MODELS = {"cls": "classify"}


def server(**settings):
    return ThreadServer(Settings(models=MODELS, **settings), worker_factory=fake_factory())


def connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
    return s


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a content-length: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def assert_error(status, body, expected_status, type_):
    assert status == expected_status, body
    assert set(json.loads(body)) == {"error"} and json.loads(body)["error"]["type"] == type_, body


def closed(s: socket.socket) -> bool:
    return s.recv(1) == b""


GET_LIVEZ = b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n"


def test_headers_sent_slowly_get_408_and_the_connection_closes():
    with server(header_timeout_s=0.3) as srv, connect(srv) as s:
        s.sendall(b"GET /livez HTTP/1.1\r\nhos")  # ... and nothing more
        status, _, body = read_response(s)
        assert_error(status, body, 408, "request_timeout")
        assert closed(s)


def test_keep_alive_requests_and_slow_answers_are_not_cut_by_the_header_timeout():
    with server(header_timeout_s=0.3) as srv:
        with connect(srv) as s:
            for _ in range(3):
                s.sendall(GET_LIVEZ)
                assert read_response(s)[0] == 200
            s.sendall(b"GET /livez HTTP/1.1\r\n")  # then stalls: the next request is timed too
            assert read_response(s)[0] == 408
    slow = fake_factory(classify={"delay_s": 0.6})  # the answer takes longer than the header timeout
    with ThreadServer(Settings(models=MODELS, header_timeout_s=0.3), worker_factory=slow) as srv, \
            connect(srv) as s:
        body = json.dumps({"document": "good"}).encode()
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        status, _, answer = read_response(s)
        assert status == 200, answer


def test_over_the_cap_an_idle_connection_or_a_body_makes_room_and_answered_ones_leave_only_a_probe():
    with server(max_connections=2) as srv:
        idle = [connect(srv), connect(srv)]
        for s in idle:  # kept alive after an answer: idle
            s.sendall(GET_LIVEZ)
            assert read_response(s)[0] == 200
        with connect(srv) as third:  # the oldest idle one is closed for it
            status, headers, body = read_response(idle[0])
            assert_error(status, body, 503, "unavailable")
            assert headers["retry-after"] == "1" and closed(idle[0])
            third.sendall(GET_LIVEZ)
            assert read_response(third)[0] == 200
            idle[1].sendall(GET_LIVEZ)
            assert read_response(idle[1])[0] == 200
        for s in idle:
            s.close()
    with server(max_connections=2) as srv:
        uploads = [connect(srv), connect(srv)]
        for s in uploads:  # a body under way: the 100 Continue says its headers are in
            s.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"expect: 100-continue\r\ncontent-length: 100\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 100 ")
        with connect(srv) as third:  # the slowest body (a tie: the older) is closed for it
            status, headers, body = read_response(uploads[0])
            assert_error(status, body, 503, "unavailable")
            third.sendall(GET_LIVEZ)
            assert read_response(third)[0] == 200
        for s in uploads:
            s.close()
    gate = threading.Event()
    with ThreadServer(Settings(models=MODELS, max_connections=2, max_wait_ms=0, warmup=False),
                      worker_factory=fake_factory(classify={"gate": gate})) as srv:
        busy = [connect(srv), connect(srv)]
        try:
            for s in busy:  # requests being answered (the worker waits at the gate)
                s.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 17\r\n\r\n{\"document\": \"a\"}")
            until(lambda: sum(c.conn.their_state is h11.DONE for c in srv.server.server_state.connections) == 2,
                  "both requests are in")
            with connect(srv) as third:  # never closed for another: the new one may only ask a probe
                third.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
                status, headers, body = read_response(third)
                assert_error(status, body, 503, "unavailable")
                assert headers["retry-after"] == "1" and closed(third)
            with connect(srv) as probe:
                probe.sendall(GET_LIVEZ)
                assert read_response(probe)[0] == 200 and closed(probe)
        finally:
            gate.set()
        for s in busy:
            assert read_response(s)[0] == 200
            s.close()


def test_a_body_that_stops_arriving_gets_408():
    with server(body_timeout_s=0.3) as srv, connect(srv) as s:
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{\"document\": \"")  # 15 of 1000 bytes, then quiet
        status, _, body = read_response(s)
        assert_error(status, body, 408, "request_timeout")


# --- bytes in flight: BodyLimitMiddleware driven directly, the order set by events


class Client:
    """One request's ASGI side: body chunks fed by the test, the response recorded."""

    def __init__(self, content_length: int | None):
        headers = [(b"content-type", b"application/json")]
        if content_length is not None:
            headers.append((b"content-length", str(content_length).encode()))
        self.scope = {"type": "http", "method": "POST", "path": "/v1/classify", "headers": headers}
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.waiting = asyncio.Event()  # set when the middleware asks for a chunk not yet fed
        self.status = None
        self.body = b""

    def feed(self, data: bytes, more: bool):
        self.chunks.put_nowait({"type": "http.request", "body": data, "more_body": more})

    async def receive(self):
        if self.chunks.empty():
            self.waiting.set()
        return await self.chunks.get()

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.body += message.get("body", b"")


def test_body_bytes_in_flight_are_capped_and_released():
    async def go():
        answered, release = asyncio.Event(), asyncio.Event()
        entered = asyncio.Event()

        async def app(scope, receive, send):  # holds the request (and its body) until released
            message = await receive()
            entered.set()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": message["body"]})
            answered.set()

        mw = BodyLimitMiddleware(app, max_bytes=10_000, max_json_tokens=1000, timeout_s=30, max_bytes_in_flight=1000)
        a = Client(None)  # chunked: counted as it arrives
        a.feed(b"x" * 600, more=True)
        task_a = asyncio.ensure_future(mw(a.scope, a.receive, a.send))
        await a.waiting.wait()  # a's first chunk is buffered, the middleware waits for more
        assert mw.bytes_in_flight == 600
        b = Client(500)  # declared: refused before its body is read
        await mw(b.scope, b.receive, b.send)
        c = Client(None)
        c.feed(b"y" * 300, more=True)
        c.feed(b"y" * 300, more=False)
        await mw(c.scope, c.receive, c.send)  # refused at the chunk that goes over
        a.feed(b"x" * 300, more=False)
        await entered.wait()
        in_flight_while_held = mw.bytes_in_flight
        release.set()
        await task_a
        d = Client(900)  # a answered: its bytes are released
        d.feed(b"z" * 900, more=False)
        release.set()
        await mw(d.scope, d.receive, d.send)
        return a, b, c, d, in_flight_while_held, mw.bytes_in_flight

    a, b, c, d, held, after = asyncio.run(go())
    assert a.status == 200 and len(a.body) == 900 and held == 900
    for refused in (b, c):
        assert_error(refused.status, refused.body, 503, "unavailable")
    assert d.status == 200 and after == 0


@pytest.mark.parametrize("flag, field, value", [
    ("--header-timeout-s", "header_timeout_s", 2.5), ("--body-timeout-s", "body_timeout_s", 9.0),
    ("--max-connections", "max_connections", 64), ("--max-body-bytes-in-flight", "max_body_bytes_in_flight", 10**8),
])
def test_serve_flags(flag, field, value):
    import argparse

    from longdoc.service import cli

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    s = cli.build_settings(parser.parse_args(["serve", "--model", "q=/m", flag, str(value)]))
    assert getattr(s, field) == value


def test_the_deadline_counts_from_the_requests_arrival():
    """X-Request-Timeout is the client's wait: a body that takes longer than the timeout to arrive
    is past its deadline when it has arrived (504 at once, the message naming the time since the
    request arrived), not given the whole timeout again from the moment it was parsed. The worker
    never answers (held until the test ends), so only the deadline can end the request."""
    import asyncio
    import threading
    import time

    from longdoc.testing.fake_worker import FakeWorker
    from tests.service.conftest import running_app

    gate = threading.Event()
    body = b'{"question": "where", "document": "the gold is here"}'

    class Held(FakeWorker):  # answers its warm-up, then holds every run until the gate opens
        def run(self, batch):
            if self.warm:
                gate.wait(30)
            return super().run(batch)

        def warmup(self):
            super().warmup()
            self.warm = True

    def factory(name, directory, device, settings):
        w = Held(name=name, task=str(directory))
        w.warm = False
        return w

    async def go():
        async with running_app(factory) as client:
            async def slow_body():
                yield body[:10]
                await asyncio.sleep(0.6)  # the time under test: the body takes 0.6 s to arrive
                yield body[10:]

            start = time.monotonic()
            r = await client.post("/v1/qa", content=slow_body(), headers={"content-type": "application/json",
                                                                          "x-request-timeout": "0.5"})
            return r, time.monotonic() - start

    try:
        r, waited = asyncio.run(go())
    finally:
        gate.set()
    assert r.status_code == 504, r.text
    assert waited < 0.9  # not 0.6 s of upload and then another 0.5 s in the queue
    message = r.json()["error"]["message"]
    assert "after the request arrived" in message or "tokenization" in message, message
