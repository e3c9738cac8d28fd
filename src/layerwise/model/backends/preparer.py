"""``auto``'s background work as a plan with an owner: one worker thread, one Future per job.

A job is keyed ``(model, depth, purpose)`` (purpose ``"runtime"``: export, check and race the compiled runtimes for a
depth; ``"stages"``: build the one-layer graphs of mixed depths; ``"int8"``: time the int8 runtimes). Submitting a key
already known returns its Future; a job is done when its Future is (torch ``_inductor/async_compile.py``: a key to a
Future, ready means done). :meth:`Preparer.settle` waits for them, :meth:`Preparer.pending` lists those not done, and
:meth:`Preparer.stop` cancels what has not started and stops the running one after its step (its build child killed:
:mod:`~layerwise.model.backends.offload`).

Background jobs wait for a quiet moment of the caller's (:class:`Activity`): none of its forward passes for
:data:`QUIET_S`, or one kept busy for :data:`GRACE_S`, so a script's one short call is neither slowed by the
preparation nor kept waiting for it at exit. While the caller is at work, the background takes :data:`SHARE` of the
machine: its export and compilation run in a child process that the scheduler runs only on a core the caller leaves
idle (:func:`~layerwise.model.backends.offload.offloaded`), and each of its own steps in this process (a check, one
run of a race, which holds the caller's passes for its duration, :meth:`Activity.alone`) is followed by a pause nine
times as long (:meth:`Activity.pace`). On the 2-core development machine that kept the caller at 0.9x or more of
PyTorch alone while a depth was prepared (``./dev bench background_cost``).

Locks: :class:`Preparer` holds one (``_lock``: its map of Futures), :class:`Activity` one (``_lock``: the caller's
passes); neither is held while the other is taken, nor while a job runs.

Example::

    >>> prep = Preparer("layerwise-auto")
    >>> prep.submit(("m", 3, "runtime"), lambda: "onnx").result()
    'onnx'
    >>> prep.pending(), prep.settle(1.0)
    ([], True)
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch

from . import offload
from .base import Plan
from .offload import Stopped

QUIET_S = 0.25  # a background job starts once the caller has made no forward pass for this long...
GRACE_S = 3.0  # ...or once the caller has kept the model busy this long
HOLD_S = 10.0  # the longest the caller waits for a timing run alone, and for its own passes to end before one
SHARE = 0.1  # the share of the machine the background's own steps take while the caller is at work (see pace)
Key = tuple[str, int, str]  # (model, depth, purpose)
_LIVE: "weakref.WeakSet[Preparer]" = weakref.WeakSet()  # preparers whose worker may be running (stopped at exit)


@atexit.register
def _stop_all() -> None:
    """At exit, stop every preparer after the step it is in and wait for it: a thread left inside a runtime's native
    code while the interpreter tears the runtimes down aborts the process. What it finished is in the cache."""
    for preparer in list(_LIVE):
        preparer.stop()


class Activity:
    """The caller's forward passes, as the background sees them: how many run now, when the last ended, and whether a
    timing run holds the machine (:meth:`alone`). Every field is owned by ``_lock``."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._busy = 0
        self._waiting = 0  # passes held by a timing run (at work, all the same)
        self._last = 0.0  # time.monotonic() when the caller's last pass ended or was planned
        self._alone = False

    def touch(self) -> None:
        """The caller is at work (a call was planned): the background waits for a quiet moment."""
        with self._lock:
            self._last = time.monotonic()

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """One forward pass of the caller's; it waits (at most :data:`HOLD_S`) while a timing run holds the
        machine."""
        with self._lock:
            self._waiting += 1
            self._lock.wait_for(lambda: not self._alone, HOLD_S)
            self._waiting -= 1
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last = time.monotonic()
                self._lock.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """A timing run with the machine to itself: the caller's next pass waits (at most :data:`HOLD_S`), and the
        passes it is in are let finish first (at most :data:`HOLD_S`)."""
        with self._lock:
            self._alone = True
            self._lock.wait_for(lambda: self._busy == 0, HOLD_S)
        try:
            yield
        finally:
            with self._lock:
                self._alone = False
                self._lock.notify_all()

    def held(self) -> int:
        """How many of the caller's passes wait now for a timing run to end (:meth:`alone`)."""
        with self._lock:
            return self._waiting

    def busy(self) -> bool:
        """Whether the caller is at work: a pass running or held, or one that ended less than :data:`QUIET_S` ago."""
        with self._lock:
            return bool(self._busy or self._waiting) or time.monotonic() - self._last < QUIET_S

    def pace(self, seconds: float, stop: threading.Event) -> None:
        """After a background step that took ``seconds`` of the caller's machine: while the caller is at work, wait
        until the step is :data:`SHARE` of the time since it started (the caller keeps the rest), or until the caller
        goes quiet or ``stop`` is set. An idle caller's background runs at full speed, and so does a step the caller
        waits for (not in a background job)."""
        if not offload.active():
            return
        until = time.monotonic() + seconds * (1.0 / SHARE - 1.0)
        while not stop.is_set() and self.busy() and time.monotonic() < until:
            stop.wait(0.02)

    def quiet(self, stop: threading.Event) -> None:
        """Return once the caller is idle for :data:`QUIET_S` or has been busy for :data:`GRACE_S` (or ``stop`` is
        set)."""
        started = time.monotonic()
        while not stop.is_set():
            with self._lock:
                now = time.monotonic()
                if (not self._busy and now - self._last >= QUIET_S) or now - started >= GRACE_S:
                    return
            stop.wait(0.05)


