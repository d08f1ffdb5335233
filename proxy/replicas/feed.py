"""The write-behind and read side of shared memories: one bounded Redis stream.

Writing: entries journaled while a request is canonicalized (or its reply recorded) are flushed by
a task scheduled on the spot, one ``XADD`` per batch, while the request goes on to its backend; the
request never waits for it. The stream keeps at most ``max_entries`` batches (approximate trimming)
and expires ``ttl_s`` after the last write.

Reading: a background task blocks on ``XREAD`` for what the other replicas write and applies it as
it arrives (its own batches, tagged with its replica id, are skipped), typically within a
millisecond: before the client has sent the next turn of the conversation whose reply was just
relayed. At start a replica first reads the newest ``warm_entries`` batches, so a replica that
joins (a scale-up, a restart) knows what the others learned.

Redis down, slow, or failing over: batches that cannot be written are dropped (counted), the
reader retries after a pause; the requests are served as a single replica would serve them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from proxy.replicas.memories import Entry, Journal
from proxy.sessions import RedisClient, drop_connections

logger = logging.getLogger("prefix_proxy.shared")

# Journal entries per XADD at most (a burst of requests is written in several batches).
MAX_BATCH = 512


class RedisFeed:
    def __init__(
        self,
        writer: RedisClient,
        reader: RedisClient,
        key: str,
        journal: Journal,
        apply: Callable[[list[Entry]], int],
        *,
        max_entries: int = 100_000,
        ttl_s: int = 7 * 24 * 3600,
        block_ms: int = 1000,
        warm_entries: int = 10_000,
        retry_after_failure_s: float = 1.0,
        counter: Counter | None = None,
    ) -> None:
        self._writer = writer
        # Its own client: a blocking read holds a connection for block_ms, past the store's timeout.
        self._reader = reader
        self._key = key
        self._journal = journal
        self._apply = apply
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._block_ms = block_ms
        self._warm_entries = warm_entries
        self._retry_s = retry_after_failure_s
        self.replica_id = os.urandom(8).hex()
        self._flush_task: asyncio.Task[None] | None = None
        self._failing = False
        # By direction: published, applied (others' entries), dropped (not written while Redis failed).
        self.entries = counter or Counter(
            "prefix_proxy_shared_memory_entries", "Shared memory entries", ["direction"], registry=CollectorRegistry()
        )
        journal.on_entry = self._schedule_flush

    def _schedule_flush(self) -> None:
        if self._flush_task is not None and not self._flush_task.done():
            return  # the pending flush takes this entry too
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a tool outside the app): the entry waits for the next flush
        self._flush_task = loop.create_task(self.flush())

    async def flush(self) -> None:
        # Yield once, so entries journaled by the same request (or by requests in the same tick)
        # leave in one batch.
        await asyncio.sleep(0)
        while self._journal.entries:
            entries = self._journal.drain()
            for start in range(0, len(entries), MAX_BATCH):
                await self._publish(entries[start : start + MAX_BATCH])

    async def _publish(self, entries: list[Entry]) -> None:
        try:
            async with self._writer.pipeline(transaction=False) as pipe:
                pipe.xadd(
                    self._key,
                    {"r": self.replica_id, "e": orjson.dumps(entries)},
                    maxlen=self._max_entries,
                    approximate=True,
                )
                pipe.expire(self._key, self._ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self.entries.labels("dropped").inc(len(entries))
            if not self._failing:
                self._failing = True
                logger.warning("shared memory: cannot write to Redis (%s); replicas learn alone", type(exc).__name__)
                with contextlib.suppress(Exception):
                    await drop_connections(self._writer)
            return
        if self._failing:
            self._failing = False
            logger.warning("shared memory: writing to Redis again")
        self.entries.labels("published").inc(len(entries))

    async def aclose(self) -> None:
        """Write what is still journaled, then let the connections go."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), timeout=2.0)
        await self._reader.aclose()
        await self._writer.aclose()

    async def run(self) -> None:
        """Apply the other replicas' entries until cancelled."""
        last_id = await self._warm_up()
        while True:
            try:
                batches: Any = await self._reader.xread({self._key: last_id}, count=1000, block=self._block_ms)
            except (RedisError, OSError):
                with contextlib.suppress(Exception):
                    await drop_connections(self._reader)
                await asyncio.sleep(self._retry_s)
                continue
            for _, records in batches or ():
                for record_id, fields in records:
                    last_id = record_id
                    self._receive(fields)

    async def _warm_up(self) -> str:
        while True:
            try:
                records: Any = await self._reader.xrevrange(self._key, count=self._warm_entries)
                break
            except (RedisError, OSError):
                await asyncio.sleep(self._retry_s)
        for _, fields in reversed(records):
            self._receive(fields)
        return str(records[0][0]) if records else "0-0"

    def _receive(self, fields: Any) -> None:
        if not isinstance(fields, dict) or fields.get("r") == self.replica_id:
            return
        try:
            entries = orjson.loads(fields.get("e") or b"[]")
        except orjson.JSONDecodeError:
            return
        if isinstance(entries, list):
            self.entries.labels("applied").inc(self._apply(entries))
