"""Reading request bodies into what the engine needs: validated models, prompt text, ids."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from proxy.enginemodel import ChatTemplateError, ChatTokenizer, render_chat
from testbed.fakevllm.protocol import CompletionRequest, Rejected, TokenizeRequest, validation_message

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_json_object(request: Request) -> dict[str, Any]:
    """The JSON object a request carries; anything else is a 400, as in vLLM."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Rejected(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise Rejected(400, "The request body must be a JSON object")
    return body


async def read_model(request: Request, model_cls: type[ModelT]) -> tuple[dict[str, Any], ModelT]:
    """The JSON body and its validated model; malformed input is a 400, as in vLLM."""
    body = await read_json_object(request)
    try:
        return body, model_cls.model_validate(body)
    except ValidationError as exc:
        raise Rejected(400, validation_message(exc)) from exc


def render(messages: list[Any], tools: list[Any] | None, add_generation_prompt: bool, cont: bool) -> str:
    try:
        return render_chat(messages, tools, add_generation_prompt, cont)
    except ChatTemplateError as exc:
        raise Rejected(400, str(exc)) from exc


STRICT_TEMPLATE_ERROR = "Conversation roles must alternate user/assistant/user/assistant/..."


def require_leading_system(messages: list[Any]) -> None:
    """What a strict chat template raises: a system message after the first message."""
    if any(isinstance(m, dict) and m.get("role") == "system" for m in messages[1:]):
        raise Rejected(400, STRICT_TEMPLATE_ERROR)


def tokenize_text(req: TokenizeRequest) -> tuple[str, bool]:
    """``/tokenize`` input: (text, add_special_tokens) with vLLM's per-kind defaults."""
    if req.messages is not None:
        text = render(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message)
        return text, bool(req.add_special_tokens)
    if req.prompt is not None:
        return req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
    raise Rejected(400, "Either `prompt` or `messages` must be given.")


def completion_prompt(tokenizer: ChatTokenizer, req: CompletionRequest) -> tuple[str, list[int]]:
    """A ``/v1/completions`` prompt as (text, ids); one prompt per request."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise Rejected(400, "The fake backend serves one prompt per request.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise Rejected(400, "The prompt cannot be empty.", param="prompt")
        return prompt, tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    ids = [t for t in prompt if isinstance(t, int)]
    if not ids or len(ids) != len(prompt):
        raise Rejected(400, "A token prompt must be a non-empty list of integers.", param="prompt")
    return tokenizer.decode(ids), ids


def embedding_inputs(tokenizer: ChatTokenizer, value: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Token ids of each ``/v1/embeddings`` input."""
    if isinstance(value, str):
        return [tokenizer.encode(value, add_special_tokens=True)]
    if not value:
        raise Rejected(400, "input must not be empty", param="input")
    inputs: list[list[int]] = []
    if all(isinstance(v, int) for v in value):
        return [[v for v in value if isinstance(v, int)]]
    for item in value:
        if isinstance(item, str):
            inputs.append(tokenizer.encode(item, add_special_tokens=True))
        elif isinstance(item, list):
            inputs.append([int(t) for t in item])
    return inputs
