"""The FastAPI application: OpenAI-compatible completions, index lookups, health, metrics and
the playground page. ``create_app`` takes a running Engine; ``teralm serve`` builds both."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from teralm.server.engine import Engine, Sampling, Sequence, TokenEvent
from teralm.server.guard import Guard, RequestMetrics
from teralm.server.protocol import (
    CompletionRequest,
    ErrorResponse,
    Limits,
    LookupRequest,
    completion_id,
    error_body,
    now,
)
from teralm.server.text import TextStream, token_text

log = logging.getLogger("teralm.server")
ERRORS = {  # as the OpenAPI document shows them: any route may answer these
    "4XX": {"model": ErrorResponse, "description": "The request's fault"},
    "5XX": {"model": ErrorResponse, "description": "The server's fault"},
}
JSON_ERRORS = {  # for routes that answer text or HTML: their errors are JSON all the same
    code: {
        "description": spec["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for code, spec in ERRORS.items()
}
STREAMED = {
    200: {
        "description": "The completion, or with stream: server-sent events",
        "content": {"text/event-stream": {}},
    }
}


class ApiError(Exception):
    """An error answered with an OpenAI error object: the client's (4xx) or the server's (5xx)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.kind = "server_error" if status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param)


def create_app(
    engine: Engine, model_name: str, limits: Limits | None = None, api_key: str | None = None
) -> FastAPI:
    limits = limits or Limits()
    app = FastAPI(title="teralm", docs_url=None, redoc_url=None, responses=ERRORS)
    metrics = RequestMetrics()
    app.add_middleware(
        Guard, metrics=metrics, api_key=api_key, max_body_bytes=limits.max_body_bytes
    )
    ix = engine.index
    byte_level = ix.manifest["tokenizer"] == "bytes"

    decode = ix.decode

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        errors = exc.errors()  # a union's alternatives each add one: a value error says most
        first = next((e for e in errors if e["type"] == "value_error"), errors[0] if errors else {})
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON ({reason})"), 400)
        where = ".".join(str(p) for p in first.get("loc", ())[1:2]) or None  # the field
        return JSONResponse(
            error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where),
            400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(str(exc.detail), code=str(exc.status_code)),
            exc.status_code,
            headers=exc.headers,  # a 405's Allow
        )

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        log.error("internal error", exc_info=exc)
        return JSONResponse(error_body("internal error", "server_error"), 500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(metrics.started),
                    "owned_by": "teralm",
                }
            ],
        }

    @app.get("/metrics", response_class=PlainTextResponse, responses=JSON_ERRORS)
    async def prometheus():
        s = engine.stats
        lines = ["# TYPE teralm_requests_total counter"]
        lines += [
            f'teralm_requests_total{{code="{c}"}} {n}' for c, n in sorted(metrics.requests.items())
        ]
        lines += [
            "# TYPE teralm_request_seconds summary",
            f"teralm_request_seconds_sum {metrics.latency_sum:.6f}",
            f"teralm_request_seconds_count {metrics.latency_count}",
            "# TYPE teralm_generated_tokens_total counter",
            f"teralm_generated_tokens_total {s.tokens}",
            "# TYPE teralm_prompt_tokens_total counter",
            f"teralm_prompt_tokens_total {s.prompt_tokens}",
            "# TYPE teralm_model_seconds_total counter",
            f"teralm_model_seconds_total {s.model_s:.6f}",
            "# TYPE teralm_index_lookup_seconds_total counter",
            f"teralm_index_lookup_seconds_total {s.lookup_s:.6f}",
            "# TYPE teralm_tokens_per_second gauge",
            f"teralm_tokens_per_second {s.tokens / max(time.time() - metrics.started, 1e-9):.3f}",
            "# TYPE teralm_queue_depth gauge",
            f"teralm_queue_depth {engine.queue_depth}",
            "# TYPE teralm_active_sequences gauge",
            f"teralm_active_sequences {len(engine.active)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def lookup(text: str, top_k: int, sources: int) -> dict:
        context = ix.encode(text)
        match = ix.longest_match([context])
        length, count = int(match.length[0]), int(match.count[0])
        tokens, counts = ix.next_token_distribution([context], top_k=top_k)[0]
        return {
            "longest_match": {
                "length": length,
                "tokens": len(context),
                "count": count,
                "text": decode(list(context[len(context) - length :])) if length else "",
            },
            "continuations": [
                {
                    "token": int(t),
                    "text": token_text(decode, int(t), byte_level),
                    "count": int(c),
                    "probability": int(c) / count if count else 0.0,
                }
                for t, c in zip(tokens, counts)
            ],
            "sources": [
                {k: hit[k] for k in ("document", "source", "offset", "snippet")}
                for hit in (ix.documents(context, k=sources) if length and sources else [])
            ],
        }

    @app.post("/v1/lookup")
    async def lookup_endpoint(body: LookupRequest):
        if len(body.text) > limits.max_body_bytes:
            raise ApiError("text too long", param="text")
        return await asyncio.to_thread(lookup, body.text, body.top_k, body.sources)

    def encode_prompt(prompt) -> list[int]:
        tokens = (
            [int(t) for t in prompt]
            if isinstance(prompt, list)
            else [int(t) for t in ix.encode(prompt)]
        )
        if any(not 0 <= t < ix.vocab_size for t in tokens):
            raise ApiError(f"prompt tokens must lie in 0..{ix.vocab_size - 1}", param="prompt")
        if len(tokens) > limits.max_prompt_tokens:
            raise ApiError(
                f"prompt of {len(tokens)} tokens; the limit is {limits.max_prompt_tokens}",
                param="prompt",
            )
        return tokens or [int(t) for t in ix.encode("\n")]  # an empty prompt starts a new line

    @app.post("/v1/completions", responses=STREAMED)
    async def completions(body: CompletionRequest, request: Request):
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens > limits.max_tokens:
            raise ApiError(f"max_tokens is at most {limits.max_tokens}", param="max_tokens")
        if body.n > limits.max_n:
            raise ApiError(f"n is at most {limits.max_n}", param="n")
        asked = body.prompts()
        if len(asked) * body.n > limits.max_sequences:
            raise ApiError(
                f"{len(asked)} prompts × n {body.n} sequences; the limit is {limits.max_sequences}",
                param="prompt",
            )
        if body.logprobs is not None and body.logprobs > limits.max_logprobs:
            raise ApiError(f"logprobs is at most {limits.max_logprobs}", param="logprobs")
        if body.model not in (None, model_name):
            raise ApiError(
                f"unknown model {body.model!r}; this server has {model_name!r}", 404, param="model"
            )
        prompts = [encode_prompt(p) for p in asked]
        if max_tokens == 0 and not body.echo:
            raise ApiError("max_tokens 0 returns nothing without echo", param="max_tokens")
        wake = Wakeup()
        choices = [
            Choice(i * body.n + j, p, body, max_tokens, decode, byte_level, wake)
            for i, p in enumerate(prompts)
            for j in range(body.n)
        ]
        engine.submit([c.seq for c in choices])
        cid, created = completion_id(), now()
        extra = {}
        if body.index:  # teralm's extra field: the index's view of the (first) prompt
            extra["index"] = await asyncio.to_thread(lookup, decode(prompts[0]), 5, 3)
        progress = follow(choices, wake, request, limits.timeout_s)

        def envelope(**fields) -> dict:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                **fields,
            }

        if body.stream:

            async def events():
                try:
                    async for chunks in progress:
                        for chunk in chunks:
                            yield sse(envelope(choices=[chunk]))
                except ApiError as e:  # the status is sent already: an error event, as OpenAI's
                    yield sse(e.body())
                    return
                if extra:
                    yield sse(envelope(choices=[], **extra))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async for _ in progress:
            pass
        return envelope(
            choices=[c.result() for c in choices], usage=usage(prompts, body.n, choices), **extra
        )

    @app.get("/", response_class=HTMLResponse, responses=JSON_ERRORS)
    async def playground():
        return resources.files("teralm.server").joinpath("playground.html").read_text()

    return app


