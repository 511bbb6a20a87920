"""Getting every answer onto the broker in some form: the consumer never stops on a produce error.

Before a record is produced it is routed and fitted: an answer for a
client's reply topic that does not exist goes to the model's results topic
(saying why), and a record larger than its topic's `max.message.bytes` is
rebuilt smaller (`consumers.answers` knows how). What the broker still
refuses is handled per record:

- too large: the broker's limit is trusted from now on and the record is
  rebuilt to fit it, half the size at each further refusal;
- a reply topic that is unknown, forbidden, invalid or still failing after
  the producer's own retries: the answer goes to the results topic instead;
- anything else (the pipeline's own topics unavailable, the broker down):
  the same record again, with exponential backoff, for as long as it takes.
  Its offset is not committed meanwhile, so a restart loses nothing either.

Records that describe the others (`Message.revise`: a request's latency
event, which must say what its answer became, `error` if it had to shrink)
are rebuilt when prepared, and go out once the rest is accepted; inside a
transaction they go in the same attempt and are rebuilt on each retry.

Nothing here raises a produce error to the caller; the caller marks the
offsets answered once `deliver` returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import InvalidTopicError, KafkaError, TopicAuthorizationFailedError, UnknownTopicOrPartitionError

from consumers.clock import Clock, SystemClock
from pipeline.core.kafka.outbox import Failure, Message, Outbox, too_large
from pipeline.core.kafka.topic_limits import TopicLimits

log = logging.getLogger("batchtide.consumer")

REPLY_TOPIC_CHECK_S = 2.0
"""How long to wait for metadata of a request's reply topic before falling back."""
REPLY_TOPIC_RECHECK_S = 60.0
"""A reply topic found missing is not asked about again for this long."""
REPLY_TOPICS_REMEMBERED = 10_000
"""Reply topics whose state is cached (oldest forgotten first): hostile names cannot grow it without bound."""
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 30.0
"""Backoff between attempts at records no fallback can help (doubling, capped)."""


class Delivery:
    """Routes, fits and produces records; retries or rebuilds those the broker refuses."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        outbox: Outbox,
        limits: TopicLimits,
        own_topics: set[str],
        fallback_topic: str,
        clock: Clock | None = None,
    ) -> None:
        self._clock: Clock = clock or SystemClock()
        self._producer = producer
        self._outbox = outbox
        self._limits = limits
        self._own = own_topics
        self._fallback = fallback_topic
        self._reply_topics: dict[str, tuple[bool, float]] = {}
        """Reply topic -> (exists, when checked)."""
        self.retries = 0
        """Attempts that had to wait for the broker (visible in the consumer's stats)."""
        self.rebuilt = 0
        """Records rebuilt smaller or rerouted to the results topic."""

    async def deliver(self, messages: Sequence[Message]) -> None:
        """Return once every message (or its fallback) is on the broker; records that describe
        the others (`revise`) once those are, so they say what the others became."""
        first = [m for m in messages if m.revise is None]
        then = [m for m in messages if m.revise is not None]
        await self.until_accepted(first, self._outbox.publish)
        await self.until_accepted(then, self._outbox.publish)

    async def until_accepted(
        self,
        messages: Sequence[Message],
        send: Callable[[Sequence[Message]], Awaitable[list[Failure]]],
        *,
        all_or_nothing: bool = False,
    ) -> None:
        """Send with `send` until nothing is refused. `all_or_nothing`: a refusal undid the
        whole send (a transaction), so everything goes again, the refused ones replaced."""
        pending = [await self.prepared(m) for m in messages]
        delay = RETRY_FIRST_S
        while pending:
            failures = await send(pending)
            if not failures:
                return
            replacements: dict[int, Message] = {}
            stuck = False
            for message, error in failures:
                replacement = await self._recovered(message, error)
                stuck = stuck or replacement is message
                replacements[id(message)] = replacement
            if all_or_nothing:
                pending = [replacements.get(id(m), m) for m in pending]
                pending = [await self.prepared(m) if m.revise is not None else m for m in pending]
            else:
                pending = list(replacements.values())
            if stuck:
                self.retries += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def prepared(self, message: Message) -> Message:
        """Rebuilt as it stands now, routed to an existing topic and fitted under its limit, before
        the broker is asked."""
        if message.revise is not None:
            message = message.revise()
        if message.reroute is not None and message.topic not in self._own:
            why = await self._reply_topic_problem(message.topic)
            if why is not None:
                self.rebuilt += 1
                message = message.reroute(why)
        limit = await self._limits.limit(message.topic)
        if message.size > limit:
            return await self._shrunk(message, limit)
        return message

    async def _shrunk(self, message: Message, limit: int) -> Message:
        """`message` rebuilt under `limit`; an answer that cannot shrink enough leaves its reply
        topic; otherwise the record as it is (it will be retried, and logged)."""
        smaller = message.fit(limit) if message.fit is not None else message
        if smaller.size <= limit or (smaller.size < message.size and message.reroute is None):
            self.rebuilt += 1
            return smaller
        if message.reroute is not None:
            self.rebuilt += 1
            return await self.prepared(message.reroute(f"the answer is larger than its max.message.bytes ({limit})"))
        return message

    async def _recovered(self, message: Message, error: BaseException) -> Message:
        """What to send instead of a refused record (the record itself: wait and try again)."""
        if too_large(error):
            limit = min(await self._limits.limit(message.topic), message.size // 2)
            self._limits.lower(message.topic, limit)
            log.warning(
                "%s refused a %d-byte record as too large; rebuilding it under %d bytes",
                message.topic,
                message.size,
                limit,
            )
            return await self._shrunk(message, limit)
        if message.reroute is not None and isinstance(error, KafkaError):
            self._reply_topics[message.topic] = (False, self._clock.monotonic_s())
            log.warning("reply topic %s refused an answer (%r); it goes to %s", message.topic, error, self._fallback)
            self.rebuilt += 1
            return await self.prepared(message.reroute(_reason(error)))
        log.error(
            "producing to %s failed (%r); retrying with backoff, its offset is held meanwhile", message.topic, error
        )
        return message

    async def _reply_topic_problem(self, topic: str) -> str | None:
        """Why answers cannot go to `topic` (None: they can), from cached metadata."""
        known = self._reply_topics.get(topic)
        now = self._clock.monotonic_s()
        if known is not None and (known[0] or now - known[1] < REPLY_TOPIC_RECHECK_S):
            return None if known[0] else "does not exist or is not writable"
        try:
            exists = bool(await asyncio.wait_for(self._producer.partitions_for(topic), REPLY_TOPIC_CHECK_S))
            why = None if exists else "does not exist"
        except (TimeoutError, UnknownTopicOrPartitionError):
            exists, why = False, "does not exist"
        except KafkaError as e:
            exists, why = False, _reason(e)
        if not exists:
            log.warning("reply topic %r: %s; its answers go to %s", topic, why, self._fallback)
        self._reply_topics.pop(topic, None)
        self._reply_topics[topic] = (exists, now)
        if len(self._reply_topics) > REPLY_TOPICS_REMEMBERED:
            self._reply_topics.pop(next(iter(self._reply_topics)))
        return why


def _reason(error: BaseException) -> str:
    if isinstance(error, UnknownTopicOrPartitionError):
        return "does not exist"
    if isinstance(error, TopicAuthorizationFailedError):
        return "not authorized to write to it"
    if isinstance(error, InvalidTopicError):
        return "not a valid topic for answers"
    return f"refused the answer ({type(error).__name__})"
