"""One generation request from admission to release, streamed or not.

Timeline, as vLLM's: wait for KV blocks -> prefill (sleep for the uncached prompt tokens) ->
first token (TTFT) -> one token per ``seconds_per_token`` -> cache prompt + output blocks and
free them. A stream cut short by the client (or by ``fake_options.abort_after_chunks``) still
releases its blocks, caching what was computed so far, as vLLM does for an aborted request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from testbed.fakevllm import responses as bodies
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.engine import Admission, FakeEngine, Generation, generate
from testbed.fakevllm.protocol import FakeOptions
from testbed.fakevllm.requestlog import RequestRecord

ChunkFactory = Callable[[int, dict[str, Any]], dict[str, Any] | None]


class StreamAborted(Exception):
    """Raised inside a stream to drop the connection (``fake_options.abort_after_chunks``).

    Raising out of the ASGI app is the only way to make the server cut the connection
    mid-body, which is what a crashed upstream looks like to the proxy.
    """


@dataclass
class Job:
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

    @property
    def num_sampled(self) -> int:
        return len(self.generation.token_ids)


class JobRunner:
    def __init__(self, engine: FakeEngine, config: FakeBackendConfig, response_model: str) -> None:
        self.engine = engine
        self.config = config
        self.response_model = response_model
        _install_abort_log_filter()

    def make_job(
        self,
        record: RequestRecord,
        prompt_text: str,
        prompt_ids: list[int],
        raw_reply: str,
        max_tokens: int,
        cache_salt: str | None,
        options: FakeOptions | None,
        id_prefix: str,
    ) -> Job:
        record.prompt_text = prompt_text
        record.prompt_token_ids.extend(prompt_ids)
        per_token = self.config.seconds_per_output_token
        abort_after = None
        if options is not None:
            raw_reply = options.reply if options.reply is not None else raw_reply
            per_token = options.chunk_delay_s if options.chunk_delay_s is not None else per_token
            abort_after = options.abort_after_chunks
        return Job(
            record=record,
            prompt_ids=prompt_ids,
            cache_salt=cache_salt,
            generation=generate(self.engine.tokenizer, raw_reply, max_tokens),
            seconds_per_token=per_token,
            abort_after=abort_after,
            started_at=time.monotonic(),
            completion_id=f"{id_prefix}-{bodies.random_id()}",
            created=bodies.now(),
        )

    def usage(self, job: Job, completion_tokens: int) -> dict[str, Any]:
        return bodies.usage(
            len(job.prompt_ids), completion_tokens, job.record.cached_tokens, self.config.zero_cached_tokens_details
        )

    async def run_to_completion(self, job: Job) -> None:
        sampled: list[int] = []
        try:
            admission = await self._prefill(job)
            try:
                await _sleep(job.seconds_per_token * (job.num_sampled - 1))
                sampled = job.generation.token_ids
            finally:
                reason = job.generation.finish_reason if sampled else "abort"
                self.engine.finish(admission, sampled, reason, job.started_at)
        finally:
            _finish_record(job, len(sampled), "completed" if sampled else "cancelled")

    def stream(
        self,
        job: Job,
        token_chunk: ChunkFactory,
        *,
        opening: Callable[[], list[dict[str, Any]]] = list,
        include_usage: bool,
        chunk_object: str,
    ) -> StreamingResponse:
        """SSE: ``opening`` chunks once the first token exists, then ``token_chunk(i, usage)``
        for each sampled token (``None`` sends nothing), the usage chunk, ``[DONE]``."""
        events = self._events(job, token_chunk, opening, include_usage, chunk_object)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(
        self,
        job: Job,
        token_chunk: ChunkFactory,
        opening: Callable[[], list[dict[str, Any]]],
        include_usage: bool,
        chunk_object: str,
    ) -> AsyncIterator[str]:
        streams = self.engine.streams  # a /fake/reset mid-stream must not skew the new counters
        streams.active_streams += 1
        state = "cancelled"  # unless we get to the end: the client went away
        sent_tokens = 0
        events_sent = 0
        admission: Admission | None = None

        def gate() -> None:
            nonlocal events_sent
            if job.abort_after is not None and events_sent >= job.abort_after:
                raise StreamAborted
            events_sent += 1

        try:
            admission = await self._prefill(job)
            for chunk in opening():
                gate()
                yield bodies.sse(chunk)
            for index in range(job.num_sampled):
                if index:
                    await _sleep(job.seconds_per_token)
                sent_tokens = index + 1
                token = token_chunk(index, self.usage(job, sent_tokens))
                if token is not None:
                    gate()
                    yield bodies.sse(token)
            if include_usage:
                gate()
                usage = self.usage(job, sent_tokens)
                yield bodies.sse(
                    bodies.usage_chunk(job.completion_id, job.created, self.response_model, usage, chunk_object)
                )
            gate()
            yield bodies.SSE_DONE
            state = "completed"
        except StreamAborted:
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
                reason = job.generation.finish_reason if sent_tokens == job.num_sampled else "abort"
                self.engine.finish(admission, job.generation.token_ids[:sent_tokens], reason, job.started_at)
            _finish_record(job, sent_tokens, state)

    async def _prefill(self, job: Job) -> Admission:
        admission = await self.engine.admit(job.prompt_ids, job.cache_salt)
        job.record.cached_tokens = admission.cached_tokens
        try:
            uncached = len(job.prompt_ids) - admission.cached_tokens
            await _sleep(self.config.prefill_seconds_per_token * uncached)
        except BaseException:
            self.engine.finish(admission, [], "abort", job.started_at)
            raise
        ttft = time.monotonic() - job.started_at
        job.record.ttft_s = ttft
        self.engine.first_token(len(job.prompt_ids), ttft)
        return admission


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


def _finish_record(job: Job, sent_tokens: int, state: str) -> None:
    record = job.record
    record.state = state
    record.completion_tokens = sent_tokens
    record.output_text = "".join(job.generation.token_texts[:sent_tokens])
    record.finish_reason = job.generation.finish_reason if state == "completed" else "abort"


class _QuietIntendedAborts(logging.Filter):
    """Keep the server log free of tracebacks for aborts a test asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        while error is not None:
            if isinstance(error, StreamAborted):
                return False
            if isinstance(error, BaseExceptionGroup):
                return not any(isinstance(e, StreamAborted) for e in error.exceptions)
            error = error.__cause__ or error.__context__
        return True


def _install_abort_log_filter() -> None:
    server_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietIntendedAborts) for f in server_log.filters):
        server_log.addFilter(_QuietIntendedAborts())
