"""The fake vLLM OpenAI-compatible server (FastAPI): routes and request checks.

Pipeline per generation request, as in vLLM: validate -> render the chat template ->
tokenize -> admit into the prefix-cache model (hit = ``cached_tokens``) -> sleep for the
uncached prefill -> emit the fake model's tokens -> cache prompt + output blocks -> free.

Test-only surface (not in vLLM): the ``fake_options`` body field (see ``FakeOptions``) and the
``/fake/*`` endpoints in ``hooks``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from proxy.fakebackend import chat
from proxy.fakebackend import responses as bodies
from proxy.fakebackend.config import FakeBackendConfig
from proxy.fakebackend.embeddings import embed, to_base64, truncate_and_normalize
from proxy.fakebackend.engine import FakeEngine
from proxy.fakebackend.hooks import add_test_hooks
from proxy.fakebackend.intake import (
    completion_prompt,
    embedding_inputs,
    read_model,
    render,
    require_leading_system,
    tokenize_text,
)
from proxy.fakebackend.metrics import CONTENT_TYPE
from proxy.fakebackend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    FakeOptions,
    Rejected,
    TokenizeRequest,
    error_response,
)
from proxy.fakebackend.replies import plan_reply
from proxy.fakebackend.requestlog import RequestRecord
from proxy.fakebackend.runner import JobRunner
from proxy.fakebackend.tokenizer import ChatTokenizer
from proxy.fakebackend.toolcalls import parse_output, stream_deltas

# Headers worth keeping in the request log; the rest is transport noise.
_DROPPED_HEADERS = frozenset({"content-length", "connection", "accept-encoding", "host"})


def create_app(config: FakeBackendConfig | None = None, *, tokenizer: ChatTokenizer | None = None) -> FastAPI:
    """A fresh fake backend (its own cache, metrics registry and request log)."""
    config = config or FakeBackendConfig()
    engine = FakeEngine(config, tokenizer)
    served_names = config.model_names
    response_model = served_names[0]  # vLLM answers with its first served name
    runner = JobRunner(engine, config, response_model)
    app = FastAPI(title="prefix-proxy fake vLLM backend", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.config = config

    # -- request checks ----------------------------------------------------------------------

    def new_record(request: Request, endpoint: str) -> RequestRecord:
        headers = {k: v for k, v in request.headers.items() if k not in _DROPPED_HEADERS}
        record = RequestRecord(request_id=bodies.random_id(), endpoint=endpoint, body=None, headers=headers)
        return engine.log.add(record)

    def rejected(record: RequestRecord, exc: Rejected) -> JSONResponse:
        record.status_code = exc.status
        record.state = "error"
        record.error = exc.message
        return exc.response()

    async def apply_fake_options(options: FakeOptions | None) -> None:
        if options is None:
            return
        if options.delay_s > 0:
            await asyncio.sleep(options.delay_s)
        if options.status is not None:
            message = options.error_message or f"fake backend error {options.status}"
            raise Rejected(options.status, message, options.error_type)

    def check_model(model: str | None, record: RequestRecord) -> None:
        record.model = model
        if model is not None and model not in served_names:
            raise Rejected(404, f"The model `{model}` does not exist.", "NotFoundError")

    def check_length(num_prompt_tokens: int, max_tokens: int | None) -> int:
        """vLLM's context-length validation; returns the effective max_tokens."""
        limit = config.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise Rejected(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt_tokens} tokens in the messages, Please reduce the length of the messages.",
                )
            max_tokens = limit - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > limit:
            raise Rejected(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens + num_prompt_tokens} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            )
        fit_error = engine.check_fits(num_prompt_tokens)
        if fit_error:
            raise Rejected(400, fit_error)
        return max_tokens

    def check_generation_params(n: int | None, stream: bool | None, has_stream_options: bool) -> None:
        if n is not None and n != 1:
            raise Rejected(400, "The fake backend only supports n=1.", param="n")
        if has_stream_options and not stream:
            raise Rejected(400, "Stream options can only be defined when `stream=True`.")

    # -- OpenAI endpoints --------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        record = new_record(request, "/v1/chat/completions")
        try:
            record.body, req = await read_model(request, ChatCompletionRequest)
            record.stream = bool(req.stream)
            await apply_fake_options(req.fake_options)
            check_model(req.model, record)
            check_generation_params(req.n, req.stream, req.stream_options is not None)
            mode = chat.tool_mode(req)
            prompt_text = render(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message)
            if not config.system_anywhere:
                require_leading_system(req.messages)
            prompt_ids = engine.tokenizer.encode(prompt_text)
            max_tokens = check_length(len(prompt_ids), req.requested_max_tokens)
        except Rejected as exc:
            return rejected(record, exc)

        raw_reply = chat.reply_text(prompt_text, mode, req.named_tool, req.tools)
        job = runner.make_job(
            record, prompt_text, prompt_ids, raw_reply, max_tokens, req.cache_salt, req.fake_options, "chatcmpl"
        )
        parsed = parse_output(job.generation.text, mode, req.named_tool)
        call_ids = [bodies.tool_call_id() for _ in parsed.tool_calls]

        if not req.stream:
            await runner.run_to_completion(job)
            message = bodies.chat_message(parsed, call_ids)
            reason = chat.finish_reason(parsed, mode, job.generation.finish_reason)
            usage = runner.usage(job, job.num_sampled)
            return JSONResponse(
                bodies.chat_completion(job.completion_id, job.created, response_model, message, reason, usage)
            )

        deltas = stream_deltas(parsed, job.generation.token_texts, call_ids)
        last = len(deltas) - 1
        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        tools_streamed = False

        def opening() -> list[dict[str, Any]]:
            usage = runner.usage(job, 0) if continuous else None
            return [bodies.chat_chunk(job.completion_id, job.created, response_model, chat.ROLE_DELTA, None, usage)]

        def token_chunk(index: int, usage: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal tools_streamed
            delta = deltas[index]
            if delta is None:  # vLLM's parser held this token back: no chunk, unless it is the last
                if index != last:
                    return None
                delta = {} if tools_streamed else {"content": ""}
            tools_streamed = tools_streamed or bool(delta.get("tool_calls"))
            reason = None
            if index == last:
                reason = chat.stream_finish_reason(tools_streamed, mode, job.generation.finish_reason)
            return bodies.chat_chunk(
                job.completion_id, job.created, response_model, delta, reason, usage if continuous else None
            )

        include_usage = bool(options and options.include_usage)
        return runner.stream(
            job, token_chunk, opening=opening, include_usage=include_usage, chunk_object="chat.completion.chunk"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        record = new_record(request, "/v1/completions")
        try:
            record.body, req = await read_model(request, CompletionRequest)
            record.stream = bool(req.stream)
            await apply_fake_options(req.fake_options)
            check_model(req.model, record)
            check_generation_params(req.n, req.stream, req.stream_options is not None)
            if req.echo:
                raise Rejected(400, "echo is not supported by the fake backend")
            prompt_text, prompt_ids = completion_prompt(engine.tokenizer, req)
            max_tokens = check_length(len(prompt_ids), req.max_tokens)
        except Rejected as exc:
            return rejected(record, exc)

        raw_reply = plan_reply(prompt_text).text
        job = runner.make_job(
            record, prompt_text, prompt_ids, raw_reply, max_tokens, req.cache_salt, req.fake_options, "cmpl"
        )
        if not req.stream:
            await runner.run_to_completion(job)
            generation = job.generation
            usage = runner.usage(job, job.num_sampled)
            return JSONResponse(
                bodies.text_completion(
                    job.completion_id, job.created, response_model, generation.text, generation.finish_reason, usage
                )
            )

        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        last = job.num_sampled - 1

        def token_chunk(index: int, usage: dict[str, Any]) -> dict[str, Any] | None:
            reason = job.generation.finish_reason if index == last else None
            text = job.generation.token_texts[index]
            return bodies.text_completion_chunk(
                job.completion_id, job.created, response_model, text, reason, usage if continuous else None
            )

        include_usage = bool(options and options.include_usage)
        return runner.stream(job, token_chunk, include_usage=include_usage, chunk_object="text_completion")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        record = new_record(request, "/v1/embeddings")
        try:
            record.body, req = await read_model(request, EmbeddingRequest)
            check_model(req.model, record)
            inputs = embedding_inputs(engine.tokenizer, req.input)
        except Rejected as exc:
            return rejected(record, exc)
        data = []
        for index, ids in enumerate(inputs):
            vector = embed(json.dumps(ids).encode(), config.embedding_dim)
            if req.dimensions is not None and req.dimensions < len(vector):
                vector = truncate_and_normalize(vector, req.dimensions)
            encoded: list[float] | str = to_base64(vector) if req.encoding_format == "base64" else vector
            data.append({"index": index, "object": "embedding", "embedding": encoded})
        record.state = "completed"
        total = sum(len(ids) for ids in inputs)
        usage = {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0, "prompt_tokens_details": None}
        return JSONResponse(
            {
                "id": f"embd-{bodies.random_id()}",
                "object": "list",
                "created": bodies.now(),
                "model": response_model,
                "data": data,
                "usage": usage,
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
            record.body, req = await read_model(request, TokenizeRequest)
            check_model(req.model, record)
            prompt_text, add_special = tokenize_text(req)
        except Rejected as exc:
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
        engine.cache.reset()  # refused (a no-op) while requests run, as in vLLM
        return Response(status_code=200)

    add_test_hooks(app, engine)
    return app
