"""What stands in front of the routes: the API key (a FastAPI security dependency, so that the
OpenAPI document shows it), an ASGI middleware that holds bodies to their size limit and
counts every response for ``/metrics``, and uvicorn's HTTP protocol with a deadline for each
request's headers (``http_config``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

import uvicorn
from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Summary
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from teralm.server.protocol import ApiError, error_response

Bearer = Annotated[
    HTTPAuthorizationCredentials | None,
    Security(
        HTTPBearer(
            auto_error=False, description="The server's --api-key: `Authorization: Bearer KEY`"
        )
    ),
]


def api_key_check(api_key: str) -> Callable[..., Awaitable[None]]:
    """A dependency that answers 401 unless the request has ``Authorization: Bearer API_KEY``
    (the scheme in any case)."""

    async def check(credentials: Bearer) -> None:
        given = credentials.credentials.encode() if credentials else b""
        if not secrets.compare_digest(given, api_key.encode()):
            raise ApiError(
                "missing or wrong API key (Authorization: Bearer KEY)",
                401,
                kind="authentication_error",
                code="invalid_api_key",
            )

    return check


class RequestMetrics:
    """Responses by status code, and the time each took."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "teralm_requests", "Responses, by status code", ["code"], registry=registry
        )
        self.latency = Summary("teralm_request_seconds", "Time to respond", registry=registry)

    def record(self, status: int, seconds: float) -> None:
        self.requests.labels(code=str(status)).inc()
        self.latency.observe(seconds)


class BodyTooLarge(Exception):
    pass


CLIENT_LEFT = 499  # as nginx and vLLM count a request whose client hung up before its answer
access_log = logging.getLogger("teralm.access")  # a line per response, at INFO (teralm serve)


class Guard:
    """Answers 413 for a body over ``max_body_bytes``, counted as it arrives, so a chunked body
    is held to the limit too; otherwise hands the app the body it read. Counts every response,
    as ``CLIENT_LEFT`` when the client hung up before its response was whole, and logs it to
    ``access_log`` (with the tokens of the completion job the route left in the request's
    state, if any)."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, status, whole, left = time.perf_counter(), None, False, False

        async def send_counted(message: Message) -> None:
            nonlocal status, whole
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                whole = True
            await send(message)

        async def receive_watched() -> Message:
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not whole)
            return message

        try:
            await self._serve(scope, receive_watched, send_counted)
        except Exception:
            status = 500  # the app's exception handler answers outside this middleware
            raise
        finally:
            if left or status is not None:
                status = CLIENT_LEFT if left else status
                self.metrics.record(status, time.perf_counter() - began)
                _log_access(scope, status, time.perf_counter() - began)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._read_body(scope, receive)
        except BodyTooLarge:
            refusal = error_response(f"request body over {self.max_body_bytes} bytes")
            return await JSONResponse(refusal.model_dump(), 413)(scope, receive, send)
        if body is not None:  # None: the client left while sending it
            await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body (None if the client left first); raises ``BodyTooLarge`` as soon as
        it is known to be over the limit."""
        size = dict(scope["headers"]).get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body_bytes):
            raise BodyTooLarge
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_body_bytes:
                raise BodyTooLarge
            if not message.get("more_body", False):
                return b"".join(chunks)


def _log_access(scope: Scope, status: int, seconds: float) -> None:
    """``client "METHOD path" status [prompt P completion C] seconds`` at INFO."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    job = scope.get("state", {}).get("job")
    tokens = ""
    if job is not None:
        usage = job.usage()
        tokens = f" prompt {usage.prompt_tokens} completion {usage.completion_tokens}"
    host = (scope.get("client") or ("-",))[0]
    method, path = scope["method"], scope["path"]
    access_log.info('%s "%s %s" %d%s %.3f s', host, method, path, status, tokens, seconds)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, then the connection's own messages (its
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again() -> Message:
        return pending.pop() if pending else await receive()

    return receive_again


HEADER_TIMEOUT_S = 10.0  # for a request's headers, from the connection or the last response
KEEP_ALIVE_S = 5.0  # an idle connection after a response (uvicorn's own timer)


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not all in
    ``header_timeout`` seconds after it opened or after its last response: an idle socket, or
    one that sends its headers a byte at a time, is not kept open for as long as it likes."""

    header_timeout = HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


def http_config(
    app: ASGIApp, host: str, port: int, header_timeout: float = HEADER_TIMEOUT_S
) -> uvicorn.Config:
    """The uvicorn server settings of ``teralm serve``: h11 with header deadlines, a short
    keep-alive, warnings only."""
    protocol = type("Deadline", (HeaderDeadline,), {"header_timeout": header_timeout})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
    )
