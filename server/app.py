"""The FastAPI application: OpenAI-compatible completions, index lookups, health, metrics and
the playground page. ``create_app`` takes a running Engine; ``teralm serve`` builds both."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from teralm.server.engine import Engine, Sampling, Sequence, TokenEvent
from teralm.server.protocol import (
    CompletionRequest,
    Limits,
    LookupRequest,
    completion_id,
    error_body,
    now,
)
from teralm.server.text import TextStream, token_text

log = logging.getLogger("teralm.server")
OPEN_PATHS = {"/health", "/"}  # the playground page is static; it sends the key itself


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # by status code
    latency_sum: float = 0.0
    latency_count: int = 0
    started: float = field(default_factory=time.time)


def create_app(
    engine: Engine, model_name: str, limits: Limits | None = None, api_key: str | None = None
) -> FastAPI:
    limits = limits or Limits()
    app = FastAPI(title="teralm", docs_url=None, redoc_url=None)
    metrics = Metrics()
    ix = engine.index
    byte_level = ix.manifest["tokenizer"] == "bytes"

    decode = ix.decode

    @app.middleware("http")
    async def guard(request: Request, call_next):
        began = time.perf_counter()
        if api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                response = JSONResponse(
                    error_body(
                        "missing or wrong API key (Authorization: Bearer KEY)",
                        "authentication_error",
                        code="invalid_api_key",
                    ),
                    401,
                )
                metrics.requests[401] += 1
                return response
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limits.max_body_bytes):
            metrics.requests[413] += 1
            return JSONResponse(error_body(f"request body over {limits.max_body_bytes} bytes"), 413)
        response = await call_next(request)
        metrics.requests[response.status_code] += 1
        metrics.latency_sum += time.perf_counter() - began
        metrics.latency_count += 1
        return response

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return JSONResponse(error_body(str(exc), param=exc.param), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(
            error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where),
            400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), exc.status_code)

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

    @app.get("/metrics")
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
            raise BadRequest("text too long", param="text")
        return await asyncio.to_thread(lookup, body.text, body.top_k, body.sources)

    def encode_prompt(prompt) -> list[int]:
        tokens = (
            [int(t) for t in prompt]
            if isinstance(prompt, list)
            else [int(t) for t in ix.encode(prompt)]
        )
        if any(not 0 <= t < ix.vocab_size for t in tokens):
            raise BadRequest(f"prompt tokens must lie in 0..{ix.vocab_size - 1}", param="prompt")
        if len(tokens) > limits.max_prompt_tokens:
            raise BadRequest(
                f"prompt of {len(tokens)} tokens; the limit is {limits.max_prompt_tokens}",
                param="prompt",
            )
        return tokens or [int(t) for t in ix.encode("\n")]  # an empty prompt starts a new line

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens > limits.max_tokens:
            raise BadRequest(f"max_tokens is at most {limits.max_tokens}", param="max_tokens")
        if body.n > limits.max_n:
            raise BadRequest(f"n is at most {limits.max_n}", param="n")
        if body.logprobs is not None and body.logprobs > limits.max_logprobs:
            raise BadRequest(f"logprobs is at most {limits.max_logprobs}", param="logprobs")
        if body.model not in (None, model_name):
            raise BadRequest(
                f"unknown model {body.model!r}; this server has {model_name!r}", 404, param="model"
            )
        prompts = [encode_prompt(p) for p in body.prompts()]
        if max_tokens == 0 and not body.echo:
            raise BadRequest("max_tokens 0 returns nothing without echo", param="max_tokens")
        choices = [
            Choice(i * body.n + j, p, body, max_tokens, decode, byte_level)
            for i, p in enumerate(prompts)
            for j in range(body.n)
        ]
        wake = Wakeup()
        for c in choices:
            c.start(engine, wake)
        cid, created = completion_id(), now()
        extra = {}
        if body.index:  # teralm's extra field: the index's view of the (first) prompt
            extra["index"] = await asyncio.to_thread(lookup, decode(prompts[0]), 5, 3)
        deadline = time.monotonic() + limits.timeout_s

        if body.stream:

            async def events():
                try:
                    while not all(c.finished for c in choices):
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or await request.is_disconnected():
                            break
                        await wake.wait(min(remaining, 0.5))
                        for c in choices:
                            for chunk in c.drain():
                                yield sse(
                                    {
                                        "id": cid,
                                        "object": "text_completion",
                                        "created": created,
                                        "model": model_name,
                                        "choices": [chunk],
                                    }
                                )
                    if extra:
                        yield sse(
                            {
                                "id": cid,
                                "object": "text_completion",
                                "created": created,
                                "model": model_name,
                                "choices": [],
                                **extra,
                            }
                        )
                    yield "data: [DONE]\n\n"
                finally:
                    for c in choices:
                        c.seq.cancel()

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            while not all(c.finished for c in choices):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BadRequest(f"generation took longer than {limits.timeout_s:.0f} s", 408)
                if await request.is_disconnected():
                    break
                await wake.wait(min(remaining, 0.5))
                for c in choices:
                    c.drain()
        finally:
            for c in choices:
                c.seq.cancel()
        if any(c.error for c in choices):
            raise BadRequest(next(c.error for c in choices if c.error), 500)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [c.result() for c in choices],
            "usage": usage(prompts, body.n, choices),
            **extra,
        }

    @app.get("/", response_class=HTMLResponse)
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
    """Set from the engine thread when any choice of a request has news."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def notify(self) -> None:  # any thread
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()


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
        self.seq: Sequence | None = None

    def start(self, engine: Engine, wake: Wakeup) -> None:
        def on_event(event: TokenEvent) -> None:  # the engine thread
            self.updates.append(event)
            wake.notify()

        self.seq = engine.submit(Sequence(self.prompt, self.sampling, on_event))

    def drain(self) -> list[dict]:
        """Turn queued engine events into stream chunks (and accumulate the full result)."""
        chunks = []
        while not self.finished and self.updates:
            event = self.updates.popleft()
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
                if finish.startswith("error"):
                    self.error = finish
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
