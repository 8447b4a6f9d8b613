"""OpenAI-compatible schemas, apart from the engine: what each route takes and what it sends.

Types are strict where OpenAI's API is: a number is a JSON number (not ``"3"``, ``true`` or
NaN), a flag a JSON boolean. Fields the OpenAI client may send but teralm does not use
(penalties, ``user``) are accepted and ignored; ``best_of`` other than ``n`` and a non-empty
``suffix`` are refused rather than ignored. Anything out of range, and text that is not valid
Unicode, is a 400 with an OpenAI-style error object.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 16  # lm-evaluation-harness tasks send up to 5; OpenAI takes 4
MAX_STOP_CHARS = 256  # each stop string is searched for after every token
MAX_LOGIT_BIAS = 300  # OpenAI's limit on the tokens one request may bias


@dataclass
class Limits:
    """What one request may ask for."""

    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_n: int = 8
    max_sequences: int = 64  # prompts × n: what one request may queue
    max_body_bytes: int = 1 << 20
    max_logprobs: int = 20
    timeout_s: float = 120.0


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("text must be valid Unicode (it has a lone surrogate)") from e
    return text


Text = Annotated[str, AfterValidator(_encodable)]  # JSON's "\ud800" is a str, but not UTF-8
TokenId = Annotated[int, Field(ge=0)]


# -- requests ---------------------------------------------------------------------------------


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(Request):
    include_usage: bool = False  # a last chunk with the usage, as OpenAI's API sends it


class CompletionRequest(Request):
    model: Text | None = None
    prompt: Text | list[Text] | list[int] | list[list[int]] = ""
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    stop: Text | list[Text] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # torch takes 64 bits
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    best_of: int | None = Field(None, ge=1)
    suffix: Text | None = None
    # teralm extra: the prompt's index lookup in the response; "tokens": also, in each choice,
    # what the index did for each generated token (``index_tokens``)
    index: bool | Literal["tokens"] = False

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if not value:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes up to {MAX_LOGIT_BIAS} tokens")
        if not all(k.isascii() and k.isdigit() for k in value):
            raise ValueError("logit_bias keys are token ids (strings of digits)")
        if not all(-100 <= v <= 100 for v in value.values()):
            raise ValueError("logit_bias values lie in [-100, 100]")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: ask for n and rank them")
        if self.suffix:
            raise ValueError("suffix is not supported (no insertion mode)")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes up to {MAX_STOPS} non-empty strings of up to {MAX_STOP_CHARS} characters"
            )
        return stops

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by token id."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p) or [""]


class LookupRequest(Request):
    text: Text
    top_k: int = Field(5, ge=1, le=100)
    sources: int = Field(3, ge=0, le=20)


class TokenizeRequest(Request):
    """vLLM's ``/tokenize``; there are no special tokens to add."""

    prompt: Text
    add_special_tokens: bool = True
    model: Text | None = None


class DetokenizeRequest(Request):
    tokens: list[TokenId]
    model: Text | None = None


# -- responses --------------------------------------------------------------------------------


class Logprobs(BaseModel):
    """Per token: its text (``bytes:\\xNN`` for part of a character), log-probability, the top
    alternatives and where its text starts. The first echoed token has no log-probability."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


FinishReason = Literal["stop", "length"]


class Proposal(BaseModel):
    token: int
    text: str


class NeighbourDocument(BaseModel):
    """A kNN neighbour of the model's state: the document it was stored from, and how near."""

    document: int
    source: str
    distance: float


class TokenIndexView(BaseModel):
    """What the index did for one generated token (``"index": "tokens"``): the longest match
    of the context before it, as the model read it, and the token that followed that match in
    the corpus (``proposed``; null when nothing did); the ∞-gram's probability of the token
    and the continuations it counted (null and 0 when it counted none); the weight the model's
    mixture gate gave the ∞-gram (null without one); and, with a kNN datastore, the documents
    of the nearest stored states."""

    token: int
    text: str
    match_length: int
    proposed: Proposal | None
    infgram_probability: float | None
    infgram_count: int
    gate: float | None
    neighbours: list[NeighbourDocument] | None = Field(None, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None  # None until the choice's last chunk
    index_tokens: list[TokenIndexView] | None = Field(None, exclude_if=lambda v: v is None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class LongestMatch(BaseModel):
    length: int
    tokens: int
    count: int
    text: str


class Continuation(BaseModel):
    token: int
    text: str
    count: int
    probability: float


class Source(BaseModel):
    document: int
    source: str
    offset: int
    snippet: str


class Neighbour(BaseModel):
    """A stored state of the kNN datastore near the model's state after the text: where it was
    taken (the document, the offset of its token), how near, and the token that followed."""

    document: int
    source: str
    offset: int
    distance: float
    token: int
    text: str
    snippet: str


class LookupResponse(BaseModel):
    """The index's view of a text: its longest match, what followed it, and where; with a kNN
    datastore, also the nearest stored states of the model after the text."""

    longest_match: LongestMatch
    continuations: list[Continuation]
    sources: list[Source]
    neighbours: list[Neighbour] | None = Field(None, exclude_if=lambda v: v is None)


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (the last ones may carry ``index`` or,
    with ``stream_options.include_usage``, ``usage`` alone)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    index: LookupResponse | None = Field(None, exclude_if=lambda v: v is None)  # when asked
    usage: Usage | None = Field(None, exclude_if=lambda v: v is None)


class Completion(CompletionChunk):
    usage: Usage


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "teralm"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizerInfo(BaseModel):
    """vLLM's ``/tokenizer_info``, as lm-evaluation-harness reads it: the model has no
    end-of-text token, and a new line begins a text (as it begins an empty prompt)."""

    tokenizer: str
    vocab_size: int
    bos_token: str = "\n"
    eos_token: str | None = None
    pad_token: str | None = None
    model_max_length: int


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every 4xx and 5xx carries, as OpenAI's API does."""

    error: ErrorDetail


class ApiError(Exception):
    """An error answered with an OpenAI error object: the client's (4xx) or the server's (5xx)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

    def response(self) -> ErrorResponse:
        return error_response(str(self), self.kind, self.param, self.code)


def error_response(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> ErrorResponse:
    """The OpenAI error object."""
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
