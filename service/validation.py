"""Request bodies (pydantic, what OpenAPI shows) and their validation into typed, frozen values.
After `validate_*` nothing downstream re-checks user input."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, WithJsonSchema, model_validator
from pydantic.json_schema import SkipJsonSchema

from longdoc.service.errors import InvalidRequest, TooLarge

# outside strings: the start of a string, or a separator; inside: up to the closing quote
_JSON_TOKEN = re.compile(rb'[",:\[{]')
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)


def scan_json_tokens(body: bytes, limit: int, chunk: int = 1 << 18):
    """Before any parse: raise TooLarge past `limit` JSON strings and separators. A request of
    this API has a few dozen; a body of 500k keys has a million, and costs seconds to parse and
    validate. A generator that yields after each `chunk` bytes scanned (linear, in C regex calls),
    so that an async caller can let the event loop run between chunks of a 32 MB body."""
    n, pos, end = 0, 0, len(body)
    while pos < end:
        stop = min(end, pos + chunk)
        m = _JSON_TOKEN.search(body, pos, stop)
        if m is None:
            pos = stop
            yield
            continue
        n += 1
        if n > limit:
            raise TooLarge(f"request body has over {limit} JSON strings and separators; "
                           f"this API's requests need far fewer: a few per document", "max_documents")
        pos = m.end()
        if m.group() != b'"':
            continue
        while pos < end:  # inside a string, one chunk at a time
            pos = _STRING_BODY.match(body, pos, min(end, pos + chunk)).end()
            if body[pos : pos + 1] == b'"':
                pos += 1
                break
            if body[pos : pos + 1] == b"\\":  # an escape cut by the chunk's end
                pos += 2
            yield

MIN_TIMEOUT_S = 0.001  # a deadline shorter than this cannot be met (the body or X-Request-Timeout)
_ALLOWED_CONTROLS = "\t\n\r"
_CONTROLS = "".join(chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in _ALLOWED_CONTROLS)
# Text made only of these is blank (422, like whitespace): whitespace and the invisible format
# characters (zero-width space/joiners, word joiner, BOM, bidi marks), which tokenize to nothing.
_INVISIBLE = "\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e" \
             "\u2060\u2061\u2062\u2063\u2064\u2066\u2067\u2068\u2069\ufeff"
_BLANK = frozenset(ch for ch in map(chr, range(0x3001)) if ch.isspace()) | frozenset(_INVISIBLE)


def _char_class(chars) -> str:
    """Characters -> the body of a regex character class, in ranges: `\\u0000-\\u0008...`."""
    points, out = sorted(map(ord, chars)), []
    for p in points:
        if out and out[-1][1] == p - 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in out)


# Unicode category Cc (C0 and C1 controls) but tab, newline and carriage return (_CONTROLS). The
# regex finds the first one (the error names its offset); before it, `_may_have_control` looks at
# the UTF-8 bytes with NumPy compares (check_text on a 4096-token document: 25 against 214 us with
# the regex alone), so text without controls, nearly all of it, never meets the regex.
_CONTROL = re.compile(f"[{_char_class(_CONTROLS)}]")
_C0 = np.array(sorted(ord(c) for c in _CONTROLS if ord(c) < 0x20), np.uint8)  # 0x00-0x1f but \t \n \r
_C1 = np.zeros(256, bool)  # U+0080-U+009F in UTF-8: the lead byte 0xC2, then the code point's own byte
_C1[[ord(c) for c in _CONTROLS if ord(c) >= 0x80]] = True
assert {ord(c) for c in _CONTROLS} == {*_C0.tolist(), 0x7F, *np.flatnonzero(_C1).tolist()}


def _may_have_control(encoded: bytes) -> bool:
    """Whether the UTF-8 `encoded` holds a character of _CONTROLS: C0 bytes but tab, newline and
    CR, 0x7F, and the two-byte sequences 0xC2 0x80-0x9F (0xC2 is only ever a lead byte)."""
    a = np.frombuffer(encoded, np.uint8)
    low = a < 0x20
    if low.any() and np.isin(a[low], _C0).any():
        return True
    if b"\x7f" in encoded:
        return True
    lead = np.flatnonzero(a[:-1] == 0xC2)
    return bool(_C1[a[lead + 1]].any())


# check_text's rules as a JSON-schema pattern (the max size is in bytes, which a schema cannot
# say; `maxLength` is set to it in characters by the app): no control characters but tab, newline
# and CR, and at least one character that is not blank
TEXT_PATTERN = (f"^[^{_char_class(_CONTROLS)}]*[^{_char_class(set(_CONTROLS) | _BLANK)}]"
                f"[^{_char_class(_CONTROLS)}]*$")
Text = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1, "pattern": TEXT_PATTERN})]
_NOT_BLANK = re.compile(f"[^{_char_class(_BLANK)}]")


class _Strict(BaseModel):
    """No unknown keys; numbers are JSON numbers (`_json_numbers`)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data):
        """Numbers must be JSON numbers: `true` and "1" are not (lax pydantic would convert them),
        while 2.0 is an integer, as JSON Schema says (strict pydantic would refuse it)."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is not None and isinstance(value, (bool, str)) and \
                        {int, float} & {field.annotation, *get_args(field.annotation)}:
                    raise ValueError(f"{name}: expected a number, got {json.dumps(value)}")
        return data



class _Body(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "oneOf": [{"required": ["document"]}, {"required": ["documents"]}]})

    # exactly one of the two, and never null (SkipJsonSchema: the schema shows no null)
    document: Text | SkipJsonSchema[None] = Field(None, description="One document; or give `documents`.")
    documents: Annotated[list[Text], Field(min_length=1)] | SkipJsonSchema[None] = Field(
        None, description="Several documents (at most the server's `max_documents`).")
    model: str | None = Field(None, description="A loaded model's name; default: the task's first model.")
    timeout: float | None = Field(None, ge=MIN_TIMEOUT_S, allow_inf_nan=False,
                                  description="Deadline in seconds (or header X-Request-Timeout).")

    @model_validator(mode="after")
    def _one_of(self):
        given = [name for name in ("document", "documents") if name in self.model_fields_set]
        if len(given) != 1:
            raise ValueError("give exactly one of `document` or `documents`")
        if getattr(self, given[0]) is None:
            raise ValueError(f"`{given[0]}` must not be null")
        return self


class QARequest(_Body):
    question: Text = Field(..., description="The question, answered from each document.")
    top_k: int = Field(1, ge=1, le=20)
    max_answer_tokens: int = Field(30, ge=1, le=512)


class SummarizeRequest(_Body):
    model_config = ConfigDict(json_schema_extra={  # with stream: true, one document
        **_Body.model_config["json_schema_extra"],
        "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        "then": {"properties": {"documents": {"maxItems": 1}}}})

    max_new_tokens: int | None = Field(None, ge=1, le=4096, description="Default: 128, capped by the model.")
    # unset: the model's generation default (its checkpoint's), else transformers' (1, 1.0, 0)
    num_beams: int | None = Field(None, ge=1, le=8, description="Default: the model's, else 1.")
    length_penalty: float | None = Field(None, ge=-10.0, le=10.0, allow_inf_nan=False,
                                         description="Default: the model's, else 1.0.")
    no_repeat_ngram_size: int | None = Field(None, ge=0, le=16, description="Default: the model's, else 0.")
    stream: StrictBool = Field(False, description="Server-sent events: `token` events (a piece of text and its "
                                                  "tokens' ids), then `done`.")


class ClassifyRequest(_Body):
    top_k: int | None = Field(None, ge=1, le=1000, description="Default: every label.")


class EmbeddingsRequest(_Strict):
    """OpenAI's embeddings request (`POST /v1/embeddings`)."""

    input: Text | Annotated[list[Text], Field(min_length=1)] = Field(
        ..., description="A text, or a list of texts (at most the server's `max_documents`); each embedded whole.")
    model: str | None = Field(None, description="A loaded embed model's name; default: the default embedding model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's float32 little-endian bytes in base64.")
    dimensions: int | None = Field(None, ge=1, description="If given, the model's dimensions (vectors are not cut).")
    user: str | None = Field(None, description="Accepted for OpenAI compatibility; not used.")
    truncate: StrictBool = Field(False, description="Embed only each text's first window (the model's length); "
                                                    "default: every window, pooled into one vector.")
    timeout: float | None = Field(None, ge=MIN_TIMEOUT_S, allow_inf_nan=False,
                                  description="Deadline in seconds (or header X-Request-Timeout).")


