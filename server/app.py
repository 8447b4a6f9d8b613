"""The FastAPI application: OpenAI-compatible completions, vLLM-style tokenizer routes, index
lookups, health, Prometheus metrics and the playground page.

``CompletionService`` does the work over one running Engine; the routes only hand it their
request. ``create_app`` puts the two together; ``teralm serve`` builds the Engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from teralm.infer.engine import Engine, Sequence, TokenEvent, TokenIndex
from teralm.infer.sampling import Sampling
from teralm.infer.text import TextStream, token_bytes, token_texts
from teralm.server.guard import Guard, RequestMetrics, api_key_check
from teralm.server.protocol import (
    ApiError,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    Continuation,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    Limits,
    Logprobs,
    LongestMatch,
    LookupRequest,
    LookupResponse,
    ModelCard,
    ModelList,
    Neighbour,
    NeighbourDocument,
    Proposal,
    Source,
    TokenIndexView,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    Usage,
    completion_id,
    error_response,
    now,
)

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
        "description": "The completion, or with stream: server-sent events of CompletionChunk",
        "content": {"text/event-stream": {}},
    }
}


class Wakeup:
    """Set when any choice of a request has news (from the engine thread), or the client left."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self._pending = False  # a set is queued on the loop: more news rides along with it

    def notify(self) -> None:  # any thread
        if not self._pending:
            self._pending = True
            self.loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        self._pending = False
        self.event.set()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()


class Choice:
    """One generated sequence of a request: events from the engine become text and logprobs."""

    def __init__(
        self,
        index: int,
        prompt: list[int],
        body: CompletionRequest,
        max_tokens: int,
        service: CompletionService,
        wake: Wakeup,
    ):
        self.index, self.texts, self.prompt_tokens = index, service.texts, len(prompt)
        self.stream = TextStream(service.pieces, body.stop, prefix=() if body.echo else prompt)
        seed = body.seed if body.seed is None else body.seed + index
        sampling = Sampling(
            max_tokens,
            body.temperature,
            body.top_p,
            body.top_k,
            body.logprobs,
            body.echo,
            seed,
            body.token_bias(),
            index_view=body.index == "tokens",
        )
        self.service = service
        self.index_tokens: list[TokenIndexView] | None = [] if sampling.index_view else None
        self.updates: deque[TokenEvent] = deque()
        self.parts: list[str] = []  # the text, piece by piece
        self.finished, self.finish_reason, self.error = False, None, None
        self.generated, self.offset = 0, 0
        self.logprobs = Logprobs() if body.logprobs is not None else None
        # a streamed choice has news at every token; a whole one only when a stop string may
        # end it early, or at its end
        self.streamed = body.stream
        eager = body.stream or bool(body.stop)

        def on_event(event: TokenEvent) -> None:  # the engine thread
            self.updates.append(event)
            if eager or event.finish:
                wake.notify()

        self.seq = Sequence(prompt, sampling, on_event)

    def drain(self) -> list[CompletionChoice]:
        """Turn queued engine events into stream chunks, when streamed, and accumulate the full
        result. A failed sequence ends with ``error`` set, and no chunk."""
        chunks = []
        while not self.finished and self.updates:
            event = self.updates.popleft()
            if event.finish == "error":
                self.finished, self.error = True, event.error
                break
            delta, logprobs, views = "", None, None
            if event.token is not None:
                self.generated += not event.prompt
                delta = self.stream.push(event.token, event.prompt)
                logprobs = self._logprob(event)
            if event.index is not None and self.index_tokens is not None:
                views = [self.service.token_view(event.token, event.index)]
                self.index_tokens += views
            if self.stream.stopped:
                self.seq.cancel()
            if event.finish or self.stream.stopped:
                delta += self.stream.finish()
                self.finished = True
                self.finish_reason = "stop" if self.stream.stopped else "length"
            self.parts.append(delta)
            if self.streamed:
                chunks.append(
                    CompletionChoice(
                        index=self.index,
                        text=delta,
                        logprobs=logprobs,
                        finish_reason=self.finish_reason,
                        index_tokens=views,
                    )
                )
        return chunks

    def _logprob(self, event: TokenEvent) -> Logprobs | None:
        """Add the token to the logprobs; its own entry, for its chunk."""
        if self.logprobs is None:
            return None
        text = self.texts[event.token]
        top = None if event.top is None else {self.texts[t]: lp for t, lp in event.top.items()}
        entry = Logprobs(
            tokens=[text],
            token_logprobs=[event.logprob],
            top_logprobs=[top],
            text_offset=[self.offset],
        )
        for field in Logprobs.model_fields:
            getattr(self.logprobs, field).extend(getattr(entry, field))
        self.offset += len(text)
        return entry

    def result(self) -> CompletionChoice:
        return CompletionChoice(
            index=self.index,
            text="".join(self.parts),
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "length",
            index_tokens=self.index_tokens,
        )


