"""The connection and protocol layer: uvicorn's HTTP/1.1 (h11) protocol with what it lacks.

- A header timeout: a connection must deliver a whole request line and headers within
  `header_timeout_s` of opening (or of its previous response); else 408 and close. uvicorn's
  `timeout_keep_alive` runs only between requests, so a client sending headers a byte at a time
  held a connection for as long as it liked.
- Connection caps that one client cannot use up for the others. A client (the peer's IP address:
  behind a proxy, the proxy) holds at most `max_connections_per_client` connections, and all
  clients together `max_connections`. Over either, a new connection closes the oldest *idle*
  connection (no request in progress: headers still arriving, or kept alive between requests) of
  that client, or, over the total, of the client holding the most connections; only when none is
  idle is the new one refused (503). So a flood of idle or dribbling connections only displaces
  itself, and a health probe, whose headers arrive at once, still gets in. (uvicorn's
  `limit_concurrency` counts only once a request's headers are in, which slow-header connections
  never reach, treats all clients alike, and answers in plain text.)
- Framing that cannot be ambiguous (RFC 9112 section 6.1): a request with both Content-Length and
  Transfer-Encoding, or Transfer-Encoding on HTTP/1.0, is refused and its connection closed, so
  bytes after its body are never read as a second request (request smuggling behind a proxy that
  frames by Content-Length). h11 itself refuses differing Content-Lengths (identical duplicates it
  merges, as RFC 9110 section 8.6 allows), any transfer coding but chunked, and malformed lengths,
  header lines and chunk sizes.
- Every answer in the service's error shape: protocol errors (uvicorn writes a plain-text 400) and a
  request that uvicorn cancels at the end of its shutdown timeout before any response (uvicorn
  writes a plain-text 500) get JSON.

The body read timeout and the cap on body bytes in flight are ASGI-level
(longdoc.service.app.BodyLimitMiddleware).
"""

from __future__ import annotations

import asyncio
import http
import json

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from longdoc.service.errors import (
    MalformedRequest, RequestTimeout, ServiceError, ShuttingDown, Unavailable, error_body,
)


def raw_error(exc: ServiceError, close: bool = True) -> bytes:
    """A whole HTTP/1.1 error response in the error shape, written outside any ASGI app."""
    body = json.dumps(error_body(exc)).encode()
    head = {"content-type": "application/json", "content-length": str(len(body)), **exc.headers}
    if close:
        head["connection"] = "close"
    lines = [f"HTTP/1.1 {exc.status} {http.HTTPStatus(exc.status).phrase}", *(f"{k}: {v}" for k, v in head.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def framing_ambiguity(request: h11.Request) -> str | None:
    """Why the request's body framing is ambiguous (RFC 9112 section 6.1), or None."""
    names = {name.lower() for name, _ in request.headers}
    if b"transfer-encoding" in names:
        if b"content-length" in names:
            return "both Content-Length and Transfer-Encoding: send one"
        if request.http_version == b"1.0":
            return "Transfer-Encoding in an HTTP/1.0 request"
    return None


def head_bytes(request: h11.Request) -> int:
    """The bytes of a request's line and headers (as h11 parsed them: at most the bytes sent)."""
    line = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n") + 1
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


class StrictConnection(h11.Connection):
    """h11's connection that also refuses ambiguous framing and a head over its size limit
    however it arrived (h11 checks `max_incomplete_event_size` only while a head is incomplete,
    so a 100 kB head in one read passed), and keeps the protocol error it raised (`error`) so
    that the answer can say what it was, with h11's status."""

    error: h11.RemoteProtocolError | None = None

    def __init__(self, our_role, max_incomplete_event_size: int = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE):
        super().__init__(our_role, max_incomplete_event_size)
        self.max_head_bytes = max_incomplete_event_size

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise
        if isinstance(event, h11.Request):
            if head_bytes(event) > self.max_head_bytes:
                self.error = h11.RemoteProtocolError("request head too long", error_status_hint=431)
                raise self.error
            if (why := framing_ambiguity(event)) is not None:
                self.error = h11.RemoteProtocolError(why, error_status_hint=400)
                raise self.error
        return event


def answers_cancelled(app):
    """`app`, but a request cancelled by uvicorn (at the end of its shutdown timeout) before its
    response began is answered 503 shutting_down rather than uvicorn's plain-text 500."""

    async def guarded(scope, receive, send):
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, tracked)
        except asyncio.CancelledError:
            if scope["type"] != "http" or started:
                raise
            body = json.dumps(error_body(ShuttingDown("server is shutting down; retry"))).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})

    return guarded


