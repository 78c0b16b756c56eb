"""Connection-level limits that uvicorn lacks, as its HTTP/1.1 (h11) protocol with two additions:

- a header timeout: a connection must deliver a whole request line and headers within
  `header_timeout_s` of opening (or of its previous response); else 408 and close. uvicorn's
  `timeout_keep_alive` runs only between requests, so a client sending headers a byte at a time
  held a connection for as long as it liked.
- a connection cap: over `max_connections` open connections a new one is answered 503 and closed
  at once. (uvicorn's `limit_concurrency` counts the same, but only once a request's headers are in,
  which slow-header connections never reach, and answers in plain text.)

Refusals use the service's error shape. The body read timeout and the cap on body bytes in flight
are ASGI-level (longdoc.service.app.BodyLimitMiddleware).
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def raw_error(status: int, reason: str, type_: str, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 error response in the error shape, written before any request was parsed."""
    body = json.dumps({"error": {"type": type_, "message": message}}).encode()
    head = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
            **(headers or {})}
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in head.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def limited_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a header timeout and a connection cap
    (`uvicorn.Config(http=limited_protocol(...))`)."""

    class LimitedH11Protocol(H11Protocol):
        header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(raw_error(503, "Service Unavailable", "unavailable",
                                          f"over {max_connections} open connections; retry later",
                                          {"retry-after": "1"}))
                transport.close()
                return
            self._arm_header_timer()

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
                self.transport.write(raw_error(408, "Request Timeout", "request_timeout",
                                               f"request headers not received within {header_timeout_s:g} s"))
                self.transport.close()

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
            self._cancel_header_timer()
            super().connection_lost(exc)

    return LimitedH11Protocol