class Counted(Plan):
    """A :class:`~layerwise.model.backends.base.Plan` whose passes count as the caller's (:meth:`Activity.calling`):
    the background waits for a quiet moment, and a timing run holds them.

    Args:
        activity: the caller's passes. Then :class:`~layerwise.model.backends.base.Plan`'s arguments; ``spent``: called
            with each start's seconds.
    """

    def __init__(self, activity: Activity, *args: Any, spent: Callable[[float], None] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._activity = activity
        self._spent = spent

    def start(self, *args: Any) -> Callable[[], torch.Tensor]:
        """:meth:`Plan.start <layerwise.model.backends.base.Plan.start>`, counted (``spent``: told the seconds each
        start took, the whole pass on a synchronous runtime)."""
        with self._activity.calling():
            t0 = time.perf_counter()
            wait = super().start(*args)
            if self._spent is not None:
                self._spent(time.perf_counter() - t0)
            return wait

    def start_ragged(self, *args: Any) -> Callable[[], torch.Tensor]:
        """:meth:`Plan.start_ragged <layerwise.model.backends.base.Plan.start_ragged>`, counted."""
        with self._activity.calling():
            return super().start_ragged(*args)


class Preparer:
    """One worker thread running keyed jobs, each a Future (see the module docstring).

    Args:
        name: the worker thread's name.
        activity: the caller's passes, which background jobs wait to be quiet (default: a new one).
    """

    def __init__(self, name: str, activity: Activity | None = None):
        self.name = name
        self.activity = activity or Activity()
        self.stopping = threading.Event()  # set by stop(): the running job's build child is killed at its next step
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._jobs: dict[Key, cf.Future] = {}
        self.seconds: dict[Key, float] = {}  # key -> seconds its job ran (under _lock)

    def submit(self, key: Key, job: Callable[[], Any], *, background: bool = True) -> cf.Future:
        """The Future of ``key``'s job, submitted now unless known (a failed or cancelled one is submitted again).
        ``background``: wait for a quiet moment and run the build steps in a child process (a caller that waits for
        the result passes ``False``)."""
        with self._lock:
            known = self._jobs.get(key)
            if known is not None and not known.cancelled() and (not known.done() or known.exception() is None):
                return known
            if self.stopping.is_set():
                future: cf.Future = cf.Future()
                future.set_exception(Stopped())
                return future
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
                _LIVE.add(self)
            future = self._pool.submit(self._run, key, job, background)
            self._jobs[key] = future
            return future

    def _run(self, key: Key, job: Callable[[], Any], background: bool) -> Any:
        if self.stopping.is_set():
            raise Stopped
        t0 = time.perf_counter()
        if background:
            self.activity.quiet(self.stopping)
            if self.stopping.is_set():
                raise Stopped
            with offload.offloaded(self.stopping):  # the export and conversions in a child: the caller keeps the GIL
                result = job()
        else:
            result = job()
        with self._lock:
            self.seconds[key] = time.perf_counter() - t0
        return result

    def future(self, key: Key) -> cf.Future | None:
        """The Future of ``key``'s job, or ``None`` when none was submitted."""
        with self._lock:
            return self._jobs.get(key)

    def done(self, key: Key) -> bool:
        """Whether ``key``'s job was submitted and is done (finished, failed or cancelled)."""
        future = self.future(key)
        return future is not None and future.done()

    def pending(self) -> list[Key]:
        """The keys whose jobs are not done, in the order submitted."""
        with self._lock:
            return [key for key, future in self._jobs.items() if not future.done()]

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted is done (``timeout`` seconds at most); ``True`` when none is left. Jobs
        submitted meanwhile (a done job may queue the next) are waited for too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                waiting = [f for f in self._jobs.values() if not f.done()]
            if not waiting:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            cf.wait(waiting, timeout=left)

    def stop(self, timeout: float | None = None) -> None:
        """Cancel the jobs not started, stop the running one after its step (its child killed), and wait for it
        (``timeout`` seconds at most). Later submissions fail with :class:`Stopped`."""
        self.stopping.set()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.shutdown(wait=False, cancel_futures=True)
        if threading.current_thread().name.startswith(self.name):
            return
        with self._lock:
            running = [f for f in self._jobs.values() if not f.done()]
        cf.wait(running, timeout=timeout)


__all__ = ["Activity", "Counted", "GRACE_S", "HOLD_S", "Key", "Preparer", "QUIET_S", "SHARE"]
