"""The connection and protocol layer (issue 29): no request smuggling, protocol errors in the one
error shape, and connection caps one client cannot use up for the others (health probes
included). Raw sockets against a real uvicorn on loopback; other clients are other loopback
addresses (127.0.0.2, 127.0.0.3: Linux routes all of 127/8 to lo)."""

import contextlib
import json
import socket

import pytest

from longdoc.service.settings import Settings
from tests.service.conftest import ThreadServer, fake_factory
from tests.service.test_limits import GET_LIVEZ, closed, read_response


@pytest.fixture(scope="module")
def srv():
    with ThreadServer(Settings(models={"cls": "classify"}, warmup=False, header_timeout_s=30),
                      worker_factory=fake_factory()) as s:
        yield s


def connect(srv, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=20, source_address=(source, 0))


def assert_shape(status, headers, body, expected_status, type_):
    assert status == expected_status, body
    assert headers["content-type"] == "application/json", headers
    error = json.loads(body)
    assert set(error) == {"error"} and set(error["error"]) == {"type", "message"}, error
    assert error["error"]["type"] == type_, error
    return error["error"]["message"]


def test_content_length_with_transfer_encoding_is_refused_and_nothing_after_it_is_served(srv):
    """RFC 9112 6.1: read as chunked, the 4 bytes of Content-Length ('0\\r\\n\\r') would end the
    body at once and the rest would be a second request on the same connection."""
    with connect(srv) as s:
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                  b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = read_response(s)
        message = assert_shape(status, headers, body, 400, "malformed_request")
        assert "both Content-Length and Transfer-Encoding" in message
        assert headers["connection"] == "close"
        assert closed(s)  # the smuggled GET /nope got no answer


BIG_HEADER = b"x-big: " + b"a" * (1 << 20) + b"\r\n"


@pytest.mark.parametrize("request_bytes, status, words", [
    (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
     400, "conflicting Content-Length"),
    (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-length: 2, 3\r\n\r\n{}", 400, "conflicting Content-Length"),
    (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ntransfer-encoding: xchunked\r\n\r\n", 501, "chunked"),
    (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
     501, "multiple Transfer-Encoding"),
    (b"POST /v1/classify HTTP/1.0\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400, "HTTP/1.0"),
    (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-length: +5\r\n\r\n{}", 400, "bad Content-Length"),
    (b"GET /livez HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\n\r\n", 400, "illegal header line"),
    (b"GET /livez HTTP/1.1\r\nhost: x\r\n" + BIG_HEADER + b"\r\n", 431, "over 16384 bytes"),
    # in one read: h11 checks its limit only while a head is incomplete (issue 38: 100 kB got 200)
    (b"GET /livez HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", 431, "over 16384 bytes"),
    (b"GET /livez HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n", 431, "over 16384 bytes"),
    (b"GET /livez HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 100) for i in range(200))
     + b"\r\n", 431, "over 16384 bytes"),
    (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
     b"\r\nzz\r\n", 400, "chunk"),
    (b"GET /livez HTTP/1.1\r\n\r\n", 400, "Host"),
    (b"NOT HTTP\r\n\r\n", 400, "malformed HTTP request"),
], ids=["differing-cl", "cl-list", "xchunked", "two-te", "te-http10", "cl-plus", "nul", "1mb-header",
                                "20kb-header-one-read", "100kb-header-one-read", "200-headers-one-read",
        "bad-chunk", "no-host", "garbage"])
def test_protocol_errors_are_answered_in_the_error_shape_and_the_connection_closed(srv, request_bytes, status, words):
    with connect(srv) as s:
        try:
            s.sendall(request_bytes)
        except (BrokenPipeError, ConnectionResetError):  # the 1 MB header: answered before it was all sent
            pass
        got, headers, body = read_response(s)
        message = assert_shape(got, headers, body, status, "malformed_request")
        assert words in message and headers["connection"] == "close", message


def test_one_client_cannot_take_the_connections_from_the_others_or_the_probes():
    """20 connections from 127.0.0.2 dribbling headers, over its 4: each new one closes its
    oldest idle one (503), so it never holds more than 4 of the 8; the probes (127.0.0.1) and
    another client's 3 connections (127.0.0.3) are all answered meanwhile."""
    settings = Settings(models={"cls": "classify"}, warmup=False, header_timeout_s=30, max_connections=8,
                        max_connections_per_client=4)
    with ThreadServer(settings, worker_factory=fake_factory()) as srv, contextlib.ExitStack() as sockets:
        flood = []
        for _ in range(20):
            s = sockets.enter_context(connect(srv, "127.0.0.2"))
            s.sendall(b"GET /livez HTTP/1.1\r\nho")  # ... never more
            flood.append(s)
        for s in flood[:16]:  # closed to make room, oldest first
            try:
                status, headers, body = read_response(s)
            except ConnectionResetError:  # closed before its bytes were read: the kernel resets
                continue
            message = assert_shape(status, headers, body, 503, "unavailable")
            assert "over 4 open connections from this client" in message
        others = [sockets.enter_context(connect(srv, "127.0.0.3")) for _ in range(3)]
        for path in (b"/livez", b"/readyz", b"/livez"):
            with connect(srv) as probe:
                probe.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path)
                assert read_response(probe)[0] == 200
        for s in others:
            s.sendall(GET_LIVEZ)
            assert read_response(s)[0] == 200
        for s in flood[16:]:  # the newest four are still open, waiting for their headers
            s.sendall(b"st: x\r\n\r\n")
            assert read_response(s)[0] == 200
