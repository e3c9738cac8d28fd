"""The service's dynamic Batcher on its own (no model, no HTTP): a lone request runs at once, concurrent compatible
requests share one call, each caller gets its own slice, errors reach every caller of the batch."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

from layerwise.serve.batcher import Batcher


class Recorder:
    """A model call that records its batches and echoes ``(key, item)`` per item; can be held to queue requests."""

    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple[str, list]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_on = fail_on

    def __call__(self, key: str, items: list) -> list:
        self.calls.append((key, list(items)))
        self.started.set()
        self.release.wait(30)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError(f"model failed on {self.fail_on}")
        return [(key, item) for item in items]


def test_lone_requests_run_at_once_without_a_timer(monkeypatch):
    waits: list[float | None] = []
    real_wait = threading.Condition.wait

    def recording_wait(self, timeout=None):
        waits.append(timeout)
        return real_wait(self, timeout)

    monkeypatch.setattr(threading.Condition, "wait", recording_wait)
    run = Recorder()
    b = Batcher(run)

    async def sequential() -> list[float]:
        latencies = []
        for i in range(40):
            t0 = time.perf_counter()
            assert await b.submit("k", [f"t{i}"], 3) == [("k", f"t{i}")]
            latencies.append(time.perf_counter() - t0)
        return latencies

    try:
        latencies = asyncio.run(sequential())
    finally:
        b.close()
    assert [len(items) for _, items in run.calls] == [1] * 40  # one model call per lone request
    # the worker only ever sleeps until a request comes: no batching window, no timed wait
    assert waits and all(timeout is None for timeout in waits), waits
    # a thread wake-up and an event-loop wake-up per request (generous for a loaded CI machine; a batching window
    # of 10 ms or more would show here)
    assert statistics.median(latencies) < 0.010, latencies


async def busy_with(b: Batcher, run: Recorder, key: str, items: list[str]) -> asyncio.Future:
    """Submit a first request and return once the worker is running it (held until ``run.release`` is set), so
    the requests submitted next wait in the queue together."""
    run.release.clear()
    first = asyncio.ensure_future(b.submit(key, items, 1))
    while not run.started.is_set():
        await asyncio.sleep(0.001)
    return first


def test_waiting_compatible_requests_share_one_call_and_get_their_own_rows():
    run = Recorder()
    b = Batcher(run, max_batch_tokens=1000, max_batch_texts=100)

    async def scenario():
        first = await busy_with(b, run, "A", ["a0"])  # the worker is busy with the first request ...
        later = [  # ... while these queue: A and B interleaved
            asyncio.ensure_future(b.submit(key, [f"{key}{i}-{j}" for j in range(n)], n))
            for i, (key, n) in enumerate([("A", 2), ("B", 1), ("A", 3), ("A", 1), ("B", 2)])
        ]
        await asyncio.sleep(0.05)
        run.release.set()
        return await first, await asyncio.gather(*later)

    try:
        first, later = asyncio.run(scenario())
    finally:
        b.close()
    assert run.calls == [
        ("A", ["a0"]),
        ("A", ["A0-0", "A0-1", "A2-0", "A2-1", "A2-2", "A3-0"]),  # every waiting A, in arrival order
        ("B", ["B1-0", "B4-0", "B4-1"]),
    ]
    assert first == [("A", "a0")]
    assert later == [
        [("A", "A0-0"), ("A", "A0-1")],
        [("B", "B1-0")],
        [("A", "A2-0"), ("A", "A2-1"), ("A", "A2-2")],
        [("A", "A3-0")],
        [("B", "B4-0"), ("B", "B4-1")],
    ]


def test_batch_budget_splits_merged_calls():
    run = Recorder()
    b = Batcher(run, max_batch_tokens=10, max_batch_texts=3)

    async def scenario():
        first = await busy_with(b, run, "A", ["x"])
        later = [asyncio.ensure_future(b.submit("A", [f"t{i}"], 4)) for i in range(5)]
        await asyncio.sleep(0.05)
        run.release.set()
        await first
        return await asyncio.gather(*later)

    try:
        later = asyncio.run(scenario())
    finally:
        b.close()
    # 4 tokens each: at most two fit the budget of 10
    assert [items for _, items in run.calls] == [["x"], ["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert later == [[("A", f"t{i}")] for i in range(5)]


def test_model_error_reaches_every_request_of_its_batch_and_the_worker_goes_on():
    run = Recorder(fail_on="BOOM")
    b = Batcher(run)

    async def scenario():
        first = await busy_with(b, run, "A", ["ok"])
        bad = [asyncio.ensure_future(b.submit("A", items, 1)) for items in (["fine"], ["BOOM"])]
        await asyncio.sleep(0.05)
        run.release.set()
        await first
        outcomes = await asyncio.gather(*bad, return_exceptions=True)
        return outcomes, await b.submit("A", ["after"], 1)

    try:
        outcomes, after = asyncio.run(scenario())
    finally:
        b.close()
    assert all(isinstance(o, RuntimeError) and "BOOM" in str(o) for o in outcomes), outcomes
    assert after == [("A", "after")]


def test_a_caller_that_went_away_does_not_stop_the_others():
    run = Recorder()
    b = Batcher(run)

    async def scenario():
        first = await busy_with(b, run, "A", ["first"])
        gone = asyncio.ensure_future(b.submit("A", ["gone"], 1))
        stays = asyncio.ensure_future(b.submit("A", ["stays"], 1))
        await asyncio.sleep(0.02)
        gone.cancel()  # the client disconnected while its request was queued
        run.release.set()
        await first
        return await stays

    try:
        assert asyncio.run(scenario()) == [("A", "stays")]
    finally:
        b.close()


def _workers() -> int:
    return sum(t.name == "layerwise-batcher" and t.is_alive() for t in threading.enumerate())


def test_close_stops_the_worker():
    before = _workers()
    b = Batcher(Recorder())
    assert _workers() == before + 1
    b.close()
    assert _workers() == before


def test_requests_from_several_event_loops_are_answered_on_their_own_loop():
    loops = 3
    run = Recorder()
    b = Batcher(run)
    results: list = [None] * loops

    def client(i: int) -> None:
        async def go():
            return await b.submit("A", [f"loop{i}"], 1)

        results[i] = asyncio.run(go())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(loops)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        b.close()
    assert results == [[("A", f"loop{i}")] for i in range(loops)]