class EmbedRequest(_Strict):
    """text-embeddings-inference's embed request (`POST /embed`)."""

    inputs: Text | Annotated[list[Text], Field(min_length=1)] = Field(
        ..., description="A text, or a list of texts (at most the server's `max_documents`); each embedded whole.")
    normalize: StrictBool = Field(True, description="Unit-length vectors.")
    truncate: StrictBool = Field(False, description="Embed only each text's first window; default: every window, "
                                                    "pooled into one vector.")
    model: str | None = Field(None, description="A loaded embed model's name; default: the default embedding model.")
    timeout: float | None = Field(None, ge=MIN_TIMEOUT_S, allow_inf_nan=False,
                                  description="Deadline in seconds (or header X-Request-Timeout).")


# responses
class QAAnswer(BaseModel):
    text: str
    start: int = Field(description="character offset into the document")
    end: int
    score: float = Field(description="start logit + end logit")


class Usage(BaseModel):
    tokens: int
    windows: int
    truncated: bool = False


class QAResult(BaseModel):
    answers: list[QAAnswer]
    usage: Usage


class QAResponse(BaseModel):
    model: str
    results: list[QAResult]


class SummaryResult(BaseModel):
    summary: str
    usage: Usage
    generated_tokens: int


class SummarizeResponse(BaseModel):
    model: str
    results: list[SummaryResult]


