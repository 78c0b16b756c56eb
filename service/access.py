"""Access control: optional API keys (`Authorization: Bearer KEY`) and a request-rate limit per key.

Keys come from `LONGDOC_API_KEYS` (comma-separated) and/or `LONGDOC_API_KEY_FILE` (one per line,
`#` comments; e.g. a mounted Kubernetes Secret). With no keys configured, every request passes.
Keys are held only as sha256 digests and never logged or used as metric labels: a key is known
by its position ("key 2") wherever one must be named.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from longdoc.service.errors import RateLimited, ServiceError, Unauthorized


def read_key_file(path: Path) -> list[str]:
    """Keys, one per line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"api_key_file {path}: cannot read it ({exc.strerror})") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass
class TokenBucket:
    """`rate` requests per second on average, bursts of up to `burst` (a token per request)."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    updated: float = field(default=-math.inf)

    def __post_init__(self):
        self.tokens = self.burst

    def wait(self, now: float) -> float:
        """Seconds until a request may go (0.0: now), spending nothing."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate

    def take(self, now: float) -> float:
        """0.0 when a request may go now (a token is spent), else the seconds until one may."""
        wait = self.wait(now)
        if wait == 0.0:
            self.tokens -= 1.0
        return wait

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.updated) * self.rate >= self.burst


class AccessControl:
    """Who may call: `check(authorization_header, now, client)` returns the caller's key index or
    raises. Failed authentications are limited per client (its address, as the connection caps
    count it: service/connections.py): `failure_burst` at once, then `failures_per_s`; a client over
    it gets 429 for every keyed request, its key unchecked, so that the answer says nothing about
    a guess."""

    def __init__(self, keys: list[str], rate_per_s: float | None = None, burst: int | None = None,
                 failures_per_s: float = 1.0, failure_burst: int = 10, max_clients: int = 10000):
        self.enabled = bool(keys)
        self._index = {_digest(k): i for i, k in enumerate(keys, 1)}  # digest -> 1-based key index
        self.rate_per_s = rate_per_s
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate_per_s or 1)))
        self._buckets: dict[int, TokenBucket] = {}
        self.failures_per_s, self.failure_burst = failures_per_s, float(failure_burst)
        self.max_clients = max_clients  # past it, clients whose failure budget is full are forgotten
        self._failures: dict[str, TokenBucket] = {}  # client -> its failed-authentication budget

    def check(self, authorization: str | None, now: float, client: str = "") -> int | None:
        if not self.enabled:
            return None
        failures = self._failures.get(client)
        if failures is not None and (wait := failures.wait(now)) > 0:
            raise RateLimited(f"too many failed authentications from this client (at most "
                              f"{self.failures_per_s:g}/s after {self.failure_burst:g}); retry later",
                              retry_after_s=max(1, math.ceil(wait)))
        scheme, _, key = (authorization or "").partition(" ")
        index = self._index.get(_digest(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if index is None:
            self._failed(client, now)
            if scheme.lower() != "bearer" or not key.strip():
                raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
            raise Unauthorized("invalid API key")
        if self.rate_per_s is not None:
            bucket = self._buckets.setdefault(index, TokenBucket(self.rate_per_s, self.burst))
            wait = bucket.take(now)
            if wait > 0:
                raise RateLimited(f"rate limit of {self.rate_per_s:g} requests/s for this API key",
                                  retry_after_s=max(1, math.ceil(wait)))
        return index

    def _failed(self, client: str, now: float) -> None:
        if client not in self._failures and len(self._failures) >= self.max_clients:
            self._failures = {c: b for c, b in self._failures.items() if not b.full(now)}
        self._failures.setdefault(client, TokenBucket(self.failures_per_s, self.failure_burst)).take(now)


class AccessMiddleware:
    """The outermost layer: refuses a request without a valid key (401) or over its key's rate
    (429) before its body is read. `open_paths` (health, metrics) pass without a key."""

    def __init__(self, app, access: AccessControl, open_paths: list[str], on_refused, error_response):
        self.app = app
        self.access = access
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused  # (path, ServiceError) -> None: metrics
        self.error_response = error_response  # ServiceError -> ASGI app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.access.enabled or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            client = scope["client"][0] if scope.get("client") else ""
            self.access.check(authorization, time.monotonic(), client)
        except ServiceError as exc:
            self.on_refused(scope["path"], exc)
            return await self.error_response(exc)(scope, receive, send)
        await self.app(scope, receive, send)
