"""The service's Batcher on its own (no model, no HTTP): a lone request runs at once; requests of one group share a
call whatever their specs, as the cost model plans by depth; a large call takes turns with later requests; a call
nobody awaits stops between its steps; one request's failure does not fail the others it shared a call with."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest

from layerwise.serve.batcher import Batcher, BatchStats
from layerwise.serve.cost import (
    CORRECTION_DECAY,
    CUT,
    FIRST_RUNS,
    HOPELESS_RETRY,
    RAGGED,
    RETRY_AFTER,
    WHOLE,
    CostModel,
    WayCorrections,
    ragged_way,
)


def cpu() -> CostModel:
    return CostModel(batch_tokens=1024, overhead=0.002, layer_overhead=0.0, unit=2e-5)


class Recorder:
    """A model side that records its calls ``(payloads, depth, items)`` and echoes ``(payload, item)`` per item,
    ``per_step`` items a step (each step sleeping ``step_seconds``); can be held to queue requests."""

    def __init__(self, fail_on: str | None = None, per_step: int = 10**6, step_seconds: float = 0.0):
        self.calls: list[tuple[list, int, list]] = []
        self.segments: list[list[list]] = []  # per call: the first item of each job, by depth segment
        self.steps_run = 0
        self.ragged: list[bool] = []  # per call: whether its rows leave their batches at their own depth
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_on, self.per_step, self.step_seconds = fail_on, per_step, step_seconds

    def __call__(self, jobs, segments, ragged=False):
        self.ragged.append(ragged)
        items = [(j, i, job.payload, item) for j, job in enumerate(jobs) for i, item in enumerate(job.items)]
        self.calls.append(([job.payload for job in jobs], max(job.depth for job in jobs), [it[3] for it in items]))
        self.segments.append([[jobs[j].items[0] for j in seg] for seg in segments])
        self.started.set()
        self.release.wait(30)
        if self.fail_on is not None and any(self.fail_on == it[3] for it in items):
            raise RuntimeError(f"model failed on {self.fail_on}")
        for start in range(0, len(items), self.per_step):
            time.sleep(self.step_seconds)
            self.steps_run += 1
            yield [(j, i, (payload, item)) for j, i, payload, item in items[start:start + self.per_step]]


def test_lone_requests_run_at_once_without_a_timer(monkeypatch):
    waits: list[float | None] = []
    real_wait = threading.Condition.wait

    def recording_wait(self, timeout=None):
        waits.append(timeout)
        return real_wait(self, timeout)

    monkeypatch.setattr(threading.Condition, "wait", recording_wait)
    run = Recorder()
    b = Batcher(run, cpu())

    async def sequential() -> list[float]:
        latencies = []
        for i in range(40):
            t0 = time.perf_counter()
            assert await b.submit("g", 1, [f"t{i}"], "k", 3) == [("k", f"t{i}")]
            latencies.append(time.perf_counter() - t0)
        return latencies

    try:
        latencies = asyncio.run(sequential())
    finally:
        b.close()
    assert [len(items) for _, _, items in run.calls] == [1] * 40  # one model call per lone request
    # the worker only ever sleeps until a request comes: no batching window, no timed wait
    assert waits and all(timeout is None for timeout in waits), waits
    # a thread wake-up and an event-loop wake-up per request (generous for a loaded CI machine; a batching window
    # of 10 ms or more would show here)
    assert statistics.median(latencies) < 0.010, latencies


async def busy_with(b: Batcher, run: Recorder, items: list[str]) -> asyncio.Future:
    """Submit a first request and return once the worker is running it (held until ``run.release`` is set), so
    the requests submitted next wait in the queue together."""
    run.release.clear()
    first = asyncio.ensure_future(b.submit("g", 1, items, "first", 1))
    while not run.started.is_set():
        await asyncio.sleep(0.001)
    return first


def test_requests_of_one_depth_share_a_call_whatever_their_spec_and_get_their_own_rows():
    run = Recorder()
    stats: list[BatchStats] = []
    b = Batcher(run, cpu(), max_batch_tokens=1000, max_batch_texts=100, on_batch=stats.append)

    async def scenario():
        first = await busy_with(b, run, ["a0"])  # the worker is busy with the first request ...
        later = [  # ... while these queue: specs A and B (say, two pools) at depth 3, and one at site "other"
            asyncio.ensure_future(b.submit(group, 3, [f"{spec}{i}-{j}" for j in range(n)], spec, n))
            for i, (group, spec, n) in enumerate([("g", "A", 2), ("g", "B", 1), ("other", "C", 1), ("g", "A", 3)])
        ]
        await asyncio.sleep(0.05)
        run.release.set()
        return await first, await asyncio.gather(*later)

    try:
        first, later = asyncio.run(scenario())
    finally:
        b.close()
    assert [(payloads, depth, items) for payloads, depth, items in run.calls] == [
        (["first"], 1, ["a0"]),
        (["A", "B", "A"], 3, ["A0-0", "A0-1", "B1-0", "A3-0", "A3-1", "A3-2"]),  # one forward pass, two specs
        (["C"], 3, ["C2-0"]),  # another site: another pass
    ]
    assert first == [("first", "a0")]
    assert later == [[("A", "A0-0"), ("A", "A0-1")], [("B", "B1-0")], [("C", "C2-0")],
                     [("A", "A3-0"), ("A", "A3-1"), ("A", "A3-2")]]
    merged = stats[1]
    assert (merged.requests, merged.specs, merged.texts, merged.segments) == (3, 2, 6, 1)
    assert merged.computed == merged.needed == 6 * 3


class Fixed(CostModel):
    """Prices that do not learn (the held first call of a test is no measure of anything)."""

    def observe(self, segments, seconds, shared=False):
        pass


def test_the_cost_model_cuts_a_call_by_depth():
    def segments_for(cost: CostModel) -> list[list[str]]:
        run = Recorder()
        b = Batcher(run, cost, max_batch_tokens=100_000)

        async def scenario():
            first = await busy_with(b, run, ["x"])
            queued = [asyncio.ensure_future(b.submit("g", depth, [f"d{depth}"], "spec", tokens))
                      for depth, tokens in ((1, 40), (6, 800), (5, 40))]
            await asyncio.sleep(0.05)
            run.release.set()
            await first
            return await asyncio.gather(*queued)

        try:
            asyncio.run(scenario())
        finally:
            b.close()
        assert [items for _, _, items in run.calls[1:]] == [["d1", "d6", "d5"]]  # one call, one pipeline
        return run.segments[1]

    # a CPU pays per layer: 40 tokens through 5 layers they do not need cost more than a batch of their own; one
    # more layer for 40 tokens costs less than a batch
    assert segments_for(Fixed(1024, 0.002, 0.0, 2e-5)) == [["d1"], ["d6", "d5"]]
    # a GPU pays per batch: everything runs to the deepest layer in one segment
    assert segments_for(Fixed(16384, 0.004, 0.0005, 2e-7)) == [["d1", "d6", "d5"]]


def test_a_ragged_runtime_runs_a_call_as_one_segment_each_job_to_its_own_depth():
    # where rows leave their batch at their own depth at no higher price, no cut is needed: the cost model would cut
    # this call in two (see above), and the work counted is each job's tokens through its own depth; at twice the
    # price (a compiled runtime serves the depth, PyTorch would run the rows) the cut is cheaper and kept
    def call_with(price: float) -> tuple[Recorder, list[BatchStats], list]:
        asked: list[tuple[str, int]] = []
        seen: list[BatchStats] = []

        def ragged(group, depth):
            asked.append((group, depth))
            return price

        run = Recorder()
        b = Batcher(run, Fixed(1024, 0.002, 0.0, 2e-5), max_batch_tokens=100_000, ragged=ragged,
                    on_batch=seen.append)

        async def scenario():
            first = await busy_with(b, run, ["x"])
            queued = [asyncio.ensure_future(b.submit("g", depth, [f"d{depth}"], "spec", tokens))
                      for depth, tokens in ((1, 40), (6, 800), (5, 40))]
            await asyncio.sleep(0.05)
            run.release.set()
            await first
            await asyncio.gather(*queued)
            while len(seen) < 2:  # the statistics come once the call's steps are over, after its answers
                await asyncio.sleep(0.001)

        try:
            asyncio.run(asyncio.wait_for(scenario(), 30))
        finally:
            b.close()
        assert asked == [("g", 6)]  # a lone request (one depth) does not ask
        return run, seen, asked

    run, seen, _ = call_with(1.0)
    assert run.segments[1] == [["d1", "d6", "d5"]] and run.ragged == [False, True]
    assert seen[1].computed == seen[1].needed == 40 * 1 + 800 * 6 + 40 * 5
    run, seen, _ = call_with(2.0)
    assert run.segments[1] == [["d1"], ["d6", "d5"]] and run.ragged == [False, False]
    assert seen[1].computed == 40 * 1 + 840 * 6


def test_batch_budget_splits_merged_calls():
    run = Recorder()
    b = Batcher(run, cpu(), max_batch_tokens=10, max_batch_texts=3)

    async def scenario():
        first = await busy_with(b, run, ["x"])
        later = [asyncio.ensure_future(b.submit("g", 1, [f"t{i}"], "s", 4)) for i in range(5)]
        await asyncio.sleep(0.05)
        run.release.set()
        await first
        return await asyncio.gather(*later)

    try:
        later = asyncio.run(scenario())
    finally:
        b.close()
    # 4 tokens each: at most two fit the budget of 10
    assert [items for _, _, items in run.calls] == [["x"], ["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert later == [[("s", f"t{i}")] for i in range(5)]


def test_a_failing_request_fails_alone_and_the_worker_goes_on():
    run = Recorder(fail_on="BOOM")
    b = Batcher(run, cpu())

    async def scenario():
        first = await busy_with(b, run, ["ok"])
        shared = [asyncio.ensure_future(b.submit("g", 1, items, "s", 1)) for items in (["fine"], ["BOOM"])]
        await asyncio.sleep(0.05)
        run.release.set()
        await first
        outcomes = await asyncio.gather(*shared, return_exceptions=True)
        return outcomes, await b.submit("g", 1, ["after"], "s", 1)

    try:
        (fine, boom), after = asyncio.run(scenario())
    finally:
        b.close()
    assert fine == [("s", "fine")]  # its shared call failed; it was retried on its own
    assert isinstance(boom, RuntimeError) and "BOOM" in str(boom), boom
    assert after == [("s", "after")]


def test_a_short_request_takes_turns_with_a_long_call():
    run = Recorder(per_step=1, step_seconds=0.05)  # the long call: 60 steps of 50 ms, over the batch budget
    b = Batcher(run, cpu(), quantum=0.1, max_batch_tokens=50)

    async def scenario():
        long = asyncio.ensure_future(b.submit("g", 6, [f"long{i}" for i in range(60)], "L", 60))
        while not run.started.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        short = await b.submit("g", 6, ["short"], "S", 1)
        waited = time.perf_counter() - t0
        return short, waited, long.done(), await long

    try:
        short, waited, long_done, long = asyncio.run(scenario())
    finally:
        b.close()
    assert short == [("S", "short")] and not long_done
    assert waited < 0.5, waited  # about one step of the long call (the whole of it takes 3 s)
    assert long == [("L", f"long{i}") for i in range(60)]


def test_a_call_nobody_awaits_stops_between_its_steps():
    run = Recorder(per_step=1, step_seconds=0.02)
    b = Batcher(run, cpu())

    async def scenario():
        task = asyncio.ensure_future(b.submit("g", 1, [f"t{i}" for i in range(200)], "s", 200))
        while run.steps_run < 3:
            await asyncio.sleep(0.005)
        task.cancel()  # the client went away during its call
        await asyncio.sleep(0.2)
        return await b.submit("g", 1, ["next"], "s", 1)

    try:
        assert asyncio.run(scenario()) == [("s", "next")]
    finally:
        b.close()
    assert run.steps_run < 30, run.steps_run  # 200 steps were planned


def test_a_caller_that_went_away_does_not_stop_the_others():
    run = Recorder()
    b = Batcher(run, cpu())

    async def scenario():
        first = await busy_with(b, run, ["first"])
        gone = asyncio.ensure_future(b.submit("g", 1, ["gone"], "s", 1))
        stays = asyncio.ensure_future(b.submit("g", 1, ["stays"], "s", 1))
        await asyncio.sleep(0.02)
        gone.cancel()  # the client disconnected while its request was queued
        run.release.set()
        await first
        return await stays

    try:
        assert asyncio.run(scenario()) == [("s", "stays")]
    finally:
        b.close()
    assert all("gone" not in items for _, _, items in run.calls)


def _workers() -> int:
    return sum(t.name == "layerwise-batcher" and t.is_alive() for t in threading.enumerate())


def test_close_stops_the_worker():
    before = _workers()
    b = Batcher(Recorder(), cpu())
    assert _workers() == before + 1
    b.close()
    assert _workers() == before


def test_requests_from_several_event_loops_are_answered_on_their_own_loop():
    loops = 3
    run = Recorder()
    b = Batcher(run, cpu())
    results: list = [None] * loops

    def client(i: int) -> None:
        async def go():
            return await b.submit("g", 1, [f"loop{i}"], "s", 1)

        results[i] = asyncio.run(go())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(loops)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        b.close()
    assert results == [[("s", f"loop{i}")] for i in range(loops)]


def test_the_cost_model_learns_the_prices_of_the_machine():
    model = CostModel.for_device("cpu", 1024)
    shapes = [[(100, 1)], [(3000, 6)], [(900, 3), (40, 1)], [(5000, 2)], [(200, 6), (300, 2), (50, 4)], [(2500, 4)]]
    for segments in shapes * 8:
        b, bd, td = model.features(segments)
        model.observe(segments, 0.010 * b + 0.002 * bd + 5e-6 * td)
    assert abs(model.overhead - 0.010) < 0.002 and abs(model.layer_overhead - 0.002) < 0.0005, model
    assert abs(model.unit - 5e-6) < 1e-6, model


def test_the_next_call_starts_behind_a_call_whose_last_batch_runs():
    """A call whose step finished nothing has its last batch running in the runtime (the step before the wait): the
    requests queued meanwhile are planned into a call that starts (tokenises, starts its forward batch) before the
    running call is waited for and reduced, so the runtime is never idle between calls; each call still answers
    its own requests, the older first, and nothing waits on the running call's end."""
    events: list[str] = []
    gate = threading.Event()

    def run(jobs, segments, ragged=False):
        name = "+".join(job.items[0] for job in jobs)
        events.append(f"start {name}")
        if name == "a":
            gate.wait(30)  # "a" holds the worker until "b" and "c" are queued
        yield []  # the last batch is started: the next step waits for it
        events.append(f"finish {name}")
        yield [(j, i, item) for j, job in enumerate(jobs) for i, item in enumerate(job.items)]

    b = Batcher(run, cpu())

    async def main() -> list:
        first = asyncio.ensure_future(b.submit("g", 1, ["a"], "k", 3))
        while not events:
            await asyncio.sleep(0.001)
        later = [asyncio.ensure_future(b.submit("g", 1, [x], "k", 3)) for x in ("b", "c")]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(first, *later)

    try:
        assert asyncio.run(main()) == [["a"], ["b"], ["c"]]
    finally:
        b.close()
    assert events == ["start a", "start b+c", "finish a", "finish b+c"], events


