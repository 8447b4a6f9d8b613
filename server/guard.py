"""The ASGI middleware in front of every route: the API key, the body-size limit, and the request
counts that ``/metrics`` reports."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from teralm.server.protocol import error_body

OPEN_PATHS = {"/health", "/"}  # the playground page is static; it sends the key itself


class BodyTooLarge(Exception):
    pass


@dataclass
class RequestMetrics:
    requests: Counter = field(default_factory=Counter)  # by status code
    latency_sum: float = 0.0
    latency_count: int = 0
    started: float = field(default_factory=time.time)

    def record(self, status: int, seconds: float) -> None:
        self.requests[status] += 1
        self.latency_sum += seconds
        self.latency_count += 1


class Guard:
    """Answers 401 without the API key (``Authorization: Bearer KEY``, the scheme in any case)
    and 413 for a body over ``max_body_bytes``, counted as it arrives, so a chunked body is held
    to the limit too; otherwise hands the app the body it read. Counts every response."""

    def __init__(
        self, app: ASGIApp, metrics: RequestMetrics, api_key: str | None, max_body_bytes: int
    ):
        self.app, self.metrics = app, metrics
        self.api_key, self.max_body_bytes = api_key, max_body_bytes

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
        if not self._authorised(scope):
            refusal = error_body(
                "missing or wrong API key (Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
            )
            return await JSONResponse(refusal, 401)(scope, receive, send)
        try:
            body = await self._read_body(scope, receive)
        except BodyTooLarge:
            refusal = error_body(f"request body over {self.max_body_bytes} bytes")
            return await JSONResponse(refusal, 413)(scope, receive, send)
        if body is not None:  # None: the client left while sending it
            await self.app(scope, _replay(body, receive), send)

    def _authorised(self, scope: Scope) -> bool:
        if not self.api_key or scope["path"] in OPEN_PATHS:
            return True
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(
            key.strip(), self.api_key.encode()
        )

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
