"""Dynamic batching: concurrent requests with compatible options are merged into one model call.

Requests wait in a queue; one worker thread owns the model. It takes the oldest request, adds every waiting
request with the same options key (layers, site, combine, pool, level, ...) while the merged batch stays within
``max_batch_tokens`` (estimated from characters) and ``max_batch_texts``, runs one ``Extractor`` call and hands
each request its slice of the result. The event loop only awaits futures, so it never blocks on the model.

There is no batching window: a lone request starts as soon as the worker is free (it sleeps on a condition, never
on a timer), and requests that arrive while the model runs are merged into the next call. A bounded wait for
requests still being read or answered by the event loop was tried and measured (8 and 64 closed-loop clients,
MiniLM on 2 cores): no throughput gain, so there is none. Results go back with one event-loop wake-up per batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)  # the options key: requests with equal keys may share a model call


@dataclass
class Job(Generic[K]):
    """One request: its options key, its items (texts or word lists) and the future its caller awaits."""

    key: K
    items: list
    cost: int  # estimated tokens
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)


class QueueFull(Exception):
    """The queue holds ``max_queue_tokens`` already: ``queued`` tokens wait, ``retry_after`` seconds is a fair wait."""

    def __init__(self, queued: int, limit: int, retry_after: int):
        super().__init__(f"{queued} tokens are queued (limit {limit})")
        self.queued, self.limit, self.retry_after = queued, limit, retry_after


class Batcher(Generic[K]):
    """Queue + worker thread. ``run(key, items) -> list`` is the blocking model call for one merged batch.

    The queue is bounded: a request that would take the queued work past ``max_queue_tokens`` (estimated tokens)
    raises :class:`QueueFull` at once instead of waiting. A request whose caller has gone (its future cancelled) is
    dropped before it reaches the model.
    """

    def __init__(self, run: Callable[[K, list], list], *, max_batch_tokens: int = 16384, max_batch_texts: int = 512,
                 on_batch: Callable[[int, int, int, float], None] | None = None,
                 max_queue_tokens: int | None = None):
        self._run = run
        self.max_tokens, self.max_texts = max_batch_tokens, max_batch_texts
        self.max_queue_tokens = max_queue_tokens
        self.queued_tokens = 0  # estimated tokens waiting (not yet taken by the worker)
        self.tokens_per_second = 0.0  # the worker's recent rate, for Retry-After
        self._on_batch = on_batch
        self._queue: deque[Job[K]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="layerwise-batcher", daemon=True)
        self._thread.start()

    async def submit(self, key: K, items: list, cost: int) -> Any:
        """Queue ``items`` and wait for their results.

        Raises:
            QueueFull: the queued work would pass ``max_queue_tokens`` (a lone request always gets in).
        """
        loop = asyncio.get_running_loop()
        job = Job(key, items, cost, loop.create_future(), loop)
        with self._cv:
            self._drop_cancelled()
            limit = self.max_queue_tokens
            if limit is not None and self._queue and self.queued_tokens + cost > limit:
                rate = self.tokens_per_second or 1000.0
                raise QueueFull(self.queued_tokens, limit, max(1, int(self.queued_tokens / rate) + 1))
            self._queue.append(job)
            self.queued_tokens += cost
            self._cv.notify()
        try:
            return await job.future
        except asyncio.CancelledError:  # the caller went away: its tokens leave the queue now, not when it is reached
            with self._cv:
                if job in self._queue:
                    self._queue.remove(job)
                    self.queued_tokens -= job.cost
            raise

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def _drop_cancelled(self) -> None:
        """Jobs whose caller has gone leave the queue (call with the lock held)."""
        for job in [j for j in self._queue if j.future.cancelled()]:
            self._queue.remove(job)
            self.queued_tokens -= job.cost

    def _take(self) -> list[Job[K]]:
        """The oldest job and every queued job compatible with it that fits the batch budget (jobs whose caller
        has gone are dropped here, before any compute)."""
        self._drop_cancelled()
        if not self._queue:
            return []
        first = self._queue.popleft()
        batch, tokens, texts = [first], first.cost, len(first.items)
        rest: deque[Job[K]] = deque()
        while self._queue:
            job = self._queue.popleft()
            if (job.key == first.key and tokens + job.cost <= self.max_tokens
                    and texts + len(job.items) <= self.max_texts):
                batch.append(job)
                tokens += job.cost
                texts += len(job.items)
            else:
                rest.append(job)
        self._queue.extendleft(reversed(rest))
        self.queued_tokens -= sum(j.cost for j in batch)
        return batch

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch = self._take()
            if not batch:
                continue
            items = [item for job in batch for item in job.items]
            t0 = time.perf_counter()
            results: list = []
            error: Exception | None = None
            try:
                results = self._run(batch[0].key, items)
            except Exception as exc:  # handed to every request of the batch; the worker keeps serving
                error = exc
            seconds = time.perf_counter() - t0
            cost = sum(j.cost for j in batch)
            self.tokens_per_second = cost / seconds if seconds > 0 else self.tokens_per_second
            if self._on_batch is not None:
                self._on_batch(len(batch), len(items), sum(j.cost for j in batch), seconds)
            # one wake-up of each event loop per batch (not one per request): it resolves all of that loop's futures
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, Exception | None]]] = {}
            start = 0
            for job in batch:
                n = len(job.items)
                outcome = (None, error) if error is not None else (results[start : start + n], None)
                by_loop.setdefault(job.loop, []).append((job.future, *outcome))
                start += n
            for loop, outcomes in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_resolve, outcomes)
                except RuntimeError:  # that loop is closed: nobody is waiting any more
                    pass


def _resolve(outcomes: list[tuple[asyncio.Future, Any, Exception | None]]) -> None:
    for future, value, error in outcomes:
        if future.done():  # the client went away
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