def test_a_mixed_call_runs_the_way_that_measured_faster_whatever_the_prices_predict():
    """The fitted prices predict the cut cheaper (the ragged price is 2.0, as a chain timed under load said), but
    the ragged calls take 0.6 of the cut's time: once each way has run its first calls (the cut, then the call run
    whole to its deepest depth, then ragged), mixed calls run ragged. And the other way round: ragged predicted
    cheaper than the whole call (at a price above 1.0: at 1.0 the rows run only their own layers at no dearer
    price, and the call is always ragged), the cut measured faster, mixed calls are cut."""

    def ways_run(ragged_seconds: float, cut_seconds: float, whole_seconds: float, price: float) -> list[str]:
        seen: list[BatchStats] = []

        def run(jobs, segments, ragged=False):
            time.sleep(ragged_seconds if ragged else cut_seconds if len(segments) > 1 else whole_seconds)
            yield [(j, i, None) for j, job in enumerate(jobs) for i in range(len(job.items))]

        b = Batcher(run, Fixed(1024, 0.002, 0.0, 2e-5), max_batch_tokens=100_000, ragged=lambda group, depth: price,
                    on_batch=seen.append)

        async def scenario():
            for _ in range(40):  # one mixed call after another: the two jobs are queued together
                await asyncio.gather(*(b.submit("g", depth, [f"d{depth}"], "s", tokens)
                                       for depth, tokens in ((1, 40), (6, 800))))
            while len([s for s in seen if s.segments]) < 40:
                await asyncio.sleep(0.001)

        try:
            asyncio.run(asyncio.wait_for(scenario(), 60))
        finally:
            b.close()
        return [RAGGED if s.ragged else CUT if s.segments > 1 else WHOLE for s in seen if s.requests == 2]

    first = [CUT, CUT, WHOLE, WHOLE, RAGGED, RAGGED]  # each way's first calls, the cheapest predicted first
    mixed = ways_run(ragged_seconds=0.010, cut_seconds=0.016, whole_seconds=0.02, price=2.0)
    assert len(mixed) >= 30, mixed  # (a first job may run alone while the worker is idle)
    assert mixed[:6] == first and mixed[-20:].count(RAGGED) >= 18, mixed  # ... measured faster, ragged serves
    mixed = ways_run(ragged_seconds=0.016, cut_seconds=0.010, whole_seconds=0.02, price=1.05)
    assert mixed[:6] == first and mixed[-20:].count(CUT) >= 18, mixed