class LabelScore(BaseModel):
    label: str
    score: float


class ClassifyResult(BaseModel):
    labels: list[LabelScore]
    usage: Usage


class ClassifyResponse(BaseModel):
    model: str
    results: list[ClassifyResult]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the vector; a base64 string with encoding_format base64")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int = Field(description="every token embedded (all windows; the first with truncate)")
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


class ModelCard(BaseModel):
    name: str
    task: str
    default: bool
    max_length: int
    block_size: int
    plan: str
    dtype: str
    labels: list[str] | None
    devices: list[str]


class ModelsResponse(BaseModel):
    models: list[ModelCard]


# summarize with `stream: true`: one server-sent event (OpenAPI 3.1 reads the `schema` of
# text/event-stream as one event). `data` is JSON: `token` {"ids", "text"}, `done` a
# SummarizeResponse, `error` an ErrorResponse.
SSE_EVENT_SCHEMA = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"enum": ["token", "done", "error"]},
    "data": {"type": "string", "contentMediaType": "application/json"}}}


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


# typed, frozen values
@dataclass(frozen=True)
class Limits:
    max_document_bytes: int
    max_documents: int
    default_timeout_s: float
    max_timeout_s: float


@dataclass(frozen=True)
class Common:
    model: str | None
    documents: tuple[str, ...]
    deadline: float  # time.monotonic() clock


@dataclass(frozen=True)
class QAJob:
    common: Common
    question: str
    top_k: int
    max_answer_tokens: int


@dataclass(frozen=True)
class SummarizeJob:
    common: Common
    max_new_tokens: int | None
    num_beams: int | None  # None: the model's default
    length_penalty: float | None
    no_repeat_ngram_size: int | None
    stream: bool


@dataclass(frozen=True)
class ClassifyJob:
    common: Common
    top_k: int | None


@dataclass(frozen=True)
class EmbedJob:
    common: Common
    truncate: bool  # the first window only
    normalize: bool | None  # None: as the model's sentence-transformers config says
    base64: bool  # OpenAI's encoding_format "base64"
    dimensions: int | None  # OpenAI's: must be the model's


def check_text(text: str, what: str, max_bytes: int) -> str:
    """Non-empty, valid Unicode (no lone surrogates), no control characters, within max_bytes."""
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{what} is not valid UTF-8 (lone surrogate)") from None
    if len(encoded) > max_bytes:
        raise TooLarge(f"{what} is {len(encoded)} bytes; the limit is {max_bytes} bytes", "max_document_bytes")
    if not _NOT_BLANK.search(text):  # one regex search in C, not a Python loop over a 2 MB text
        raise InvalidRequest(f"{what} is empty or only whitespace or invisible characters")
    if _may_have_control(encoded) and (bad := _CONTROL.search(text)):
        raise InvalidRequest(f"{what} contains control character U+{ord(bad.group()):04X} at offset {bad.start()}")
    return text


