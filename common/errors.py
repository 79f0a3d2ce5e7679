"""Typed gateway errors and the one place that turns them into OpenAI-shaped HTTP answers."""

from __future__ import annotations

import enum

import msgspec


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    ENGINE_REJECTED = "engine_rejected"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    REQUEST_TOO_LARGE = "request_too_large"
    NO_WORKER = "no_worker_available"
    OVERLOADED = "overloaded"
    QUEUE_TIMEOUT = "queue_timeout"
    CLIENT_CONCURRENCY = "too_many_concurrent_requests"
    SHUTTING_DOWN = "shutting_down"
    UPSTREAM_CONNECT = "upstream_connect_error"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_PROTOCOL = "upstream_protocol_error"
    PREFILL_FAILED = "prefill_failed"
    KV_INTEGRITY = "kv_integrity_violation"
    REQUEST_QUARANTINED = "request_quarantined"
    ENGINE_DROPPED_REQUEST = "engine_dropped_request"
    UNPROVEN_TOKEN_IDS = "unproven_token_ids"
    REQUEST_EXCEEDS_DEADLINE = "request_exceeds_deadline"
    UNAUTHORIZED = "unauthorized"
    CONFLICT = "conflict"
    PROBE_FAILED = "worker_probe_failed"
    INTERNAL = "internal_error"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()


# the message a shutdown cancels the requests still running with (after the grace period):
# their outcome is "shutting_down", not "client_gone"
SHUTDOWN_CANCEL = "pd-gateway: shutting down"


def cancelled_outcome(e: BaseException, stalled: bool) -> str:
    """The outcome of a request whose handler was cancelled: the gateway's shutdown cut it
    (`SHUTDOWN_CANCEL`), or its client left, by going away ("client_gone") or by taking none of
    its answer for `timeouts.client_stall_s` (`stalled`: the server cut it, "client_stalled")."""
    if e.args[:1] == (SHUTDOWN_CANCEL,):
        return "shutting_down"
    return "client_stalled" if stalled else "client_gone"


class GatewayError(Exception):
    """An error the gateway answers itself. `retryable` errors may be retried on other workers.

    `message` is what the client is told, `detail` what the gateway's log says (the same text
    unless the error's own words may carry internals: worker addresses, an engine's answer;
    then the client gets a stable sentence and the request id, `body(request_id)`)."""

    status: int = 500
    code: ErrorCode = ErrorCode.INTERNAL
    type: str = "server_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: ErrorCode | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message if detail is None else detail)
        self.message = message
        self.detail = message if detail is None else detail
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def internal(self) -> bool:
        """Does the client get another text than the log (the detail may carry internals)?"""
        return self.detail != self.message

    def client_message(self, request_id: str | None = None) -> str:
        """The message a client gets: with the request id where the log holds more."""
        if request_id is not None and self.internal:
            return f"{self.message} (request id {request_id}; the gateway's log has the details)"
        return self.message

    def body(self, request_id: str | None = None) -> bytes:
        return error_body(self.client_message(request_id), self.type, self.code.value, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", b"application/json")]
        if self.retry_after_s is not None:
            h.append((b"retry-after", str(max(1, round(self.retry_after_s))).encode()))
        return h


class BadRequest(GatewayError):
    status = 400
    code = ErrorCode.INVALID_REQUEST
    type = "invalid_request_error"


class MethodNotAllowed(BadRequest):
    """405 with the `Allow` header HTTP asks for."""

    status = 405
    code = ErrorCode.METHOD_NOT_ALLOWED

    def __init__(self, method: str, allowed: str) -> None:
        super().__init__(f"method {method} not allowed here (use {allowed})")
        self.allowed = allowed

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"allow", self.allowed.encode())]


class UnsupportedMediaType(BadRequest):
    status = 415
    code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class NotFound(GatewayError):
    status = 404
    code = ErrorCode.NOT_FOUND
    type = "invalid_request_error"


class ModelNotFound(GatewayError):
    status = 404
    code = ErrorCode.MODEL_NOT_FOUND
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class NoWorker(GatewayError):
    status = 503
    code = ErrorCode.NO_WORKER
    type = "server_error"


class Overloaded(GatewayError):
    status = 429
    code = ErrorCode.OVERLOADED
    type = "rate_limit_error"


class Unauthorized(GatewayError):
    status = 401
    code = ErrorCode.UNAUTHORIZED
    type = "invalid_request_error"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"www-authenticate", b'Bearer realm="pd-gateway admin"')]


class Conflict(GatewayError):
    status = 409
    code = ErrorCode.CONFLICT
    type = "invalid_request_error"


class Unavailable(GatewayError):
    """The gateway sheds the request (queue full, queue timeout, shutting down): try again later."""

    status = 503
    code = ErrorCode.OVERLOADED
    type = "server_error"


