"""Requests with known ids, sent open loop: on schedule, never waiting for answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from aiokafka import AIOKafkaProducer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, durable_producer
from schemas.messages import Request


class SendLog(Protocol):
    """Where each send is noted (the chaos ledger)."""

    def record_sent(self, request_id: str, at: float) -> None: ...


class Traffic:
    """Open-loop producer of requests with known ids (`RUNID-0000001`, ...), acks=all and idempotent."""

    def __init__(self, settings: KafkaSettings, model: str, log: SendLog, run_id: str) -> None:
        self._topic = Topics(settings.topic_prefix).requests(model)
        self._model = model
        self._log = log
        self._run_id = run_id
        self._next = 0
        self._producer = AIOKafkaProducer(
            **durable_producer(),
            linger_ms=5,
            request_timeout_ms=120_000,
            **client_options(settings),
        )
        self._pending: list[asyncio.Future[Any]] = []
        self.placement: dict[str, tuple[tuple[str, int], int]] = {}
        """Where each request landed: ((topic, partition), offset), once the broker acknowledged it."""

    async def start(self) -> None:
        await self._producer.start()

    def new_id(self) -> str:
        self._next += 1
        return f"{self._run_id}-{self._next:07d}"

    async def send(
        self, text: str = "chaos", *, timeout_ms: int | None = None, request_id: str | None = None, warmup: bool = False
    ) -> str:
        request_id = request_id or self.new_id()
        req = Request(id=request_id, model=self._model, text=text, timeout_ms=timeout_ms, warmup=warmup)
        delivery = await self._producer.send(self._topic, msgspec.json.encode(req), key=request_id.encode())
        self._log.record_sent(request_id, time.time())
        delivery.add_done_callback(lambda f, rid=request_id: self._placed(rid, f))
        self._pending.append(delivery)
        return request_id

    def _placed(self, request_id: str, delivery: asyncio.Future[Any]) -> None:
        if not delivery.cancelled() and delivery.exception() is None:
            meta = delivery.result()
            self.placement[request_id] = ((meta.topic, meta.partition), meta.offset)

    async def open_loop(
        self,
        count: int,
        rate_rps: float,
        *,
        timeout_ms: int | None = None,
        text_for: Callable[[int], str] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> list[str]:
        """Send `count` requests at `rate_rps` on a fixed schedule (arrivals do not wait for answers),
        or fewer if `until()` turns true first."""
        ids: list[str] = []
        start = time.monotonic()
        for i in range(count):
            if until is not None and until():
                break
            delay = start + i / rate_rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            text = text_for(i) if text_for is not None else "chaos"
            ids.append(await self.send(text, timeout_ms=timeout_ms))
        return ids

    async def flush(self) -> None:
        """Wait until every send so far is acknowledged by the broker (raises on a lost send)."""
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)

    async def stop(self) -> None:
        await self.flush()
        await self._producer.stop()
