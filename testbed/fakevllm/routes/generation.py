"""``/v1/chat/completions`` and ``/v1/completions``: the routes that run the engine.

Each handler validates (``RequestChecks``), makes a ``Job`` (prompt ids and the fake model's
reply), then runs it to completion or streams it (``JobRunner``). ``generate_chat`` is also
where ``/v1/messages`` and ``/v1/responses`` end up once converted, as in vLLM.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from testbed.fakevllm import chat
from testbed.fakevllm import responses as bodies
from testbed.fakevllm.intake import completion_prompt, read_model, render, require_leading_system
from testbed.fakevllm.protocol import ChatCompletionRequest, CompletionRequest, Rejected
from testbed.fakevllm.replies import plan_reply
from testbed.fakevllm.requestlog import RequestRecord
from testbed.fakevllm.routes.checks import RequestChecks, rejected
from testbed.fakevllm.runner import Job, JobRunner
from testbed.fakevllm.toolcalls import ToolMode, parse_output, stream_deltas


class GenerationRoutes:
    """The OpenAI generation endpoints; handlers are ``async (request) -> Response``."""

    def __init__(self, checks: RequestChecks, runner: JobRunner) -> None:
        self.checks = checks
        self.runner = runner
        self.engine = runner.engine
        self.config = runner.config
        self.response_model = runner.response_model

    async def chat_completions(self, request: Request) -> Response:
        record = self.checks.new_record(request, "/v1/chat/completions")
        try:
            record.body, req = await read_model(request, ChatCompletionRequest)
        except Rejected as exc:
            return rejected(record, exc)
        return await self.generate_chat(record, req)

    async def generate_chat(self, record: RequestRecord, req: ChatCompletionRequest) -> Response:
        """A chat completion; also what /v1/messages and /v1/responses convert their requests to."""
        checks, runner = self.checks, self.runner
        try:
            await checks.check_generation(record, req)
            mode = chat.tool_mode(req)
            prompt_text = render(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message)
            if not self.config.system_anywhere:
                require_leading_system(req.messages)
            prompt_ids = self.engine.tokenizer.encode(prompt_text)
            max_tokens = checks.check_length(len(prompt_ids), req.requested_max_tokens)
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
            # n samples, as vLLM generates them (the fake's are alike), each its completion tokens.
            choices = req.n or 1
            usage = runner.usage(job, job.num_sampled * choices)
            completion = bodies.chat_completion(
                job.completion_id, job.created, self.response_model, message, reason, usage
            )
            completion["choices"] = [{**completion["choices"][0], "index": i} for i in range(choices)]
            return JSONResponse(completion)

        options = req.stream_options
        deltas = stream_deltas(parsed, job.generation.token_texts, call_ids)
        continuous = bool(options and options.continuous_usage_stats)
        chunks = _ChatChunks(runner, job, deltas, mode, continuous)
        include_usage = bool(options and options.include_usage)
        return runner.stream(
            job, chunks.token, opening=chunks.opening, include_usage=include_usage, chunk_object="chat.completion.chunk"
        )

    async def completions(self, request: Request) -> Response:
        checks, runner = self.checks, self.runner
        record = checks.new_record(request, "/v1/completions")
        try:
            record.body, req = await read_model(request, CompletionRequest)
            await checks.check_generation(record, req)
            if req.echo:
                raise Rejected(400, "echo is not supported by the fake backend")
            prompt_text, prompt_ids = completion_prompt(self.engine.tokenizer, req)
            max_tokens = checks.check_length(len(prompt_ids), req.max_tokens)
        except Rejected as exc:
            return rejected(record, exc)

        raw_reply = plan_reply(prompt_text).text
        job = runner.make_job(
            record, prompt_text, prompt_ids, raw_reply, max_tokens, req.cache_salt, req.fake_options, "cmpl"
        )
        if not req.stream:
            await runner.run_to_completion(job)
            generation = job.generation
            choices = req.n or 1
            usage = runner.usage(job, job.num_sampled * choices)
            completion = bodies.text_completion(
                job.completion_id,
                job.created,
                self.response_model,
                generation.text,
                generation.finish_reason,
                usage,
            )
            completion["choices"] = [{**completion["choices"][0], "index": i} for i in range(choices)]
            return JSONResponse(completion)

        options = req.stream_options
        continuous = bool(options and options.continuous_usage_stats)
        chunks = _TextChunks(runner, job, continuous)
        include_usage = bool(options and options.include_usage)
        return runner.stream(job, chunks.token, include_usage=include_usage, chunk_object="text_completion")


class _ChatChunks:
    """The chunks of a streamed chat completion, as vLLM's chat server sends them: the role
    chunk, then a chunk per token that the tool-call parser lets through, the last one with
    the finish reason. ``continuous``: every chunk carries the usage so far."""

    def __init__(
        self, runner: JobRunner, job: Job, deltas: list[dict[str, Any] | None], mode: ToolMode, continuous: bool
    ) -> None:
        self.runner = runner
        self.job = job
        self.model = runner.response_model
        self.deltas = deltas
        self.last = len(deltas) - 1
        self.mode = mode
        self.continuous = continuous
        self.tools_streamed = False

    def opening(self) -> list[dict[str, Any]]:
        job = self.job
        usage = self.runner.usage(job, 0) if self.continuous else None  # after the prefill: cached tokens known
        return [bodies.chat_chunk(job.completion_id, job.created, self.model, chat.ROLE_DELTA, None, usage)]

    def token(self, index: int, usage: dict[str, Any]) -> dict[str, Any] | None:
        delta = self.deltas[index]
        if delta is None:  # vLLM's parser held this token back: no chunk, unless it is the last
            if index != self.last:
                return None
            delta = {} if self.tools_streamed else {"content": ""}
        self.tools_streamed = self.tools_streamed or bool(delta.get("tool_calls"))
        reason = None
        if index == self.last:
            reason = chat.stream_finish_reason(self.tools_streamed, self.mode, self.job.generation.finish_reason)
        job = self.job
        return bodies.chat_chunk(
            job.completion_id, job.created, self.model, delta, reason, usage if self.continuous else None
        )


class _TextChunks:
    """The chunks of a streamed text completion: one per token, the last with the finish reason."""

    def __init__(self, runner: JobRunner, job: Job, continuous: bool) -> None:
        self.job = job
        self.model = runner.response_model
        self.last = job.num_sampled - 1
        self.continuous = continuous

    def token(self, index: int, usage: dict[str, Any]) -> dict[str, Any] | None:
        job = self.job
        reason = job.generation.finish_reason if index == self.last else None
        text = job.generation.token_texts[index]
        return bodies.text_completion_chunk(
            job.completion_id, job.created, self.model, text, reason, usage if self.continuous else None
        )