def _common(body: _Body, header_timeout: str | None, limits: Limits, arrived: float | None) -> Common:
    docs = [body.document] if body.document is not None else list(body.documents or [])
    return _texts(docs, "document" if body.document is not None else "documents", body.document is not None,
                  body.model, body.timeout, header_timeout, limits, arrived)


def _texts(docs: list[str], field: str, single: bool, model: str | None, timeout: float | None,
           header_timeout: str | None, limits: Limits, arrived: float | None) -> Common:
    """The request's texts checked (`field` names them in errors: "document" when `single`, else
    "documents[3]"), and its deadline."""
    if len(docs) > limits.max_documents:
        raise TooLarge(f"{len(docs)} documents; the limit is {limits.max_documents} per request", "max_documents")
    for i, d in enumerate(docs):
        check_text(d, field if single else f"{field}[{i}]", limits.max_document_bytes)
    if timeout is None and header_timeout is not None:
        accepted = (f"X-Request-Timeout {header_timeout!r}: give a number of seconds from {MIN_TIMEOUT_S:g} to "
                    f"{limits.max_timeout_s:g} (the server's max_request_timeout_s)")
        try:
            timeout = float(header_timeout)
        except ValueError:
            raise InvalidRequest(accepted) from None
        if not math.isfinite(timeout) or timeout < MIN_TIMEOUT_S:  # inf and nan are no deadline
            raise InvalidRequest(accepted)
    if timeout is None:
        timeout = limits.default_timeout_s
    if timeout > limits.max_timeout_s:
        raise InvalidRequest(f"timeout {timeout:g} s exceeds the server's maximum of {limits.max_timeout_s:g} s "
                             f"(its max_request_timeout_s)")
    # the deadline counts from the request's arrival, as its client's clock does (not from here,
    # after the body was read and parsed)
    return Common(model, tuple(docs), (time.monotonic() if arrived is None else arrived) + timeout)


def validate_qa(body: QARequest, header_timeout: str | None, limits: Limits,
                   arrived: float | None = None) -> QAJob:
    common = _common(body, header_timeout, limits, arrived)
    question = check_text(body.question, "question", limits.max_document_bytes)
    return QAJob(common, question.strip(), body.top_k, body.max_answer_tokens)


def validate_summarize(body: SummarizeRequest, header_timeout: str | None, limits: Limits,
                   arrived: float | None = None) -> SummarizeJob:
    if body.stream and body.documents is not None and len(body.documents) > 1:
        raise InvalidRequest("stream: true takes a single document")
    common = _common(body, header_timeout, limits, arrived)
    return SummarizeJob(common, body.max_new_tokens, body.num_beams, body.length_penalty,
                        body.no_repeat_ngram_size, body.stream)


def summarize_search(job: SummarizeJob, info):
    """The request's search settings over the model's generation defaults (what OnnxModel.generate
    uses), its new tokens checked against the model's cap (`info`: the model's ModelInfo): the
    one check of a summarize request that needs the model, here with the others."""
    from longdoc.model.search import resolve_settings

    max_new = job.max_new_tokens or min(128, info.max_new_tokens)
    if max_new > info.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens {max_new} exceeds this model's {info.max_new_tokens}")
    return resolve_settings(info.generation, max_new_tokens=max_new, num_beams=job.num_beams,
                            length_penalty=job.length_penalty, no_repeat_ngram_size=job.no_repeat_ngram_size)


def validate_classify(body: ClassifyRequest, header_timeout: str | None, limits: Limits,
                   arrived: float | None = None) -> ClassifyJob:
    return ClassifyJob(_common(body, header_timeout, limits, arrived), body.top_k)


def validate_embeddings(body: EmbeddingsRequest, header_timeout: str | None, limits: Limits,
                        arrived: float | None = None) -> EmbedJob:
    one = isinstance(body.input, str)
    common = _texts([body.input] if one else list(body.input), "input", one, body.model, body.timeout,
                    header_timeout, limits, arrived)
    return EmbedJob(common, body.truncate, None, body.encoding_format == "base64", body.dimensions)


def validate_embed(body: EmbedRequest, header_timeout: str | None, limits: Limits,
                   arrived: float | None = None) -> EmbedJob:
    one = isinstance(body.inputs, str)
    common = _texts([body.inputs] if one else list(body.inputs), "inputs", one, body.model, body.timeout,
                    header_timeout, limits, arrived)
    return EmbedJob(common, body.truncate, body.normalize, False, None)
