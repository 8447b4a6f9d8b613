"""What stands in front of the routes: the API key (a FastAPI security dependency, so that the
OpenAPI document shows it), and an ASGI middleware that holds bodies to their size limit and
counts every response for ``/metrics``."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter, Summary
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class Guard:
    """Answers 413 for a body over ``max_body_bytes``, counted as it arrives, so a chunked body
    is held to the limit too; otherwise hands the app the body it read. Counts every response."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, status = time.perf_counter(), None

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, send_counted)
        except Exception:
            status = 500  # the app's exception handler answers outside this middleware
            raise
        finally:
            if status is not None:  # None: the client left before a response
                self.metrics.record(status, time.perf_counter() - began)

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


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, then the connection's own messages (its
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again() -> Message:
        return pending.pop() if pending else await receive()

    return receive_again