def limited_protocol(settings) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the additions above, for `uvicorn.Config(http=...)`, from
    the service's Settings. One class per server: it holds that server's connections by client."""
    header_timeout_s, max_connections = settings.header_timeout_s, settings.max_connections
    per_client = settings.max_connections_per_client
    by_client: dict[str, dict[H11Protocol, None]] = {}  # client -> its connections, oldest first

    def evict_idle(connections: dict[H11Protocol, None], why: str) -> bool:
        """Close the oldest idle one of `connections`; False if none is idle."""
        for old in connections:
            if old.idle():
                old.close_with(Unavailable(why, {"Retry-After": "1"}))
                return True
        return False

    class LimitedH11Protocol(H11Protocol):
        header_timer = None
        group: dict | None = None  # this connection's entry in by_client, while it counts

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.max_head_bytes = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            self.conn = StrictConnection(h11.SERVER, self.max_head_bytes)
            self.app = answers_cancelled(self.app)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.group = by_client.setdefault(self.client[0] if self.client else "", {})
            self.group[self] = None
            if len(self.group) > per_client and not evict_idle(
                    self.group, f"closed: over {per_client} open connections from this client"):
                return self.close_with(Unavailable(
                    f"over {per_client} open connections from this client, none idle; retry later",
                    {"Retry-After": "1"}))
            if sum(map(len, by_client.values())) > max_connections and not any(
                    evict_idle(group, f"closed: over {max_connections} open connections")
                    for group in sorted(by_client.values(), key=len, reverse=True)):
                return self.close_with(Unavailable(
                    f"over {max_connections} open connections, none idle; retry later", {"Retry-After": "1"}))
            self._arm_header_timer()

        def idle(self) -> bool:
            """No request in progress: its headers are still arriving, or none has begun."""
            return (not self.transport.is_closing() and self.conn.their_state is h11.IDLE
                    and (self.cycle is None or self.cycle.response_complete))

        def close_with(self, exc: ServiceError) -> None:
            """Answer `exc` (unless a response has begun) and close; it counts no more at once."""
            self._forget()
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self.transport.is_closing():
                self.transport.write(raw_error(exc))
            self.transport.close()

        def _forget(self) -> None:
            self._cancel_header_timer()
            if self.group is not None:
                self.group.pop(self, None)
                if not self.group:
                    by_client.pop(self.client[0] if self.client else "", None)
                self.group = None

        def send_400_response(self, msg: str) -> None:
            """A protocol error (uvicorn's `msg` is always "Invalid HTTP request received.")."""
            error = self.conn.error
            status = error.error_status_hint if error is not None else 400
            what = str(error)[:200] if error is not None else "invalid HTTP request"  # h11's words
            if status == 431:  # h11: "Receive buffer too long"
                what = f"request line and headers over {self.max_head_bytes} bytes"
            self.close_with(MalformedRequest(f"malformed HTTP request: {what}", status))

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self.header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.close_with(RequestTimeout(f"request headers not received within {header_timeout_s:g} s"))

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # keep-alive: the next request's headers are timed too (unless pipelined, already in)
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._forget()
            super().connection_lost(exc)

    return LimitedH11Protocol