def test_way_corrections_follow_what_each_way_took():
    ways = WayCorrections()
    predicted = {CUT: 1.0, RAGGED: 1.2}
    for _ in range(FIRST_RUNS):  # the way predicted cheaper runs first ...
        assert ways.choose(predicted) == CUT
        ways.observe(CUT, 1.0, 1.1)
    for _ in range(FIRST_RUNS):  # ... then the other, as many calls
        assert ways.choose(predicted) == RAGGED
        ways.observe(RAGGED, 1.2, 0.6)
    assert abs(ways.correction(RAGGED) - 0.5) < 1e-9 and abs(ways.correction(CUT) - 1.1) < 1e-9
    picks = [ways.choose(predicted) for _ in range(2 * RETRY_AFTER)]  # choices 5, 6, ... (the cut last ran at 2)
    cuts = [k + 5 for k, way in enumerate(picks) if way == CUT]
    assert cuts == [2 + RETRY_AFTER, 2 + 2 * RETRY_AFTER]  # the way not chosen runs again every RETRY_AFTER choices
    ways.observe(CUT, 1.0, 0.2)  # ... and what it took then moves its correction (sums, the earlier calls fading
    fade = CORRECTION_DECAY ** (ways.choices - 2)  # by one factor per choice made since the cut last ran, choice 2)
    d = CORRECTION_DECAY
    assert ways.correction(CUT) == pytest.approx((fade * 1.1 * (d + 1) + 0.2) / (fade * (d + 1) + 1), rel=1e-9)
    assert WayCorrections().choose({CUT: 1.0, RAGGED: 1.0}) == RAGGED  # a tie: no layer run that is not needed
    hopeless = WayCorrections()
    for way in (CUT, RAGGED):
        for _ in range(FIRST_RUNS):
            hopeless.observe(way, 1.0, 1.0)
    assert {hopeless.choose({CUT: 1.0, RAGGED: 2.5}) for _ in range(3 * RETRY_AFTER)} == {CUT}  # never worth a check


