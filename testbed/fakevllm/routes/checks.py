"""What every route does before a request reaches the engine: log it, and vLLM's checks.

A check that fails raises ``Rejected``; the route answers with ``rejected(record, exc)``, which
also marks the request log's record as an error.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from testbed.fakevllm import responses as bodies
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.engine import FakeEngine
from testbed.fakevllm.protocol import ChatCompletionRequest, CompletionRequest, FakeOptions, Rejected
from testbed.fakevllm.requestlog import RequestRecord

# Headers worth keeping in the request log; the rest is transport noise.
_DROPPED_HEADERS = frozenset({"content-length", "connection", "accept-encoding", "host"})


class RequestChecks:
    """The request log's record of a request, and vLLM's checks of model, length and parameters."""

    def __init__(self, engine: FakeEngine, config: FakeBackendConfig) -> None:
        self.engine = engine
        self.config = config
        self.served_names = config.model_names

    def new_record(self, request: Request, endpoint: str) -> RequestRecord:
        headers = {k: v for k, v in request.headers.items() if k not in _DROPPED_HEADERS}
        record = RequestRecord(request_id=bodies.random_id(), endpoint=endpoint, body=None, headers=headers)
        return self.engine.log.add(record)

    def check_model(self, model: str | None, record: RequestRecord) -> None:
        record.model = model
        if model is not None and model not in self.served_names:
            raise Rejected(404, f"The model `{model}` does not exist.", "NotFoundError")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """vLLM's context-length validation; returns the effective max_tokens."""
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise Rejected(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the messages, Please reduce the length of the messages.",
            )
        room = limit - num_prompt_tokens
        if max_tokens is not None and max_tokens > room and not self.config.clamp_max_tokens:
            raise Rejected(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens + num_prompt_tokens} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            )
        fit_error = self.engine.check_fits(num_prompt_tokens)
        if fit_error:
            raise Rejected(400, fit_error)
        return room if max_tokens is None else min(max_tokens, room)

    async def check_generation(self, record: RequestRecord, req: ChatCompletionRequest | CompletionRequest) -> None:
        """What chat and text completions check first: ``fake_options``, the model, n and streaming."""
        record.stream = bool(req.stream)
        await apply_fake_options(req.fake_options)
        self.check_model(req.model, record)
        if req.n is not None and req.n < 1:
            raise Rejected(400, "n must be at least 1.", param="n")
        if req.n is not None and req.n != 1 and req.stream:
            raise Rejected(400, "The fake backend streams n=1 only.", param="n")
        if req.stream_options is not None and not req.stream:
            raise Rejected(400, "Stream options can only be defined when `stream=True`.")


async def apply_fake_options(options: FakeOptions | None) -> None:
    """The ``fake_options`` test hooks that act before generation: a delay, then an error status."""
    if options is None:
        return
    if options.delay_s > 0:
        await asyncio.sleep(options.delay_s)
    if options.status is not None:
        message = options.error_message or f"fake backend error {options.status}"
        raise Rejected(options.status, message, options.error_type)


def rejected(record: RequestRecord, exc: Rejected) -> JSONResponse:
    """The error answer of a refused request (OpenAI's shape), recorded in the request log."""
    record.status_code = exc.status
    record.state = "error"
    record.error = exc.message
    return exc.response()
