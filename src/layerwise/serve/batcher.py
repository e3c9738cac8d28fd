"""Dynamic batching by depth, with fair turns: concurrent requests share forward passes, and none can stall the others.

Requests wait in a queue; one worker thread owns the model. Requests of the same group (one model and site) share a
call whatever else they ask (layers, combine, pool, level, precision, encoding): the worker takes the oldest request
and every queued request of its group within ``max_batch_tokens`` and ``max_batch_texts``, and the measured cost model
of :mod:`layerwise.serve.cost` cuts them by depth into segments. Each segment runs only to its deepest member's layer,
all segments' batches go through one pipeline (:meth:`Extractor.encode_shared
<layerwise.Extractor.encode_shared>`), and each request's layers are then combined, pooled and finished on their own.
A shallow request joins a deeper segment when its extra layers cost less than a part-filled batch of its own. Where
the runtime lets each row leave its batch at its own depth (``ragged``, PyTorch: :mod:`layerwise.model.ragged`), the
call can run as one segment instead, its batches as large as the budget allows, each request to its own depth: it
does where that is predicted cheaper, each way's predictions corrected by what that way's calls took
(:class:`~layerwise.serve.cost.WayCorrections`; a call's share of the throughput, the wall time from the previous
call's end). A call of several depths may also run whole, as one segment to its deepest depth: what it would cost
were every request at that depth.

A call runs one forward batch per step. A call that is larger than one batch budget (a single request over
``max_batch_tokens``) takes turns: once it has run for ``quantum`` seconds, the requests queued meanwhile start a call
of their own, and the running calls then alternate step by step. So a short request waits about one forward batch
behind a large request, not its whole run, while calls of merged ordinary requests run to their end (splitting them
would only make the calls smaller, and a call of 35 short texts is half as fast per text as one of 140 on a 2-core
CPU). A request whose caller has gone (its future cancelled) leaves the queue at once; a call none of whose requests
is still awaited stops between its batches.

There is no batching window: a lone request starts as soon as the worker is free (it sleeps on a condition, never
on a timer), and requests that arrive while the model runs are planned into the next call. Where the runtime runs
batches asynchronously, that next call does not wait for the running one to be reduced: once a call's last forward
batch is started (its step finishes nothing), the queued requests are tokenised and started behind it, so the runtime
never idles while the worker pools, combines and answers. Results go back with one event-loop wake-up per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

from .cost import CUT, WHOLE, CostModel, WayCorrections, plan, ragged_way

log = logging.getLogger("layerwise")

# one step of a merged call: (job index in the call, item index in the job, result)
Step = list[tuple[int, int, Any]]


@dataclass(eq=False)
class Job:
    """One request: its group (requests of one group may share a forward pass), depth, items, what the runner needs
    to encode them (``payload``, hashable: equal payloads are one spec in the metrics), its estimated tokens and the
    future its caller awaits."""

    group: Hashable
    depth: int
    items: list
    payload: Any
    cost: int  # estimated tokens (windows included)
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    results: list = field(default_factory=list)
    left: int = 0

    def gone(self) -> bool:
        """Whether nobody awaits this job any more (answered, failed or its caller cancelled)."""
        return self.future.done()


@dataclass(eq=False)
class Call:
    """A merged call in progress: its jobs, its steps (started on the first turn), its model time so far."""

    jobs: list[Job]
    segments: list[list[int]]  # job indices by depth segment (each run to its deepest member)
    ragged: bool = False  # one segment whose rows each leave their batch at their own job's depth
    chain: str = ""  # a ragged call: the runtime whose chain runs it ("": the runtime's own offer)
    steps: Iterator[Step] | None = None
    seconds: float = 0.0
    batches: int = 0
    alone: bool = False  # a job retried on its own after its merged call failed
    started: bool = False  # its last step finished nothing: its forward batch is running in the runtime
    way: str | None = None  # a call of several depths: CUT, WHOLE or a ragged way, as chosen (see WayCorrections)
    predicted: float = 0.0  # the cost model's seconds for it, when it was chosen
    taken: float = 0.0  # perf_counter() when it left the queue

    @property
    def tokens(self) -> int:
        return sum(j.cost for j in self.jobs)

    def shape(self) -> list[tuple[int, int]]:
        """``(estimated tokens, depth)`` of each segment (its deepest member's layer); of a ragged call, of each job
        (its batches are shared: see :meth:`CostModel.features <layerwise.serve.cost.CostModel.features>`)."""
        if self.ragged:
            return [(j.cost, j.depth) for j in self.jobs]
        return [(sum(self.jobs[j].cost for j in seg), max(self.jobs[j].depth for j in seg)) for seg in self.segments]

    def work(self) -> int:
        """Estimated tokens x layers the call runs: each segment's tokens through its deepest member's layer (each
        job's through its own in a ragged call)."""
        return sum(tokens * depth for tokens, depth in self.shape())

    def long(self, max_tokens: int) -> bool:
        """Whether the call is larger than one batch budget (it then takes turns with later requests)."""
        return self.tokens > max_tokens

    def abandoned(self) -> bool:
        """Whether every job still to be encoded has lost its caller."""
        waiting = [j for j in self.jobs if j.left > 0]
        return bool(waiting) and all(j.gone() for j in waiting)


@dataclass
class BatchStats:
    """What one finished call did, for the metrics: requests, texts, distinct payloads (specs), depth segments,
    estimated tokens, forward batches, the tokens x layers run (each segment to its depth) and those the requests
    needed (each to its own depth), seconds, and whether its rows left their batches at their own depth."""

    requests: int
    texts: int
    specs: int
    segments: int
    tokens: int
    batches: int
    computed: int
    needed: int
    seconds: float
    ragged: bool = False  # each row left its batches at its own request's depth


class QueueFull(Exception):
    """The queue holds ``max_queue_tokens`` already: ``queued`` tokens wait, ``retry_after`` seconds is a fair wait."""

    def __init__(self, queued: int, limit: int, retry_after: int):
        super().__init__(f"{queued} tokens are queued (limit {limit})")
        self.queued, self.limit, self.retry_after = queued, limit, retry_after


class Batcher:
    """Queue + worker thread. ``run(jobs) -> steps`` encodes a merged call one forward batch per step.

    Args:
        run: ``run(jobs, segments, ragged) -> Iterator[[(job index, item index, result)]]`` (the model's side;
            ``segments``: job indices by depth segment; ``ragged``: each row leaves its batch at its job's depth,
            ``True`` or the name of the runtime whose chain runs it, as ``ragged`` offered it; ``False``: cut).
        cost: the cost model (refit on every finished call).
        ragged: ``ragged(group, depth)``: the price of a token-layer when each row of a batch leaves at its own
            depth (up to ``depth``) for that group, relative to the runtime that serves it, or ``None`` where rows
            cannot (:meth:`Backend.ragged_price <layerwise.model.backends.base.Backend.ragged_price>`); or several
            offers, ``{runtime: price}`` (:meth:`Backend.ragged_prices
            <layerwise.model.backends.base.Backend.ragged_prices>`). A call of several depths is then one segment,
            each job run only to its own depth, on the offer the cost model predicts cheapest (at its price) where
            that beats the call cut into segments, each prediction corrected by what that way's calls took
            (:class:`~layerwise.serve.cost.WayCorrections`, in :attr:`ways`); a cut is not even tried where an offer
            is priced at 1.0 or less (each row runs only its own layers, at no dearer price).
        max_batch_tokens, max_batch_texts: the most estimated tokens and texts one call merges (a larger request
            runs alone, in steps like any other).
        max_queue_tokens: a request that would take the queued work past it raises :class:`QueueFull` (a request
            alone in the queue always gets in).
        quantum: seconds a call runs before the requests queued meanwhile get turns beside it.
        on_batch: called with :class:`BatchStats` after every finished call.
    """

    def __init__(self, run: Callable[[list[Job], list[list[int]], bool | str], Iterator[Step]], cost: CostModel, *,
                 max_batch_tokens: int = 16384,
                 max_batch_texts: int = 512, max_queue_tokens: int | None = None, quantum: float = 0.25,
                 on_batch: Callable[[BatchStats], None] | None = None,
                 ragged: Callable[[Hashable, int], float | dict[str, float] | None] | None = None):
        self._run, self.cost = run, cost
        self._ragged = ragged
        self.max_tokens, self.max_texts = max_batch_tokens, max_batch_texts
        self.max_queue_tokens, self.quantum = max_queue_tokens, quantum
        self.queued_tokens = 0  # estimated tokens waiting (not yet taken by the worker)
        self.tokens_per_second = 0.0  # the worker's recent rate, for Retry-After
        self._on_batch = on_batch
        self.ways: dict[Hashable, WayCorrections] = {}  # per group: each way's corrections (calls of several depths)
        self._last_end = 0.0  # perf_counter() when the last call finished
        self._queue: deque[Job] = deque()
        self._calls: deque[Call] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._stepping = False  # the worker is inside a model step
        self._thread = threading.Thread(target=self._loop, name="layerwise-batcher", daemon=True)
        self._thread.start()

    def open_work(self) -> int:
        """Requests queued, model calls open, and 1 while the worker is inside a model step: 0 when the model is
        idle (what ``layerwise_open_work`` reports)."""
        with self._cv:
            return len(self._queue) + len(self._calls) + int(self._stepping)

    async def submit(self, group: Hashable, depth: int, items: list, payload: Any, cost: int) -> list:
        """Queue ``items`` and wait for their results (in order).

        Raises:
            QueueFull: the queued work would pass ``max_queue_tokens``.
        """
        loop = asyncio.get_running_loop()
        job = Job(group, depth, items, payload, cost, loop.create_future(), loop, left=len(items))
        job.results = [None] * len(items)
        with self._cv:
            self._drop_gone()
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
                self._drop_gone()
            raise

    def close(self) -> None:
        """Stop the worker (the calls in progress are dropped)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ---- planning (with the lock held) -------------------------------------------------------------------
    def _drop_gone(self) -> None:
        for job in [j for j in self._queue if j.gone()]:
            self._queue.remove(job)
            self.queued_tokens -= job.cost

    def _take(self) -> Call | None:
        """The oldest job and the queued jobs of its group, oldest first, within the batch budget, cut by depth into
        segments by the cost model."""
        self._drop_gone()
        if not self._queue:
            return None
        first = self._queue[0]
        chosen: list[Job] = []
        tokens = texts = 0
        for job in self._queue:
            if job.group != first.group:
                continue
            if chosen and (tokens + job.cost > self.max_tokens or texts + len(job.items) > self.max_texts):
                continue
            chosen.append(job)
            tokens, texts = tokens + job.cost, texts + len(job.items)
        for job in chosen:
            self._queue.remove(job)
        self.queued_tokens -= tokens
        by_depth: dict[int, int] = {}
        for job in chosen:
            by_depth[job.depth] = by_depth.get(job.depth, 0) + job.cost
        cut = plan(by_depth, self.cost)
        segment_of = {d: k for k, seg in enumerate(cut) for d in seg}
        segments: list[list[int]] = [[] for _ in cut]
        for j, job in enumerate(chosen):
            segments[segment_of[job.depth]].append(j)
        call = Call(chosen, segments)
        if len(by_depth) == 1:
            return call
        # a call of several depths: the cut, or one segment to the deepest depth (what the call would cost were it all
        # at that depth: the floor a cut must beat), or rows leaving at their own depth on a chain that offers it
        call.way, call.predicted = (CUT if len(cut) > 1 else WHOLE), self.cost.predict(call.shape())
        calls = {call.way: call}
        if len(cut) > 1:
            whole = Call(chosen, [list(range(len(chosen)))], way=WHOLE)
            whole.predicted = self.cost.predict(whole.shape())
            calls[WHOLE] = whole
        offers = self._ragged(first.group, max(by_depth)) if self._ragged is not None else None
        if not isinstance(offers, dict):
            offers = {} if offers is None else {"": offers}
        # the whole predicted cost of each way (the cut pays a batch more per segment, a ragged call its price on the
        # layers), each corrected by what that way's calls took
        for chain, price in offers.items():
            ragged = Call(chosen, [list(range(len(chosen)))], ragged=True, chain=chain, way=ragged_way(chain))
            ragged.predicted = self.cost.predict_ragged(ragged.shape(), price)
            calls[ragged.way] = ragged  # type: ignore[index]
        if offers and min(offers.values()) <= 1.0:  # each row runs only its own layers at no dearer price
            calls = {way: c for way, c in calls.items() if c.ragged}
        if len(calls) == 1:
            return next(iter(calls.values()))
        ways = self.ways.setdefault(first.group, WayCorrections())
        return calls[ways.choose({way: c.predicted for way, c in calls.items()})]

    def _next_call(self) -> Call | None:
        """The call to advance by one step: a new one from the queue when nothing runs, when the one running call
        has started its last batch in the runtime, or when every running call has had its quantum; else the oldest
        call, the long ones in turn."""
        for call in [c for c in self._calls if c.abandoned()]:
            self._calls.remove(call)  # nobody waits for it: stop between batches
            _close(call)
        behind = len(self._calls) == 1 and self._calls[0].started  # the next call starts behind the running one
        if self._queue and (behind or all(c.long(self.max_tokens) and c.seconds >= self.quantum
                                          for c in self._calls)):
            new = self._take()
            if new is not None:
                new.taken = time.perf_counter()
                self._calls.appendleft(new)
        if not self._calls:
            return None
        turn = self._calls[0]
        if turn.steps is None or (turn.long(self.max_tokens) and turn.seconds >= self.quantum):
            self._calls.rotate(-1)  # a new call's first step, or a long call's turn, then the next call's
        return turn

    # ---- the worker ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._calls and not self._stop:
                    self._cv.wait()
                if self._stop:
                    for running in self._calls:
                        _close(running)
                    return
                turn = self._next_call()
                self._stepping = turn is not None
            if turn is not None:
                try:
                    self._step(turn)
                finally:
                    with self._cv:
                        self._stepping = False

    def _step(self, call: Call) -> None:
        t0 = time.perf_counter()
        error: Exception | None = None
        step: Step | None = None
        try:
            if call.steps is None:
                call.steps = self._run(call.jobs, call.segments, (call.chain or True) if call.ragged else False)
            step = next(call.steps, None)
        except Exception as exc:  # handed to the call's requests; the worker keeps serving
            error = exc
        seconds = time.perf_counter() - t0
        call.seconds += seconds
        call.started = step == [] and error is None
        if step:
            call.batches += 1
        outcomes: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, Exception | None]]] = {}
        for j, i, value in step or ():
            job = call.jobs[j]
            job.results[i] = value
            job.left -= 1
            if job.left == 0:
                outcomes.setdefault(job.loop, []).append((job.future, job.results, None))
        if step is not None and error is None:
            _wake(outcomes)
            return
        with self._cv:
            if call in self._calls:
                self._calls.remove(call)
            unfinished = [j for j in call.jobs if j.left > 0 and not j.gone()]
            if error is not None and len(call.jobs) > 1 and not call.alone:
                # one request's failure must not fail the others it shared a call with: each retries on its own
                for job in unfinished:
                    job.results, job.left = [None] * len(job.items), len(job.items)
                    self._calls.append(Call([job], [[0]], alone=True))
                unfinished = []
        for job in unfinished:
            outcomes.setdefault(job.loop, []).append(
                (job.future, None, error or RuntimeError("the encoder ended before every item was encoded")))
        _wake(outcomes)
        if error is None:
            try:
                self._finished(call)
            except Exception:  # the cost fit or the metrics: never the end of the worker that serves everyone
                log.exception("layerwise: the statistics of a finished call failed (requests are not affected)")

    def corrections(self) -> dict[tuple[str, str], float]:
        """Each way's correction (:class:`~layerwise.serve.cost.WayCorrections`) by ``(group, way)``, the group as a
        string (for the metrics)."""
        return {(str(group), way): ways.correction(way) for group, ways in self.ways.items() for way in ways.ways()}

    def _finished(self, call: Call) -> None:
        tokens = call.tokens
        # what the call cost the service: the wall time from the previous call's end (or from its own start, when the
        # worker was idle before it) to its end. Calls run one behind the other, so this is its share of the
        # throughput, with whatever its runtime took from the service's other threads meanwhile; the worker's own
        # time on it (call.seconds, the cost model's) overlaps the next call's tokenising and misses the rest
        now = time.perf_counter()
        wall = now - max(self._last_end, call.taken or now)
        self._last_end = now
        if call.way is not None:
            self.ways.setdefault(call.jobs[0].group, WayCorrections()).observe(call.way, call.predicted,
                                                                               wall or call.seconds)
        self.cost.observe(call.shape(), call.seconds, shared=call.ragged)
        if call.seconds > 0:
            self.tokens_per_second = tokens / call.seconds
        if self._on_batch is not None:
            self._on_batch(BatchStats(
                requests=len(call.jobs), texts=sum(len(j.items) for j in call.jobs),
                specs=len({j.payload for j in call.jobs}), segments=len(call.segments), tokens=tokens,
                batches=call.batches, computed=call.work(), needed=sum(j.cost * j.depth for j in call.jobs),
                seconds=call.seconds, ragged=call.ragged))


def _close(call: Call) -> None:
    close = getattr(call.steps, "close", None)
    if close is not None:
        close()


def _wake(outcomes: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, Exception | None]]]) -> None:
    """One wake-up of each event loop (not one per request): it resolves all of that loop's futures."""
    for loop, items in outcomes.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
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


__all__ = ["BatchStats", "Batcher", "Call", "Job", "QueueFull", "Step"]
