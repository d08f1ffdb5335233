"""Request bodies the fake backend accepts, and vLLM's error shape.

Validation is deliberately close to vLLM's pydantic models: unknown fields are accepted
(vLLM logs and ignores them), wrong types are a 400 (vLLM turns FastAPI validation errors
into 400, not 422). Messages and tools stay plain dicts here; ``template`` validates them
the way vLLM's chat preprocessing does.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "FakeOptions",
    "Rejected",
    "StreamOptions",
    "TokenizeRequest",
    "error_response",
    "error_type_for",
]


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class _ChatPromptFields(BaseModel):
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_open_turn(self) -> _ChatPromptFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class FakeOptions(BaseModel):
    """Per-request test hooks, sent as an extra body field ``fake_options``."""

    model_config = ConfigDict(extra="forbid")

    # Answer with this HTTP status and an OpenAI error body instead of generating.
    status: int | None = Field(default=None, ge=400, le=599)
    error_message: str | None = None
    error_type: str | None = None
    # Sleep this long before doing anything (after the request was logged).
    delay_s: float = Field(default=0.0, ge=0.0)
    # Per-chunk (per output token) delay for this request, overriding the server's.
    chunk_delay_s: float | None = Field(default=None, ge=0.0)
    # Drop the connection after this many SSE events of a stream, like a crashed upstream.
    abort_after_chunks: int | None = Field(default=None, ge=0)
    # Generate exactly this text (before the end token) instead of the reply policy's.
    reply: str | None = None


class StreamOptions(_OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _GenerationRequest(_OpenAIModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    fake_options: FakeOptions | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value


class ChatCompletionRequest(_GenerationRequest, _ChatPromptFields):
    messages: list[Any]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def named_tool(self) -> str | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function")
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                return function["name"]
        return None

    @property
    def effective_tool_choice(self) -> str:
        # vLLM: tool_choice defaults to "auto" when tools are given, else "none".
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, dict):
            return "named"
        return self.tool_choice


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # vLLM's CompletionRequest default.
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    add_special_tokens: bool = True


class EmbeddingRequest(_OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


class TokenizeRequest(_OpenAIModel, _ChatPromptFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None


class Rejected(Exception):
    """A request ends here, answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.err_type, self.param)


def error_type_for(status: int) -> str:
    """vLLM/OpenAI style error type for an HTTP status: 404 -> "NotFoundError"."""
    named = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
    if status in named:
        return named[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def error_response(status: int, message: str, err_type: str | None = None, param: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""
    body = {
        "error": {
            "message": message,
            "type": err_type or error_type_for(status),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(status_code=status, content=body)


def validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False):
        location = ".".join(str(p) for p in item.get("loc", ()))
        parts.append(f"{location}: {item.get('msg')}" if location else str(item.get("msg")))
    return "; ".join(parts)