def usage(prompts: list[list[int]], n: int, choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in prompts) * n
    completion = sum(c.generated for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Wakeup:
    """Set when any choice of a request has news (from the engine thread), or the client left."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def notify(self) -> None:  # any thread
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()


async def cancel_on_hangup(request: Request, choices: list[Choice], wake: Wakeup) -> None:
    """Wait for the client to disconnect (its body is read already), then cancel the request's
    sequences."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for c in choices:
        c.seq.cancel()
    wake.notify()


async def follow(
    choices: list[Choice], wake: Wakeup, request: Request, timeout_s: float
) -> AsyncIterator[list[dict]]:
    """The choices' new chunks as the engine makes them, until all have finished or the client
    left. Raises ApiError when time runs out (408) or a generation failed (500); the sequences
    are cancelled however it ends."""
    deadline = time.monotonic() + timeout_s
    hangup = asyncio.create_task(cancel_on_hangup(request, choices, wake))
    try:
        while not (hangup.done() or all(c.finished for c in choices)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(f"generation took longer than {timeout_s:.0f} s", 408)
            await wake.wait(remaining)
            chunks = [chunk for c in choices for chunk in c.drain()]
            failure = next((c.error for c in choices if c.error), None)
            if failure:
                raise ApiError(f"generation failed: {failure}", 500)
            yield chunks
    finally:
        hangup.cancel()
        for c in choices:
            c.seq.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Choice:
    """One generated sequence of a request: events from the engine become text and logprobs."""

    def __init__(
        self,
        index: int,
        prompt: list[int],
        body: CompletionRequest,
        max_tokens: int,
        decode,
        byte_level: bool,
        wake: Wakeup,
    ):
        self.index, self.prompt, self.body = index, prompt, body
        self.decode, self.byte_level = decode, byte_level
        self.stream = TextStream(decode, body.stop, prefix=[] if body.echo else prompt)
        self.sampling = Sampling(
            max_tokens,
            body.temperature,
            body.top_p,
            body.top_k,
            body.logprobs,
            body.echo,
            body.seed if body.seed is None else body.seed + index,
        )
        self.updates: deque[TokenEvent] = deque()
        self.text, self.finished, self.finish_reason, self.error = "", False, None, None
        self.generated = 0
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.offset = 0

        def on_event(event: TokenEvent) -> None:  # the engine thread
            self.updates.append(event)
            wake.notify()

        self.seq = Sequence(prompt, self.sampling, on_event)

    def drain(self) -> list[dict]:
        """Turn queued engine events into stream chunks (and accumulate the full result). A
        failed sequence ends with ``error`` set, and no chunk."""
        chunks = []
        while not self.finished and self.updates:
            event = self.updates.popleft()
            if event.finish == "error":
                self.finished, self.error = True, event.error
                break
            delta = ""
            if event.token is not None:
                if not event.prompt:
                    self.generated += 1
                delta = self.stream.push(event.token)
                self._logprob(event)
            finish = event.finish
            if self.stream.stopped:
                finish = "stop"
                self.seq.cancel()
            if finish:
                delta += self.stream.finish()
                self.finished, self.finish_reason = True, "stop" if finish == "stop" else "length"
            self.text += delta
            chunk = {
                "index": self.index,
                "text": delta,
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
            if self.body.logprobs is not None and event.token is not None:
                chunk["logprobs"] = {k: v[-1:] for k, v in self.logprobs.items()}
            chunks.append(chunk)
        return chunks

    def _logprob(self, event: TokenEvent) -> None:
        if self.body.logprobs is None:
            return
        text = token_text(self.decode, event.token, self.byte_level)
        self.logprobs["tokens"].append(text)
        self.logprobs["token_logprobs"].append(event.logprob)
        self.logprobs["top_logprobs"].append(
            None
            if event.top is None
            else {token_text(self.decode, t, self.byte_level): lp for t, lp in event.top.items()}
        )
        self.logprobs["text_offset"].append(self.offset)
        self.offset += len(text)

    def result(self) -> dict:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": self.logprobs if self.body.logprobs is not None else None,
            "finish_reason": self.finish_reason or "length",
        }
