"""``/v1/messages`` and ``/v1/messages/count_tokens`` (vllm/entrypoints/anthropic).

A message request is converted to a chat request (``testbed.fakevllm.anthropic``), generated
as one (``GenerationRoutes.generate_chat``), and its answer or stream converted back. Errors
are in Anthropic's shape, except a converted request that fails the chat model's validation.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from testbed.fakevllm import anthropic
from testbed.fakevllm.intake import read_json_object, render
from testbed.fakevllm.protocol import ChatCompletionRequest, Rejected, error_type_for, validation_message
from testbed.fakevllm.requestlog import RequestRecord
from testbed.fakevllm.routes.checks import RequestChecks, rejected
from testbed.fakevllm.routes.generation import GenerationRoutes


class AnthropicRoutes:
    """Anthropic's Messages API over the chat generation, as vLLM serves it."""

    def __init__(self, checks: RequestChecks, generation: GenerationRoutes) -> None:
        self.checks = checks
        self.generation = generation
        self.config = config = generation.config
        self.engine = generation.engine
        # vLLM's --enable-prompt-tokens-details: usage then splits the prompt into cache reads and writes.
        self.details = config.zero_cached_tokens_details != "null"

    async def messages(self, request: Request) -> Response:
        config = self.config
        record = self.checks.new_record(request, "/v1/messages")
        try:
            body = await _read_body(request, record, count=False)
            self.checks.check_model(body["model"], record)
            chat_body = anthropic.to_chat(body, merge_inline_system=not config.system_anywhere)
            req = ChatCompletionRequest.model_validate(chat_body)
        except Rejected as exc:
            return _refused(record, exc)
        except ValidationError as exc:
            return rejected(record, Rejected(400, validation_message(exc)))
        answer = await self.generation.generate_chat(record, req)
        if answer.status_code >= 400:
            return anthropic.from_chat_error(answer.status_code, bytes(answer.body))
        if isinstance(answer, StreamingResponse):
            events = anthropic.stream(answer.body_iterator, config.block_size, self.details)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(anthropic.message(json.loads(bytes(answer.body)), config.block_size, self.details))

    async def count_tokens(self, request: Request) -> Response:
        record = self.checks.new_record(request, "/v1/messages/count_tokens")
        try:
            body = await _read_body(request, record, count=True)
            self.checks.check_model(body["model"], record)
            merge = not self.config.system_anywhere
            chat_body = anthropic.to_chat(body, merge_inline_system=merge, count_tokens=True)
            prompt_text = render(chat_body["messages"], chat_body.get("tools"), True, False)
        except Rejected as exc:
            return _refused(record, exc)
        count = len(self.engine.tokenizer.encode(prompt_text))
        record.state = "completed"
        return JSONResponse({"input_tokens": count, "context_management": {"original_input_tokens": count}})


async def _read_body(request: Request, record: RequestRecord, *, count: bool) -> dict[str, Any]:
    """The request's JSON object with what vLLM's Anthropic model requires (no max_tokens to count)."""
    body = await read_json_object(request)
    record.body = body
    if not isinstance(body.get("model"), str) or not isinstance(body.get("messages"), list):
        raise Rejected(400, "model and messages are required", param="body")
    if not count and (not isinstance(body.get("max_tokens"), int) or body["max_tokens"] <= 0):
        raise Rejected(400, "max_tokens must be positive", param="body.max_tokens")
    return body


def _refused(record: RequestRecord, exc: Rejected) -> JSONResponse:
    """``rejected`` (the request log's record), answered in Anthropic's error shape."""
    rejected(record, exc)
    return anthropic.error_response(exc.status, exc.message, exc.err_type or error_type_for(exc.status))