def test_way_corrections_learn_which_runtimes_chain_runs_mixed_calls_faster():
    """Three ways: the cut and two runtimes' chains. Each runs its first calls, then the one whose calls took least
    against their predictions serves, though another was predicted cheaper; the others still run now and then, so a
    change of the machine's load is seen."""
    ways = WayCorrections()
    onnx, openvino = ragged_way("onnx"), ragged_way("openvino")
    predicted = {CUT: 1.0, openvino: 1.1, onnx: 1.2}
    took = {CUT: 1.5, openvino: 1.6, onnx: 0.9}  # seconds each way's calls take
    picks = []
    for _ in range(4 * RETRY_AFTER):
        way = ways.choose(predicted)
        picks.append(way)
        ways.observe(way, predicted[way], took[way])
    assert all(picks[:3 * FIRST_RUNS].count(way) == FIRST_RUNS for way in predicted)  # each its first calls
    later = picks[3 * FIRST_RUNS:]
    assert later.count(onnx) > 0.9 * len(later) and {CUT, openvino} <= set(later)
    assert ways.ways() == [CUT, openvino, onnx] and ways.correction(onnx) == pytest.approx(0.75)


def test_a_way_with_a_bad_start_is_judged_by_its_last_calls():
    """A way whose first calls were slow (the machine busy while it started; here 3x the other, past HOPELESS) is not
    kept out for good: it runs again after HOPELESS_RETRY choices, and its earlier calls fade with every choice made
    since, so that one call decides."""
    ways = WayCorrections()
    took = {CUT: 1.0, RAGGED: 3.0}
    picks = []
    for k in range(HOPELESS_RETRY + 2 * RETRY_AFTER):
        if k == 2 * FIRST_RUNS:
            took[RAGGED] = 0.5  # the machine quiet again: ragged calls now take half the cut's time
        way = ways.choose({CUT: 1.0, RAGGED: 1.0})
        picks.append(way)
        ways.observe(way, 1.0, took[way])
    first_retry = picks.index(RAGGED, 2 * FIRST_RUNS)
    assert first_retry <= 2 * FIRST_RUNS + HOPELESS_RETRY
    assert picks[first_retry + 1:].count(RAGGED) > 0.9 * len(picks[first_retry + 1:]), picks


def test_a_ragged_call_is_predicted_as_its_chain_was_priced():
    """A chain's price is its time on rows at mixed depths over the serving graph's on the same batch, per token-layer
    the rows needed; a ragged call is predicted the same way, whatever the fitted prices put into each batch's fixed
    cost (a server's fit put most of a call into it, and ragged calls were then predicted at about what a whole call
    costs, so the choice between them was left to noise)."""
    segments = [(100, 1), (300, 3), (200, 6)]  # 2,200 token-layers of the 3,600 to depth 6
    for prices in [(0.002, 0.003, 2e-5), (0.05, 0.0, 1e-7)]:  # the CPU's prior, and almost all per batch
        model = CostModel(4096, *prices)
        whole = model.predict([(600, 6)])
        assert model.predict_ragged(segments, 1.2) == pytest.approx(whole * 1.2 * 2200 / 3600)
        assert model.predict_ragged([(600, 6)], 1.0) == pytest.approx(whole)  # all rows to the deepest depth
