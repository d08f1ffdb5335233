"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` (vllm/entrypoints/openai/responses).

A request (with the stored messages of ``previous_response_id`` ahead of its input) is
converted to a chat request (``testbed.fakevllm.openai_responses``), generated as one
(``GenerationRoutes.generate_chat``), and its answer or stream converted back; the response
is stored for later chaining and retrieval when the store is on.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from testbed.fakevllm import openai_responses
from testbed.fakevllm.intake import read_model
from testbed.fakevllm.protocol import ChatCompletionRequest, Rejected, _OpenAIModel, validation_message
from testbed.fakevllm.routes.checks import RequestChecks, rejected
from testbed.fakevllm.routes.generation import GenerationRoutes


class ResponsesRoutes:
    """OpenAI's Responses API over the chat generation, with vLLM's in-process response store."""

    def __init__(self, checks: RequestChecks, generation: GenerationRoutes) -> None:
        self.checks = checks
        self.generation = generation
        self.config = generation.config
        self.response_model = generation.response_model
        self.stored = openai_responses.ResponseStore(self.config.responses_store)

    async def create_response(self, request: Request) -> Response:
        record = self.checks.new_record(request, "/v1/responses")
        try:
            record.body, _ = await read_model(request, _OpenAIModel)
            body = record.body
            self.checks.check_model(body.get("model") if isinstance(body.get("model"), str) else None, record)
            previous = None
            if body.get("previous_response_id") is not None:
                previous = self.stored.get(str(body["previous_response_id"])) if self.stored.enabled else None
                if previous is None:
                    record.status_code = 404
                    return JSONResponse(openai_responses.not_found(str(body["previous_response_id"])), 404)
            try:
                messages = openai_responses.input_messages(body, previous)
            except (ValueError, TypeError, AttributeError, IndexError) as exc:
                raise Rejected(400, str(exc), param="input") from exc
            req = ChatCompletionRequest.model_validate(openai_responses.chat_request(body, messages))
        except Rejected as exc:
            return rejected(record, exc)
        except ValidationError as exc:
            return rejected(record, Rejected(400, validation_message(exc)))
        response_id = openai_responses.new_id("resp")
        keep = self.stored.enabled and body.get("store", True) is not False
        store = partial(self._store, keep, messages)

        answer = await self.generation.generate_chat(record, req)
        if answer.status_code >= 400 or not isinstance(answer, StreamingResponse | JSONResponse):
            return answer
        block_size = self.config.block_size
        if isinstance(answer, StreamingResponse):
            events = openai_responses.stream(
                body, response_id, self.response_model, answer.body_iterator, block_size, store
            )
            return StreamingResponse(events, media_type="text/event-stream")
        full = openai_responses.full(body, response_id, json.loads(bytes(answer.body)), block_size)
        store(full)
        return JSONResponse(full)

    async def retrieve_response(self, response_id: str) -> Response:
        found = self.stored.get(response_id)
        if found is None:
            return JSONResponse(openai_responses.not_found(response_id), 404)
        return JSONResponse(found.response)

    def _store(self, keep: bool, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        """What ``previous_response_id`` and GET read later (``keep``: the store is on, ``store`` not false)."""
        if keep:
            self.stored.put(response, messages)
