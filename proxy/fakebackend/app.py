"""The fake vLLM OpenAI-compatible server (FastAPI).

Pipeline per generation request, as in vLLM: validate -> render the chat template ->
tokenize -> admit into the prefix-cache model (hit = ``cached_tokens``) -> sleep for the
uncached prefill -> emit the fake model's tokens -> cache prompt + output blocks -> free.

Test-only surface (not in vLLM): the ``fake_options`` body field (see ``FakeOptions``) and the
``/fake/*`` endpoints: ``GET /fake/requests`` (what the backend received), ``GET /fake/stats``
(stream outcomes, cache state), ``POST /fake/reset`` and ``POST /fake/cache/lookup``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from proxy.fakebackend import responses as bodies
from proxy.fakebackend.config import FakeBackendConfig
from proxy.fakebackend.embeddings import embed, to_base64, truncate_and_normalize
from proxy.fakebackend.engine import Admission, FakeEngine, Generation, generate
from proxy.fakebackend.metrics import CONTENT_TYPE
from proxy.fakebackend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    FakeOptions,
    TokenizeRequest,
    error_response,
    validation_message,
)
from proxy.fakebackend.replies import ToolCallReply, plan_reply, tool_call_for
from proxy.fakebackend.requestlog import RequestRecord
from proxy.fakebackend.template import ChatTemplateError, render_chat
from proxy.fakebackend.tokenizer import ChatTokenizer
from proxy.fakebackend.toolcalls import ParsedOutput, ToolMode, parse_output, stream_deltas

ModelT = TypeVar("ModelT", bound=BaseModel)

# Headers worth keeping in the request log; the rest is transport noise.
_DROPPED_HEADERS = frozenset({"content-length", "connection", "accept-encoding", "host"})


class _StreamAborted(Exception):
    """Raised inside a stream to drop the connection (fake_options.abort_after_chunks)."""


class _Reject(Exception):
    """A request ends here with an OpenAI error body."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


@dataclass
class _Job:
    """A validated generation request, ready to be admitted."""

    record: RequestRecord
    prompt_ids: list[int]
    cache_salt: str | None
    generation: Generation
    seconds_per_token: float
    abort_after: int | None
    started_at: float
    completion_id: str
    created: int