class ShortOfResources(Unavailable):
    """The gateway cannot open another connection to a worker for want of its own resources
    (file descriptors, ephemeral ports): try again later. No worker is blamed for it. The
    client is told so in a stable sentence (`detail`, in the log, names the worker and the
    system's error)."""

    def __init__(self, detail: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(
            "the gateway is short of resources (open files or ports) to reach an engine; retry later",
            retry_after_s=retry_after_s,
            detail=detail,
        )


class UpstreamFailure(GatewayError):
    """An engine failed in a way that another worker may not (connect error, 5xx, timeout...).

    `message` as given is the log's `detail` (it names workers, quotes engines); the client
    gets `public` where the raiser gives one (naming no worker), else the stable sentence of its
    code and phase (`public_text`), with the request id."""

    status = 502
    code = ErrorCode.UPSTREAM_ERROR
    type = "server_error"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        worker: str | None = None,
        answered: bool = False,
        held: bool = False,
        dropped: bool = False,
        instead: GatewayError | None = None,
        public: str | None = None,
        **kw: object,
    ) -> None:
        code = kw.get("code")
        # `public`: what the client may read (no worker, no engine's words); else a stable sentence
        text = (
            public
            if public is not None
            else public_text(code if isinstance(code, ErrorCode) else self.code, phase)
        )
        super().__init__(text, detail=message, **kw)  # type: ignore[arg-type]
        self.phase = phase
        self.worker = worker
        self.answered = answered  # the engine itself answered with the failure: it is up
        # the engine took the request and failed it (a 5xx other than 503, an error event) or
        # broke its connection without an answer (`dropped`): it may have died of the request
        # (gateway/orchestration/quarantine.py)
        self.held = held or dropped
        self.dropped = dropped
        # what the client is told when no other attempt serves the request (e.g. an engine's
        # own refusal, which another route might not have made)
        self.instead = instead


class UpstreamTimeout(UpstreamFailure):
    status = 504
    code = ErrorCode.UPSTREAM_TIMEOUT


class PrefillFailed(UpstreamFailure):
    code = ErrorCode.PREFILL_FAILED


class KVIntegrityError(UpstreamFailure):
    code = ErrorCode.KV_INTEGRITY


class _EngineErrorDetail(msgspec.Struct):
    message: str
    type: str | None = None  # absent in SGLang's native answers ({"error": {"message": ...}})
    param: str | None = None
    code: str | int | None = None


class _EngineError(msgspec.Struct):
    """The shapes engines use: OpenAI's nested one (SGLang's /generate: the message alone),
    SGLang's flat one on its OpenAI routes, or vLLM's."""

    error: _EngineErrorDetail | str | None = None
    message: str | None = None
    type: str | None = None
    param: str | None = None
    code: str | int | None = None
    detail: str | None = None


class UpstreamRejected(GatewayError):
    """The engine answered 4xx: the request itself is at fault. Its message reaches the client,
    in OpenAI's error shape whatever shape the engine used (SGLang's OpenAI routes answer a flat
    `{"object": "error", "message": ...}`)."""

    retryable = False
    type = "invalid_request_error"
    code = ErrorCode.ENGINE_REJECTED

    def __init__(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        message, param, code = _engine_message(body)
        super().__init__(message, status=status, param=param)
        self.engine_code = code

    def body(self, request_id: str | None = None) -> bytes:
        return error_body(
            self.client_message(request_id),
            self.type,
            self.engine_code if self.engine_code is not None else self.status,
            self.param,
        )


def _engine_message(body: bytes) -> tuple[str, str | None, str | int | None]:
    try:
        e = msgspec.json.decode(body, type=_EngineError)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body.decode("utf-8", "replace").strip()[:2000]
        return text or "the engine rejected the request", None, None
    if isinstance(e.error, _EngineErrorDetail):
        return e.error.message, e.error.param, e.error.code
    msg = e.message or (e.error if isinstance(e.error, str) else None) or e.detail
    return msg or "the engine rejected the request", e.param, e.code


# What a client is told of a failure whose own words stay in the log (docs/operations.md, "What
# clients are told of failures"): one sentence per error code, the phase it happened in after it.
_PUBLIC_TEXT = {
    ErrorCode.UPSTREAM_ERROR: "an engine failed while serving the request",
    ErrorCode.UPSTREAM_TIMEOUT: "an engine did not answer in time",
    ErrorCode.UPSTREAM_CONNECT: "no engine could be reached",
    ErrorCode.UPSTREAM_PROTOCOL: "an engine broke its connection",
    ErrorCode.PREFILL_FAILED: "the prefill of the request failed",
    ErrorCode.KV_INTEGRITY: "the engines' answer failed a KV-integrity check and was withheld",
}


def public_text(code: ErrorCode, phase: str | None = None) -> str:
    """The stable sentence a client gets for a failure of `code` (in `phase`)."""
    text = _PUBLIC_TEXT.get(code, "the request failed")
    return text if phase is None else f"{text} (phase: {phase})"


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    return _encoder.encode(ErrorBody(ErrorDetail(message=message, type=type_, param=param, code=code)))


def sse_error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    """A final SSE event carrying an OpenAI-shaped error (what the openai client raises on)."""
    return b"data: " + error_body(message, type_, code) + b"\n\n"