class Job:
    """One accepted completion request: its choices in the engine, followed until they end."""

    def __init__(
        self,
        model: str,
        choices: list[Choice],
        wake: Wakeup,
        index: LookupResponse | None,
        include_usage: bool = False,
    ):
        self.envelope = {"id": completion_id(), "created": now(), "model": model, "index": index}
        self.choices, self.wake = choices, wake
        self.include_usage = include_usage  # stream a last chunk with the usage

    def usage(self) -> Usage:
        prompt = sum(c.prompt_tokens for c in self.choices)
        completion = sum(c.generated for c in self.choices)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def follow(self, request: Request, timeout_s: float) -> AsyncIterator[list]:
        """The choices' new chunks as the engine makes them, until all have finished or the
        client left. Raises ApiError when time runs out (408) or a generation failed (500); the
        sequences are cancelled however it ends."""
        deadline = time.monotonic() + timeout_s
        hangup = asyncio.create_task(self._cancel_on_hangup(request))
        try:
            while not (hangup.done() or all(c.finished for c in self.choices)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ApiError(f"generation took longer than {timeout_s:.0f} s", 408)
                await self.wake.wait(remaining)
                chunks = [chunk for c in self.choices for chunk in c.drain()]
                failure = next((c.error for c in self.choices if c.error), None)
                if failure:
                    raise ApiError(f"generation failed: {failure}", 500)
                yield chunks
        finally:
            hangup.cancel()
            self.cancel()

    async def _cancel_on_hangup(self, request: Request) -> None:
        """Wait for the client to disconnect (its body is read already), then cancel."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancel()
        self.wake.notify()

    def cancel(self) -> None:
        for c in self.choices:
            c.seq.cancel()


class CompletionService:
    """Completions and tokenizer answers over one Engine and its index: checks each request
    against the limits, queues its sequences and follows them, whole (``collect``) or as they
    come (``stream``)."""

    def __init__(self, engine: Engine, model_name: str, limits: Limits):
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.ix = engine.index
        self.pieces = token_bytes(self.ix.tokenizer)  # every token's bytes and text, once
        self.texts = token_texts(self.pieces)
        self.line_start = [int(t) for t in self.ix.encode("\n")]  # what an empty prompt holds
        self.started = now()

    def check_model(self, model: str | None) -> None:
        if model not in (None, self.model_name):
            raise ApiError(
                f"unknown model {model!r}; this server has {self.model_name!r}", 404, "model"
            )

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.started)])

    def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo(
            tokenizer=self.ix.tokenizer.name,
            vocab_size=self.ix.vocab_size,
            model_max_length=self.limits.max_prompt_tokens,
        )

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        tokens = [int(t) for t in self.ix.encode(body.prompt)]
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=self.limits.max_prompt_tokens
        )

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        self._check_tokens(body.tokens, "tokens", "tokens")
        return DetokenizeResponse(prompt=self.ix.decode(body.tokens))

    def _check_tokens(self, tokens: list[int], param: str, what: str) -> None:
        if any(not 0 <= t < self.ix.vocab_size for t in tokens):
            raise ApiError(f"{what} must lie in 0..{self.ix.vocab_size - 1}", param=param)

    def lookup(self, text: str, top_k: int = 5, sources: int = 3) -> LookupResponse:
        """The index's longest match of ``text``, its continuations and their sources, from
        one search."""
        if len(text) > self.limits.max_body_bytes:
            raise ApiError("text too long", param="text")
        return self.lookup_tokens([int(t) for t in self.ix.encode(text)], top_k, sources)

    def token_view(self, token: int, index: TokenIndex) -> TokenIndexView:
        """The API's record of what the index did for a generated token (its 3 nearest kNN
        neighbours' documents)."""
        neighbours = None
        if self.engine.knn is not None:
            neighbours = []
            for position, distance in index.neighbours[:3]:
                doc = int(np.searchsorted(self.ix.offsets, position, side="right")) - 1
                source = self.ix.document_source(doc)
                neighbours.append(NeighbourDocument(document=doc, source=source, distance=distance))
        proposed = index.proposed
        return TokenIndexView(
            token=token,
            text=self.texts[token],
            match_length=index.match_length,
            proposed=None
            if proposed is None
            else Proposal(token=proposed, text=self.texts[proposed]),
            infgram_probability=index.infgram_prob,
            infgram_count=index.infgram_count,
            gate=index.gate,
            neighbours=neighbours,
        )

    def lookup_tokens(self, context: list[int], top_k: int = 5, sources: int = 3) -> LookupResponse:
        """``lookup`` of tokens as given (a token-id prompt is not decoded and encoded again)."""
        found = self.ix.query.lookup(context, top_k=top_k, sources=sources)
        matched = context[len(context) - found.length :] if found.length else []
        return LookupResponse(
            longest_match=LongestMatch(
                length=found.length,
                tokens=len(context),
                count=found.count,
                text=self.ix.decode(list(matched)),
            ),
            continuations=[
                Continuation(
                    token=int(t),
                    text=self.texts[int(t)],
                    count=int(c),
                    probability=int(c) / found.count if found.count else 0.0,
                )
                for t, c in zip(found.tokens, found.counts)
            ],
            sources=[Source(**hit) for hit in found.documents],
            neighbours=None
            if self.engine.knn is None
            else [
                Neighbour(**hit, text=self.texts[hit["token"]])
                for hit in self.engine.neighbours(context)
            ],
        )

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        tokens = [int(t) for t in (prompt if isinstance(prompt, list) else self.ix.encode(prompt))]
        self._check_tokens(tokens, "prompt", "prompt tokens")
        if len(tokens) > self.limits.max_prompt_tokens:
            raise ApiError(
                f"prompt of {len(tokens)} tokens; the limit is {self.limits.max_prompt_tokens}",
                param="prompt",
            )
        return tokens or list(self.line_start)

    def _check_limits(self, body: CompletionRequest) -> int:
        """``max_tokens``, once the request is known to be within the limits."""
        limits = self.limits
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens > limits.max_tokens:
            raise ApiError(f"max_tokens is at most {limits.max_tokens}", param="max_tokens")
        if body.n > limits.max_n:
            raise ApiError(f"n is at most {limits.max_n}", param="n")
        prompts = len(body.prompts())
        if prompts * body.n > limits.max_sequences:
            raise ApiError(
                f"{prompts} prompts × n {body.n} sequences; the limit is {limits.max_sequences}",
                param="prompt",
            )
        if body.logprobs is not None and body.logprobs > limits.max_logprobs:
            raise ApiError(f"logprobs is at most {limits.max_logprobs}", param="logprobs")
        self._check_tokens(list(body.token_bias() or ()), "logit_bias", "logit_bias token ids")
        self.check_model(body.model)
        return max_tokens

    async def submit(self, body: CompletionRequest) -> Job:
        """Check the request and queue its sequences (ApiError if it asks too much)."""
        max_tokens = self._check_limits(body)
        prompts = [self._encode_prompt(p) for p in body.prompts()]
        if max_tokens == 0 and not body.echo:
            raise ApiError("max_tokens 0 returns nothing without echo", param="max_tokens")
        wake = Wakeup()
        choices = [
            Choice(i * body.n + j, p, body, max_tokens, self, wake)
            for i, p in enumerate(prompts)
            for j in range(body.n)
        ]
        index = None
        if body.index:  # teralm's extra field: the index's view of the (first) prompt; looked
            # up before the sequences are queued, so that its failure leaves nothing running
            index = await asyncio.to_thread(self.lookup_tokens, prompts[0])
        self.engine.submit([c.seq for c in choices])
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return Job(self.model_name, choices, wake, index, usage)

    async def collect(self, job: Job, request: Request) -> Completion:
        """The whole completion, once every choice has finished."""
        async for _ in job.follow(request, self.limits.timeout_s):
            pass
        choices = [c.result() for c in job.choices]
        return Completion(**job.envelope, choices=choices, usage=job.usage())

    async def stream(self, job: Job, request: Request) -> AsyncIterator[str]:
        """Server-sent events: a chunk per new piece of a choice, then the index's view (when
        asked for) and ``[DONE]``; or an error event if the generation fails."""
        envelope = {**job.envelope, "index": None}
        try:
            async for chunks in job.follow(request, self.limits.timeout_s):
                for chunk in chunks:
                    yield sse(CompletionChunk(**envelope, choices=[chunk]))
        except ApiError as e:  # the status is sent already: an error event, as OpenAI's
            yield sse(e.response())
            return
        if job.envelope["index"]:
            yield sse(CompletionChunk(**job.envelope, choices=[]))
        if job.include_usage:
            yield sse(CompletionChunk(**envelope, choices=[], usage=job.usage()))
        yield "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class EngineCollector(Collector):
    """The engine's counters and gauges, read at each scrape."""

    COUNTERS = {  # name (without _total): help, EngineStats field
        "teralm_generated_tokens": ("Tokens generated", "tokens"),
        "teralm_prompt_tokens": ("Prompt tokens read", "prompt_tokens"),
        "teralm_prompt_tokens_cached": (
            "Prompt tokens whose keys and values came from the prefix cache",
            "cached_prompt_tokens",
        ),
        "teralm_model_seconds": ("Time in the model's forward passes", "model_s"),
        "teralm_index_lookup_seconds": ("Time in index lookups", "lookup_s"),
    }

    def __init__(self, engine: Engine):
        self.engine, self.started = engine, time.time()

    def collect(self):
        stats = self.engine.stats
        for name, (about, field) in self.COUNTERS.items():
            yield CounterMetricFamily(name, about, value=getattr(stats, field))
        gauges = {
            "teralm_tokens_per_second": (
                "Tokens generated per second since start",
                stats.tokens / max(time.time() - self.started, 1e-9),
            ),
            "teralm_queue_depth": ("Sequences waiting for the batch", self.engine.queue_depth),
            "teralm_active_sequences": ("Sequences in the batch", len(self.engine.active)),
        }
        for name, (about, value) in gauges.items():
            yield GaugeMetricFamily(name, about, value=value)


# -- routes -----------------------------------------------------------------------------------


async def get_service(request: Request) -> CompletionService:
    return request.app.state.service


Service = Annotated[CompletionService, Depends(get_service)]
public = APIRouter()  # no API key: health, the playground, the tokenizer routes, metrics, OpenAPI
api = APIRouter()  # /v1/...: the API key, when the server has one (as vLLM guards its API)


@public.get("/health")
async def health(service: Service) -> Health:
    return Health(model=service.model_name)


@public.get("/", response_class=HTMLResponse, responses=JSON_ERRORS)
async def playground() -> str:
    return resources.files("teralm.server").joinpath("playground.html").read_text()


@public.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@api.get("/v1/models")
async def models(service: Service) -> ModelList:
    return service.models()


@api.post("/v1/completions", response_model=Completion, responses=STREAMED)
async def completions(body: CompletionRequest, request: Request, service: Service):
    job = await service.submit(body)
    request.state.job = job  # for the access log's token counts
    if body.stream:
        return StreamingResponse(service.stream(job, request), media_type="text/event-stream")
    return await service.collect(job, request)


@api.post("/v1/chat/completions", include_in_schema=False)
async def chat_completions() -> None:
    raise ApiError(
        "this server serves a base model, which has no chat template: send the text to "
        "continue to /v1/completions",
        404,
        code="no_chat_model",
    )


@api.post("/v1/lookup")
def lookup(body: LookupRequest, service: Service) -> LookupResponse:
    return service.lookup(body.text, body.top_k, body.sources)


@public.get("/tokenizer_info")
async def tokenizer_info(service: Service) -> TokenizerInfo:
    return service.tokenizer_info()


@public.post("/tokenize")
def tokenize(body: TokenizeRequest, service: Service) -> TokenizeResponse:
    return service.tokenize(body)


@public.post("/detokenize")
def detokenize(body: DetokenizeRequest, service: Service) -> DetokenizeResponse:
    return service.detokenize(body)


@public.get("/metrics", response_class=PlainTextResponse, responses=JSON_ERRORS)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


# -- errors: every one an OpenAI error object -------------------------------------------------


def error(response: ErrorResponse, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(response.model_dump(), status, headers=headers)


async def api_error(_, exc: ApiError) -> JSONResponse:
    return error(exc.response(), exc.status)


async def invalid(_, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()  # a union's alternatives each add one: a value error says most
    first = next((e for e in errors if e["type"] == "value_error"), errors[0] if errors else {})
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return error(error_response(f"the request body is not valid JSON ({reason})"), 400)
    where = ".".join(str(p) for p in first.get("loc", ())[1:2]) or None  # the field
    message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
    return error(error_response(message, param=where), 400)


async def http_error(_, exc: StarletteHTTPException) -> JSONResponse:
    response = error_response(str(exc.detail), code=str(exc.status_code))
    return error(response, exc.status_code, exc.headers)  # a 405's Allow


async def internal(_, exc: Exception) -> JSONResponse:
    log.error("internal error", exc_info=exc)
    return error(error_response("internal error", "server_error"), 500)


def create_app(
    engine: Engine, model_name: str, limits: Limits | None = None, api_key: str | None = None
) -> FastAPI:
    """The server over a running ``engine``: the ``/v1/...`` routes need ``api_key`` when there
    is one (the routes vLLM guards with its key; lm-eval reads the tokenizer routes without)."""
    limits = limits or Limits()
    app = FastAPI(
        title="teralm",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # served by ``openapi`` above, behind the key
        responses=ERRORS,
        exception_handlers={
            ApiError: api_error,
            RequestValidationError: invalid,
            StarletteHTTPException: http_error,
            Exception: internal,
        },
    )
    app.state.service = CompletionService(engine, model_name, limits)
    app.state.registry = CollectorRegistry()
    app.state.registry.register(EngineCollector(engine))
    app.add_middleware(
        Guard, metrics=RequestMetrics(app.state.registry), max_body_bytes=limits.max_body_bytes
    )
    app.include_router(public)
    app.include_router(api, dependencies=[Security(api_key_check(api_key))] if api_key else [])
    return app