def create_app(config: FakeBackendConfig | None = None, *, tokenizer: ChatTokenizer | None = None) -> FastAPI:
    """A fresh fake backend (its own cache, metrics registry and request log)."""
    config = config or FakeBackendConfig()
    engine = FakeEngine(config, tokenizer)
    served_names = config.model_names
    response_model = served_names[0]
    app = FastAPI(title="prefix-proxy fake vLLM backend", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.config = config

    # -- shared steps ------------------------------------------------------------------------

    def new_record(request: Request, endpoint: str) -> RequestRecord:
        headers = {k: v for k, v in request.headers.items() if k not in _DROPPED_HEADERS}
        return engine.log.add(
            RequestRecord(request_id=bodies.random_id(), endpoint=endpoint, body=None, headers=headers)
        )

    async def parse_body(request: Request, record: RequestRecord, model_cls: type[ModelT]) -> ModelT:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _Reject(400, f"Invalid JSON body: {exc}") from exc
        record.body = body
        if not isinstance(body, dict):
            raise _Reject(400, "The request body must be a JSON object")
        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            raise _Reject(400, validation_message(exc)) from exc

    def rejected(record: RequestRecord, exc: _Reject) -> JSONResponse:
        record.status_code = exc.status
        record.state = "error"
        record.error = exc.message
        return error_response(exc.status, exc.message, exc.err_type, exc.param)

    async def apply_fake_options(options: FakeOptions | None) -> None:
        if options is None:
            return
        await _sleep(options.delay_s)
        if options.status is not None:
            raise _Reject(
                options.status,
                options.error_message or f"fake backend error {options.status}",
                options.error_type,
            )

    def check_model(model: str | None, record: RequestRecord) -> None:
        record.model = model
        if model is not None and model not in served_names:
            raise _Reject(404, f"The model `{model}` does not exist.", "NotFoundError")

    def check_length(num_prompt_tokens: int, max_tokens: int | None) -> int:
        """vLLM's context-length validation; returns the effective max_tokens."""
        limit = config.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise _Reject(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt_tokens} tokens in the messages, Please reduce the length of the messages.",
                )
            max_tokens = limit - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > limit:
            raise _Reject(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens + num_prompt_tokens} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            )
        fit_error = engine.check_fits(num_prompt_tokens)
        if fit_error:
            raise _Reject(400, fit_error)
        return max_tokens

    def make_job(
        record: RequestRecord,
        prompt_text: str,
        prompt_ids: list[int],
        raw_reply: str,
        max_tokens: int,
        cache_salt: str | None,
        options: FakeOptions | None,
        id_prefix: str,
    ) -> _Job:
        record.prompt_text = prompt_text
        record.prompt_token_ids.extend(prompt_ids)
        if options is not None and options.reply is not None:
            raw_reply = options.reply
        per_token = config.seconds_per_output_token
        if options is not None and options.chunk_delay_s is not None:
            per_token = options.chunk_delay_s
        return _Job(
            record=record,
            prompt_ids=prompt_ids,
            cache_salt=cache_salt,
            generation=generate(engine.tokenizer, raw_reply, max_tokens),
            seconds_per_token=per_token,
            abort_after=options.abort_after_chunks if options is not None else None,
            started_at=time.monotonic(),
            completion_id=f"{id_prefix}-{bodies.random_id()}",
            created=bodies.now(),
        )

    async def prefill(job: _Job) -> Admission:
        admission = await engine.admit(job.prompt_ids, job.cache_salt)
        job.record.cached_tokens = admission.cached_tokens
        try:
            uncached = len(job.prompt_ids) - admission.cached_tokens
            await _sleep(config.prefill_seconds_per_token * uncached)
        except BaseException:
            engine.finish(admission, [], "abort", job.started_at)
            raise
        ttft = time.monotonic() - job.started_at
        job.record.ttft_s = ttft
        engine.first_token(len(job.prompt_ids), ttft)
        return admission

    async def run_to_completion(job: _Job) -> None:
        sampled: list[int] = []
        try:
            admission = await prefill(job)
            try:
                await _sleep(job.seconds_per_token * (len(job.generation.token_ids) - 1))
                sampled = job.generation.token_ids
            finally:
                reason = job.generation.finish_reason if sampled else "abort"
                engine.finish(admission, sampled, reason, job.started_at)
        finally:
            _finish_record(job, len(sampled), "completed" if sampled else "cancelled")

    def usage_for(job: _Job, completion_tokens: int) -> dict[str, Any]:
        return bodies.usage(
            len(job.prompt_ids),
            completion_tokens,
            job.record.cached_tokens,
            config.zero_cached_tokens_details,
        )

    async def stream_events(
        job: _Job,
        prelude: Callable[[], list[dict[str, Any]]],
        token_chunk: Callable[[int, dict[str, Any] | None], dict[str, Any] | None],
        include_usage: bool,
        chunk_object: str,
    ) -> AsyncIterator[str]:
        streams = engine.streams
        streams.active_streams += 1
        state = "cancelled"
        sent_tokens = 0
        events = 0
        admission: Admission | None = None

        def gate() -> None:
            nonlocal events
            if job.abort_after is not None and events >= job.abort_after:
                raise _StreamAborted
            events += 1

        try:
            admission = await prefill(job)
            for opening in prelude():
                gate()
                yield bodies.sse(opening)
            for index in range(len(job.generation.token_ids)):
                if index:
                    await _sleep(job.seconds_per_token)
                sent_tokens = index + 1
                chunk = token_chunk(index, usage_for(job, sent_tokens))
                if chunk is not None:
                    gate()
                    yield bodies.sse(chunk)
            if include_usage:
                gate()
                yield bodies.sse(
                    bodies.usage_chunk(
                        job.completion_id,
                        job.created,
                        response_model,
                        usage_for(job, sent_tokens),
                        chunk_object,
                    )
                )
            gate()
            yield bodies.SSE_DONE
            state = "completed"
        except _StreamAborted:
            state = "aborted"
            raise
        finally:
            streams.active_streams -= 1
            if state == "completed":
                streams.streams_completed += 1
            elif state == "aborted":
                streams.streams_aborted += 1
            else:
                streams.streams_cancelled += 1
            if admission is not None:
                done = sent_tokens == len(job.generation.token_ids)
                reason = job.generation.finish_reason if done else "abort"
                engine.finish(admission, job.generation.token_ids[:sent_tokens], reason, job.started_at)
            _finish_record(job, sent_tokens, state)

    # -- OpenAI endpoints --------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        record = new_record(request, "/v1/chat/completions")
        try:
            req = await parse_body(request, record, ChatCompletionRequest)
            record.stream = bool(req.stream)
            await apply_fake_options(req.fake_options)
            check_model(req.model, record)
            _check_generation_params(req.n, req.stream, req.stream_options is not None)
            mode = _tool_mode(req)
            try:
                prompt_text = render_chat(
                    req.messages, req.tools, req.add_generation_prompt, req.continue_final_message
                )
            except ChatTemplateError as exc:
                raise _Reject(400, str(exc)) from exc
            prompt_ids = engine.tokenizer.encode(prompt_text)
            max_tokens = check_length(len(prompt_ids), req.requested_max_tokens)
        except _Reject as exc:
            return rejected(record, exc)

        raw_reply = _chat_reply_text(prompt_text, mode, req.named_tool, req.tools)
        job = make_job(
            record,
            prompt_text,
            prompt_ids,
            raw_reply,
            max_tokens,
            req.cache_salt,
            req.fake_options,
            "chatcmpl",
        )
        parsed = parse_output(job.generation.text, mode, req.named_tool)
        call_ids = [bodies.tool_call_id() for _ in parsed.tool_calls]
        finish_reason = _chat_finish_reason(parsed, mode, job.generation.finish_reason)

        if not req.stream:
            await run_to_completion(job)
            body = bodies.chat_completion(
                job.completion_id,
                job.created,
                response_model,
                bodies.chat_message(parsed, call_ids),
                finish_reason,
                usage_for(job, len(job.generation.token_ids)),
            )
            return JSONResponse(body)

        deltas = stream_deltas(parsed, job.generation.token_texts, call_ids)
        last = len(deltas) - 1
        tools_streamed = False
        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)

        def prelude() -> list[dict[str, Any]]:
            usage_body = usage_for(job, 0) if continuous else None
            return [bodies.chat_chunk(job.completion_id, job.created, response_model, _ROLE_DELTA, None, usage_body)]

        def token_chunk(index: int, usage_body: dict[str, Any] | None) -> dict[str, Any] | None:
            nonlocal tools_streamed
            delta = deltas[index]
            if delta is None:
                if index != last:
                    return None
                delta = {} if tools_streamed else {"content": ""}
            tools_streamed = tools_streamed or bool(delta.get("tool_calls"))
            reason = None
            if index == last:
                reason = job.generation.finish_reason
                if tools_streamed and mode != "named" and reason == "stop":
                    reason = "tool_calls"
            return bodies.chat_chunk(
                job.completion_id,
                job.created,
                response_model,
                delta,
                reason,
                usage_body if continuous else None,
            )

        include_usage = bool(options and options.include_usage)
        return _sse_response(stream_events(job, prelude, token_chunk, include_usage, "chat.completion.chunk"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        record = new_record(request, "/v1/completions")
        try:
            req = await parse_body(request, record, CompletionRequest)
            record.stream = bool(req.stream)
            await apply_fake_options(req.fake_options)
            check_model(req.model, record)
            _check_generation_params(req.n, req.stream, req.stream_options is not None)
            if req.echo:
                raise _Reject(400, "echo is not supported by the fake backend")
            prompt_text, prompt_ids = _completion_prompt(engine.tokenizer, req)
            max_tokens = check_length(len(prompt_ids), req.max_tokens)
        except _Reject as exc:
            return rejected(record, exc)

        job = make_job(
            record,
            prompt_text,
            prompt_ids,
            plan_reply(prompt_text).text,
            max_tokens,
            req.cache_salt,
            req.fake_options,
            "cmpl",
        )
        if not req.stream:
            await run_to_completion(job)
            body = bodies.text_completion(
                job.completion_id,
                job.created,
                response_model,
                job.generation.text,
                job.generation.finish_reason,
                usage_for(job, len(job.generation.token_ids)),
            )
            return JSONResponse(body)

        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        last = len(job.generation.token_ids) - 1

        def token_chunk(index: int, usage_body: dict[str, Any] | None) -> dict[str, Any] | None:
            reason = job.generation.finish_reason if index == last else None
            text = job.generation.token_texts[index]
            return bodies.text_completion_chunk(
                job.completion_id,
                job.created,
                response_model,
                text,
                reason,
                usage_body if continuous else None,
            )

        include_usage = bool(options and options.include_usage)
        return _sse_response(stream_events(job, lambda: [], token_chunk, include_usage, "text_completion"))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        record = new_record(request, "/v1/embeddings")
        try:
            req = await parse_body(request, record, EmbeddingRequest)
            check_model(req.model, record)
            inputs = _embedding_inputs(engine.tokenizer, req.input)
        except _Reject as exc:
            return rejected(record, exc)
        data = []
        total_tokens = 0
        for index, ids in enumerate(inputs):
            total_tokens += len(ids)
            vector = embed(json.dumps(ids).encode(), config.embedding_dim)
            if req.dimensions is not None and req.dimensions < len(vector):
                vector = truncate_and_normalize(vector, req.dimensions)
            encoded: list[float] | str = to_base64(vector) if req.encoding_format == "base64" else vector
            data.append({"index": index, "object": "embedding", "embedding": encoded})
        record.state = "completed"
        return JSONResponse(
            {
                "id": f"embd-{bodies.random_id()}",
                "object": "list",
                "created": bodies.now(),
                "model": response_model,
                "data": data,
                "usage": {
                    "prompt_tokens": total_tokens,
                    "total_tokens": total_tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(bodies.model_list(served_names, config.model, config.max_model_len, bodies.now()))

    # -- vLLM server-root endpoints ----------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        record = new_record(request, "/tokenize")
        try:
            req = await parse_body(request, record, TokenizeRequest)
            check_model(req.model, record)
            prompt_text, add_special = _tokenize_text(req)
        except _Reject as exc:
            return rejected(record, exc)
        ids = engine.tokenizer.encode(prompt_text, add_special_tokens=add_special)
        record.state = "completed"
        record.prompt_text = prompt_text
        record.prompt_token_ids.extend(ids)
        return JSONResponse(
            {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids, "token_strs": None}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            tokens = body["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise TypeError("tokens must be a list of integers")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            return error_response(400, f"Invalid detokenize request: {exc}")
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": "0.0.0+fake"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        engine.cache.reset()
        return Response(status_code=200)

    # -- test hooks --------------------------------------------------------------------------

    @app.get("/fake/requests")
    async def fake_requests(limit: int | None = None, include_token_ids: bool = False) -> JSONResponse:
        return JSONResponse([r.to_json(include_token_ids) for r in engine.log.last(limit)])

    @app.get("/fake/stats")
    async def fake_stats() -> JSONResponse:
        cache = engine.cache
        return JSONResponse(
            {
                **engine.streams.to_json(),
                "requests_running": engine.num_running,
                "requests_waiting": engine.num_waiting,
                "prefix_cache": {
                    "block_size": cache.block_size,
                    "capacity_blocks": cache.capacity_blocks,
                    "cached_blocks": cache.num_cached_blocks,
                    "used_blocks": cache.num_used_blocks,
                    "usage": cache.usage,
                    "requests": cache.stats.requests,
                    "queries": cache.stats.queries,
                    "hits": cache.stats.hits,
                    "hit_rate": cache.stats.hit_rate,
                },
            }
        )

    @app.post("/fake/reset")
    async def fake_reset() -> JSONResponse:
        engine.reset()
        return JSONResponse({"reset": True})

    @app.post("/fake/cache/lookup")
    async def fake_cache_lookup(request: Request) -> Response:
        """How many tokens of this prompt are cached right now (changes nothing)."""
        record = RequestRecord(request_id="lookup", endpoint="/fake/cache/lookup", body=None, headers={})
        try:
            req = await parse_body(request, record, TokenizeRequest)
            prompt_text, add_special = _tokenize_text(req)
        except _Reject as exc:
            return error_response(exc.status, exc.message)
        ids = engine.tokenizer.encode(prompt_text, add_special_tokens=add_special)
        salt = record.body.get("cache_salt") if isinstance(record.body, dict) else None
        cached = engine.cache.lookup(ids, salt if isinstance(salt, str) and salt else None)
        return JSONResponse({"prompt_tokens": len(ids), "cached_tokens": cached})

    return app


_ROLE_DELTA: dict[str, Any] = {"role": "assistant", "content": ""}


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def _finish_record(job: _Job, sent_tokens: int, state: str) -> None:
    record = job.record
    record.state = state
    record.completion_tokens = sent_tokens
    record.output_text = "".join(job.generation.token_texts[:sent_tokens])
    if state == "completed":
        record.finish_reason = job.generation.finish_reason
    else:
        record.finish_reason = "abort"


def _check_generation_params(n: int | None, stream: bool | None, has_stream_options: bool) -> None:
    if n is not None and n != 1:
        raise _Reject(400, "The fake backend only supports n=1.", param="n")
    if has_stream_options and not stream:
        raise _Reject(400, "Stream options can only be defined when `stream=True`.")


def _tool_mode(req: ChatCompletionRequest) -> ToolMode:
    """vLLM's tool_choice validation; the mode the output parser runs in."""
    choice = req.tool_choice
    if choice is None or choice == "none":
        return "auto" if choice is None and req.tools else "none"
    if req.tools is None:
        raise _Reject(400, "When using `tool_choice`, `tools` must be set.")
    if choice == "required":
        return "required" if req.tools else "none"
    if choice == "auto":
        return "auto"
    name = req.named_tool
    if name is None:
        raise _Reject(
            400,
            'Invalid `tool_choice`. Correct usage: `{"type": "function", "function": {"name": "my_function"}}`',
        )
    names = {t.get("function", {}).get("name") for t in req.tools if isinstance(t, dict)}
    if name not in names:
        raise _Reject(400, "The tool specified in `tool_choice` does not match any of the specified `tools`")
    return "named"


def _chat_reply_text(prompt_text: str, mode: ToolMode, named: str | None, tools: list[Any] | None) -> str:
    """What the fake model emits; for forced tool choices, what guided decoding makes it emit."""
    if mode == "named" and named is not None:
        return json.dumps(tool_call_for(prompt_text, named).arguments, ensure_ascii=False)
    if mode == "required" and tools:
        reply = plan_reply(prompt_text)
        if not isinstance(reply, ToolCallReply):
            first = tools[0].get("function", {}).get("name", "") if isinstance(tools[0], dict) else ""
            reply = tool_call_for(prompt_text, first)
        return json.dumps([{"name": reply.name, "parameters": reply.arguments}], ensure_ascii=False)
    return plan_reply(prompt_text).text


def _chat_finish_reason(parsed: ParsedOutput, mode: ToolMode, finish_reason: str) -> str:
    # OpenAI: "tool_calls" for auto and required tool calls, "stop" for a named tool choice.
    if mode == "auto" and parsed.tools_called:
        return "tool_calls"
    if mode == "required" and parsed.tools_called and finish_reason == "stop":
        return "tool_calls"
    return finish_reason


def _completion_prompt(tokenizer: ChatTokenizer, req: CompletionRequest) -> tuple[str, list[int]]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise _Reject(400, "The fake backend serves one prompt per request.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _Reject(400, "The prompt cannot be empty.", param="prompt")
        return prompt, tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    ids = [int(t) for t in prompt if isinstance(t, int)]
    if len(ids) != len(prompt):
        raise _Reject(400, "A token prompt must be a list of integers.", param="prompt")
    if not ids:
        raise _Reject(400, "The prompt cannot be empty.", param="prompt")
    return tokenizer.decode(ids), ids


def _embedding_inputs(
    tokenizer: ChatTokenizer, value: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(value, str):
        return [tokenizer.encode(value, add_special_tokens=True)]
    if not value:
        raise _Reject(400, "input must not be empty", param="input")
    if all(isinstance(v, int) for v in value):
        return [[int(v) for v in value]]  # type: ignore[arg-type]
    out: list[list[int]] = []
    for item in value:
        out.append(tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item))  # type: ignore[arg-type]
    return out


def _tokenize_text(req: TokenizeRequest) -> tuple[str, bool]:
    if req.messages is not None:
        try:
            text = render_chat(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message)
        except ChatTemplateError as exc:
            raise _Reject(400, str(exc)) from exc
        return text, bool(req.add_special_tokens)
    if req.prompt is not None:
        return req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
    raise _Reject(400, "Either `prompt` or `messages` must be given.")
