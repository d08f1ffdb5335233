"""RelayResponse: the body raced against the client's disconnect and the deadline, as plain asyncio tasks.

How a stream ends is told (``on_end``), the upstream is closed and the background step runs however it
ended; a cancelled request (the server stopping) stops the body too and is not swallowed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.http.streaming import RelayResponse

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.ends: list[str] = []
        self.closed = 0
        self.background = 0
        self.body_stopped = False

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def close(self) -> None:
        self.closed += 1

    async def after(self) -> None:
        self.background += 1

    def response(self, body: AsyncIterator[bytes], deadline_s: float | None = None) -> RelayResponse:
        from starlette.background import BackgroundTask

        return RelayResponse(
            body,
            headers={},
            on_end=self.ends.append,
            close=self.close,
            deadline_s=deadline_s,
            deadline_event=b"event: error\n\n",
            background=BackgroundTask(self.after),
        )

    def bodies(self) -> list[bytes]:
        return [m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"]


def never_disconnects() -> Any:
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


async def chunks(recorder: Recorder, *parts: bytes, then_wait: bool = False) -> AsyncIterator[bytes]:
    try:
        for part in parts:
            yield part
        if then_wait:
            await asyncio.Event().wait()
    finally:
        recorder.body_stopped = True


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_a_whole_stream_is_sent_and_ends_sent_with_no_task_left_behind() -> None:
    async def scenario() -> tuple[Recorder, int]:
        recorder = Recorder()
        await recorder.response(chunks(recorder, b"a", b"b"), deadline_s=5)(SCOPE, never_disconnects(), recorder.send)
        await asyncio.sleep(0)  # the cancelled watch unwinds
        return recorder, len(asyncio.all_tasks()) - 1

    recorder, left = run(scenario())
    assert recorder.bodies() == [b"a", b"b", b""]
    assert (recorder.ends, recorder.closed, recorder.background, left) == (["sent"], 1, 1, 0)


def test_a_client_that_leaves_mid_stream_stops_the_body_at_once() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        await recorder.response(chunks(recorder, b"a", then_wait=True))(SCOPE, receive, recorder.send)
        return recorder

    recorder = run(asyncio.wait_for(scenario(), 5))
    assert recorder.bodies() == [b"a"]
    assert (recorder.ends, recorder.closed, recorder.background) == (["disconnected"], 1, 1)
    assert recorder.body_stopped


def test_other_messages_before_the_disconnect_are_read_past() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()
        messages = iter([{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}])

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(0.01)
            return next(messages)

        await recorder.response(chunks(recorder, then_wait=True))(SCOPE, receive, recorder.send)
        return recorder

    assert run(asyncio.wait_for(scenario(), 5)).ends == ["disconnected"]


def test_the_deadline_ends_the_stream_with_the_protocols_error_event() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()
        await recorder.response(chunks(recorder, b"a", then_wait=True), deadline_s=0.05)(
            SCOPE, never_disconnects(), recorder.send
        )
        return recorder

    recorder = run(asyncio.wait_for(scenario(), 5))
    assert recorder.bodies() == [b"a", b"event: error\n\n"]
    assert (recorder.ends, recorder.closed, recorder.background) == (["deadline"], 1, 1)
    assert recorder.body_stopped


def test_a_deadline_before_the_first_byte_still_sends_the_headers_then_the_event() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()
        await recorder.response(chunks(recorder, then_wait=True), deadline_s=0.02)(
            SCOPE, never_disconnects(), recorder.send
        )
        return recorder

    recorder = run(asyncio.wait_for(scenario(), 5))
    assert [m["type"] for m in recorder.sent] == ["http.response.start", "http.response.body"]
    assert recorder.ends == ["deadline"]


def test_a_send_that_fails_is_a_client_gone() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()

        async def send(message: dict[str, Any]) -> None:
            raise OSError("the client is gone")

        await recorder.response(chunks(recorder, b"a"))(SCOPE, never_disconnects(), send)
        return recorder

    recorder = run(asyncio.wait_for(scenario(), 5))
    assert (recorder.ends, recorder.closed, recorder.background) == (["disconnected"], 1, 1)


def test_a_cancelled_request_stops_the_body_closes_upstream_and_stays_cancelled() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()
        task = asyncio.ensure_future(
            recorder.response(chunks(recorder, b"a", then_wait=True))(SCOPE, never_disconnects(), recorder.send)
        )
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return recorder

    recorder = run(asyncio.wait_for(scenario(), 5))
    assert recorder.body_stopped
    assert (recorder.closed, recorder.background, recorder.ends) == (1, 1, ["sent"])


def test_an_error_reading_the_client_is_raised_not_taken_for_a_disconnect() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()

        async def receive() -> dict[str, Any]:
            raise RuntimeError("the read failed")

        with pytest.raises(RuntimeError):
            await recorder.response(chunks(recorder, then_wait=True))(SCOPE, receive, recorder.send)
        return recorder

    recorder = run(asyncio.wait_for(scenario(), 5))
    assert recorder.body_stopped and recorder.closed == 1
