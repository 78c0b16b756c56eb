"""The connection and protocol layer: uvicorn's HTTP/1.1 (h11) protocol with what it lacks.

- A header timeout: a connection must deliver a whole request line and headers within
  `header_timeout_s` of opening (or of its previous response); else 408 and close. uvicorn's
  `timeout_keep_alive` runs only between requests, so a client sending headers a byte at a time
  held a connection for as long as it liked.
- Connection caps that one client cannot use up for the others. A client (the peer's IP address;
  for a request from a trusted proxy, the client its X-Forwarded-For names) holds at most
  `max_connections_per_client` connections, and all clients together `max_connections`. Over
  either, a new connection closes another of that client, or, over the total, of the client
  holding the most connections (`closing_rank`: dawdling ones, then the slowest bodies; never a
  request being answered or a fresh connection whose head may be on its way). With nothing to
  close, it waits apart for its first bytes, and then closes a dawdler, is answered if it asks a
  probe, or is refused (503). So a flood of idle, dribbling or slow-body connections only
  displaces itself, and a health probe, whose headers arrive at once, still gets in. (uvicorn's
  `limit_concurrency` counts only once a request's headers are in, which slow-header connections
  never reach, treats all clients alike, and answers in plain text.)
- A minimum upload rate: a body must arrive at `min_upload_bytes_per_s` on average after its first
  second, else 408 and close (RFC 9110 section 15.5.9).
- A head (request line and headers) over h11's 16 KiB limit gets 431 however it arrives.
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
import ipaddress
import json
import socket
import time

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


# A connection opened (or kept alive after a response) less than this long ago whose next request
# has sent nothing yet is never closed for another: a probe sends its head at once, and a flood
# reopened as fast as it is closed (from the probe's own address, or behind a proxy) closed it
# before its head had been read. A new connection that finds nothing else to close waits, counted
# apart, until its first bytes or FRESH_S, and is admitted or refused then; when max_connections
# wait already, only one whose whole head is already in its socket's buffer joins them.
FRESH_S = 1.0
# A body's first second is not held to min_upload_bytes_per_s (the client's start, TCP slow start).
UPLOAD_GRACE_S = 1.0
PROBE_PATHS = frozenset({"/livez", "/readyz"})


def trusted_networks(proxies: list[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(p, strict=False) for p in proxies)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        return None


def trusted(peer: str, proxies) -> bool:
    address = _address(peer)
    return address is not None and any(address in net for net in proxies)


def forwarded_client(peer: str, headers, proxies) -> str:
    """The client a request comes from: its peer address, or, where the peer is a trusted proxy,
    the address nearest to it in X-Forwarded-For that is not itself a trusted proxy. (Each proxy
    appends the address it was sent the request from, so what is right of that address was written
    by trusted proxies, and what is left of it by anyone.) A header from any other peer is ignored."""
    if not trusted(peer, proxies):
        return peer
    hops = [hop for name, value in headers if name.lower() == b"x-forwarded-for"
            for hop in value.decode("latin-1").split(",")]
    client = peer
    for hop in reversed(hops):
        address = _address(hop)
        if address is None:  # not an address: what is left of it cannot be read
            break
        client = str(address)
        if not any(address in net for net in proxies):
            break
    return client


def limited_protocol(settings) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the additions above, for `uvicorn.Config(http=...)`, from
    the service's Settings. One class per server: it holds that server's connections by client."""
    header_timeout_s, max_connections = settings.header_timeout_s, settings.max_connections
    per_client, min_rate = settings.max_connections_per_client, settings.min_upload_bytes_per_s
    proxies = trusted_networks(settings.trusted_proxies)
    by_client: dict[str, dict[H11Protocol, None]] = {}  # client -> its connections, oldest first
    pending: dict[H11Protocol, None] = {}  # new connections over a cap with nothing to close yet, oldest first

    def close_one(connections, why: str) -> bool:
        """Close the first of `connections` to close for another (`closing_rank`); False if none may be."""
        now = time.monotonic()
        ranked = [(rank, i, c) for i, c in enumerate(connections) if (rank := c.closing_rank(now)) is not None]
        if not ranked:
            return False
        min(ranked)[2].close_with(Unavailable(why, {"Retry-After": "1"}))
        return True

    class LimitedH11Protocol(H11Protocol):
        header_timer = upload_timer = pending_timer = None
        group: dict | None = None  # this connection's entry in by_client, while it counts
        owner = ""  # its key there: the peer, or the forwarded client of a request from a trusted proxy
        peer = ""
        from_proxy = False  # the peer is a trusted proxy: only its requests count per client
        probe_only = False  # admitted past the caps for one probe
        idle_since = 0.0  # opened, or its last response completed
        head_begun = False  # bytes of the next request have arrived
        body_started = 0.0  # the current request's headers were in (a body is timed from then) ...
        body_received = 0  # ... and its body bytes since

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.max_head_bytes = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            self.conn = StrictConnection(h11.SERVER, self.max_head_bytes)
            self.app = answers_cancelled(self.app)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.peer = self.owner = self.client[0] if self.client else ""
            self.from_proxy = trusted(self.peer, proxies)
            self.idle_since = time.monotonic()
            self._arm_header_timer()
            if (why := self._make_room()) is not None:
                # as many waiting as may be open: refused at once, unless a whole head is already here
                if len(pending) >= max_connections and not self._head_waiting():
                    return self.close_with(Unavailable(why, {"Retry-After": "1"}))
                pending[self] = None
                self.pending_timer = self.loop.call_later(FRESH_S, self._admit_pending)

        def _head_waiting(self) -> bool:
            """A whole request head is in the socket's buffer, not yet read (a probe sends its head
            at once; a flood that fills the waiting room sends part of one, or nothing)."""
            transport_socket = self.transport.get_extra_info("socket")
            if transport_socket is None:
                return False
            sock = socket.socket(fileno=transport_socket.fileno())  # the transport's own: peeked at, then let go
            try:
                return b"\r\n\r\n" in sock.recv(self.max_head_bytes + 4, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except OSError:
                return False
            finally:
                sock.detach()

        def _make_room(self) -> str | None:
            """Count this connection for its client; over a cap, close another for it (`closing_rank`).
            None, or why not (then it is not counted)."""
            self._join(self.owner)
            others = [c for c in self.group if c is not self]
            # a trusted proxy carries many clients: its requests count per forwarded client instead
            if len(self.group) > per_client and not (self.from_proxy and self.owner == self.peer) and not close_one(
                    others, f"closed: over {per_client} open connections from this client"):
                self._leave()
                return f"over {per_client} open connections from this client, none to close; retry later"
            if sum(map(len, by_client.values())) > max_connections and not self._close_for_total():
                self._leave()
                return f"over {max_connections} open connections, none to close; retry later"
            return None

        def _close_for_total(self) -> bool:
            """Over max_connections: close one of the client holding the most that may be closed,
            never one of a client holding fewer than this connection's own."""
            size = len(self.group)
            for group in sorted(by_client.values(), key=len, reverse=True):
                if len(group) < size:
                    break
                if close_one([c for c in group if c is not self], f"closed: over {max_connections} open connections"):
                    return True
            return False

        def _admit_pending(self, probe: bool = False) -> None:
            """A waiting connection's first bytes (or FRESH_S) came: counted now, or refused (503),
            unless its request is a probe, which is answered (and the connection closed after)."""
            pending.pop(self, None)
            self._cancel_pending_timer()
            if self.transport.is_closing() or (why := self._make_room()) is None:
                return
            if probe:
                self.probe_only = True
            else:
                self.close_with(Unavailable(why, {"Retry-After": "1"}))

        def _join(self, owner: str) -> None:
            self._leave()
            self.owner = owner
            self.group = by_client.setdefault(owner, {})
            self.group[self] = None

        def _leave(self) -> None:
            if self.group is not None:
                self.group.pop(self, None)
                if not self.group:
                    by_client.pop(self.owner, None)
                self.group = None

        def idle(self) -> bool:
            """No request in progress: its headers are still arriving, or none has begun."""
            return (not self.transport.is_closing() and self.conn.their_state is h11.IDLE
                    and (self.cycle is None or self.cycle.response_complete))

        def closing_rank(self, now: float) -> tuple | None:
            """The order in which connections close for a new one (lowest first): idle ones that
            dawdle (part of a head, or nothing for FRESH_S), the oldest first; then bodies in
            progress, the slowest first. None: never (a fresh connection, a request being answered)."""
            if self.idle():
                waited = now - self.idle_since
                return None if waited < FRESH_S and not self.head_begun else (0, -waited)
            if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
                return (1, self.body_received / max(now - self.body_started, 1e-3))
            return None

        def close_with(self, exc: ServiceError) -> None:
            """Answer `exc` (unless a response has begun) and close; it counts no more at once."""
            self._forget()
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self.transport.is_closing():
                self.transport.write(raw_error(exc))
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # the app's request ends: its response goes nowhere
                self.cycle.message_event.set()
            self.transport.close()

        def _forget(self) -> None:
            self._cancel_header_timer()
            self._cancel_upload_timer()
            self._cancel_pending_timer()
            self._leave()
            pending.pop(self, None)

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

        def _cancel_pending_timer(self) -> None:
            if self.pending_timer is not None:
                self.pending_timer.cancel()
                self.pending_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.close_with(RequestTimeout(f"request headers not received within {header_timeout_s:g} s"))

        def _cancel_upload_timer(self) -> None:
            if self.upload_timer is not None:
                self.upload_timer.cancel()
                self.upload_timer = None

        def _check_upload(self) -> None:
            """A body must arrive at min_upload_bytes_per_s on average after UPLOAD_GRACE_S (RFC 9110
            section 15.5.9: 408, and close), else it holds its connection for the body timeout."""
            self.upload_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
                return
            now = time.monotonic()
            if self.flow.read_paused:  # the app has not read what came (uvicorn stopped reading): not the client
                self.body_started, self.body_received = now, 0
            deadline = self.body_started + UPLOAD_GRACE_S + self.body_received / min_rate
            if now >= deadline:
                rate = self.body_received / max(now - self.body_started, 1e-3)
                return self.close_with(RequestTimeout(
                    f"request body arriving at {rate:.0f} bytes/s, under the minimum of {min_rate:g} bytes/s "
                    f"(min_upload_bytes_per_s)"))
            self.upload_timer = self.loop.call_later(deadline - now, self._check_upload)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.SEND_BODY:
                self.body_received += len(data)
            elif self.conn.their_state is h11.IDLE:
                self.head_begun = True
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.transport.is_closing():
                return
            if self.cycle is not cycle:  # a request's headers are in
                self._request_began()
            elif self in pending:  # part of a head: it dawdles like the rest
                self._admit_pending()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._cancel_header_timer()

        def _request_began(self) -> None:
            scope = self.cycle.scope
            if self in pending:
                self._admit_pending(probe=scope["method"] in ("GET", "HEAD") and scope["path"] in PROBE_PATHS)
                if self.transport.is_closing():
                    return
            if self.from_proxy and self.group is not None:  # behind a trusted proxy: its client's budget
                client = forwarded_client(self.peer, scope["headers"], proxies)
                scope["client"] = (client, 0)
                self._join(client)
                if len(self.group) > per_client and not close_one(
                        [c for c in self.group if c is not self],
                        f"closed: over {per_client} open connections from this client"):
                    return self.close_with(Unavailable(
                        f"over {per_client} open connections from this client, none to close; retry later",
                        {"Retry-After": "1"}))
            if self.conn.their_state is h11.SEND_BODY:
                self.body_started, self.body_received = time.monotonic(), 0
                self._cancel_upload_timer()
                self.upload_timer = self.loop.call_later(UPLOAD_GRACE_S, self._check_upload)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._cancel_upload_timer()
            if self.probe_only:  # its one probe is answered
                self.transport.close()
                return
            self.idle_since, self.head_begun = time.monotonic(), False
            if self.group is not None and self.owner != self.peer:  # back to the proxy's connections
                self._join(self.peer)
            # keep-alive: the next request's headers are timed too (unless pipelined, already in)
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._forget()
            super().connection_lost(exc)

    return LimitedH11Protocol
