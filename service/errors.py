"""Service errors: each knows its HTTP status, its `type` in the JSON error shape
`{"error": {"type", "message"}}`, and its failure reason for metrics."""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    type = "internal_error"
    reason = "internal"

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


def error_body(exc: ServiceError) -> dict:
    """The one error shape."""
    return {"error": {"type": exc.type, "message": exc.message}}


class MalformedRequest(ServiceError):
    """The HTTP message itself is malformed or its framing ambiguous (service/connections.py):
    answered, then the connection is closed. `status` is h11's hint: 400, 431 for headers over the
    limit, 501 for a transfer coding other than chunked."""

    status, type, reason = 400, "malformed_request", "malformed"

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class InvalidRequest(ServiceError):
    status, type, reason = 422, "invalid_request", "validation"


class ModelNotFound(ServiceError):
    status, type, reason = 404, "model_not_found", "validation"


class UnsupportedMediaType(ServiceError):
    status, type, reason = 415, "unsupported_media_type", "validation"


class RequestTimeout(ServiceError):
    """The client did not send its request (headers or body) in time."""

    status, type, reason = 408, "request_timeout", "request_timeout"


class TooLarge(ServiceError):
    """Over a limit of the server's: the message ends by naming the settings that raise it
    (`raised_by`), so that a user can ask for it and an operator find it."""

    status, type, reason = 413, "too_large", "too_large"

    def __init__(self, message: str, *settings: str):
        super().__init__(f"{message}; {raised_by(*settings)}" if settings else message)


def raised_by(*settings: str) -> str:
    """Where a limit is set: "the server's max_documents setting raises it (LONGDOC_MAX_DOCUMENTS
    or --max-documents)" (service/settings.py's fields; service/cli.py derives the flags)."""
    how = "; ".join(f"LONGDOC_{s.upper()} or --{s.replace('_', '-')}" for s in settings)
    if len(settings) == 1:
        return f"the server's {settings[0]} setting raises it ({how})"
    return f"the server's {' and '.join(settings)} settings raise it ({how})"


class Overloaded(ServiceError):
    status, type, reason = 429, "overloaded", "overloaded"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class RateLimited(ServiceError):
    """One API key over its request rate (service/access.py); Overloaded is the server's queue."""

    status, type, reason = 429, "rate_limited", "rate_limited"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class Unauthorized(ServiceError):
    status, type, reason = 401, "unauthorized", "unauthorized"

    def __init__(self, message: str):
        super().__init__(message, {"WWW-Authenticate": "Bearer"})


class Unavailable(ServiceError):
    status, type, reason = 503, "unavailable", "unavailable"


class ShuttingDown(Unavailable):
    """Refused, or not finished within the shutdown grace period: the service answers, never the
    HTTP server's plain-text 500."""

    type = "shutting_down"


class DeadlineExceeded(ServiceError):
    status, type, reason = 504, "deadline_exceeded", "timeout"


class Cancelled(ServiceError):
    """The client went away; nobody reads the answer (499 in logs, as nginx does)."""

    status, type, reason = 499, "cancelled", "cancelled"
