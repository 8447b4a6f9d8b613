"""OpenAI-compatible request and response schemas for ``/v1/completions`` (apart from the engine).

Fields the OpenAI client may send but teralm does not use (penalties, ``user``, ``best_of`` = n,
``logit_bias`` when empty) are accepted and ignored; anything out of range, and text that is not
valid Unicode, is a 400 with an OpenAI-style error object.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


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


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | list[Text] | list[int] | list[list[int]] = ""
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    stop: Text | list[Text] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # torch takes 64 bits
    index: bool = False  # teralm extra: the prompt's index lookup in the response

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (strings or token lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p) or [""]


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Text
    top_k: int = Field(5, ge=1, le=100)
    sources: int = Field(3, ge=0, le=20)


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every 4xx and 5xx carries, as OpenAI's API does."""

    error: ErrorDetail


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
