"""Progress of long work, where the user can see it: a tqdm bar on a terminal, plain periodic lines elsewhere.

A job run under ``nohup``, in CI or with stderr sent to a log file has no terminal, so a bar would be ``\\r``-joined
noise (or, as before, nothing at all for twenty minutes). There, :func:`progress_bar` gives a :class:`LineProgress`:
one ``layerwise: extract 12,000/80,000 rec (15%), 41.2 rec/s, 4m51s in, about 27m30s left`` line every
:func:`interval` seconds (30 by default; ``$LAYERWISE_PROGRESS_SECONDS``), and a last line when the work ends, but
only once the work has run that long: a short job prints nothing. ``-q`` (``progress=False``) or
``$LAYERWISE_QUIET`` silences both.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any

DEFAULT_INTERVAL = 30.0  # seconds between two progress lines on a stderr that is no terminal


def interval() -> float:
    """Seconds between two plain progress lines: ``$LAYERWISE_PROGRESS_SECONDS``, else :data:`DEFAULT_INTERVAL`."""
    raw = os.environ.get("LAYERWISE_PROGRESS_SECONDS", "")
    try:
        seconds = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        seconds = DEFAULT_INTERVAL
    return seconds if seconds > 0 else DEFAULT_INTERVAL


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class LineProgress:
    """tqdm's interface as :func:`progress_bar`'s callers use it (``update``, ``close``, a context manager, ``n``,
    ``total``), writing one plain line every ``every`` seconds once the work has run that long.

    Args:
        total: how many units the work has (``None``: unknown, no percentage or time left).
        initial: units already done (a resumed job): the rate counts only what this run does.
        desc, unit: what the line calls the work and its units (``"extract"``, ``"rec"``).
        every: seconds between lines (default :func:`interval`).
        file: where the lines go (default ``sys.stderr``).
    """

    def __init__(self, total: int | None = None, initial: int = 0, desc: str = "", unit: str = "it",
                 every: float | None = None, file: IO[str] | None = None, **_tqdm_options: Any):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.every = interval() if every is None else every
        self.file = file
        self._start_n = initial
        self._started = self._last = time.monotonic()
        self.lines = 0
        self.postfix = ""
        self._closed = False

    def update(self, n: int = 1) -> None:
        """``n`` more units done; a line when ``every`` seconds have passed since the last one (or the start)."""
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._say(now)

    def line(self, now: float | None = None, done: bool = False) -> str:
        """The progress line as it would be written now (without a newline)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._started, 1e-9)
        rate = (self.n - self._start_n) / elapsed
        counted = f"{self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)" if self.total \
            else f"{self.n:,} {self.unit}"
        parts = [f"{self.desc} {counted}".strip(), f"{rate:,.1f} {self.unit}/s",
                 f"{_duration(elapsed)} {'in all' if done else 'in'}"]
        if self.total and rate > 0 and not done and self.n < self.total:
            parts.append(f"about {_duration((self.total - self.n) / rate)} left")
        return "layerwise: " + ", ".join(parts + ([self.postfix] if self.postfix else []))

    def _say(self, now: float, done: bool = False) -> None:
        from .notices import quiet

        if quiet():
            return
        print(self.line(now, done), file=self.file or sys.stderr, flush=True)
        self.lines += 1

    def close(self) -> None:
        """The work ended: a last line, if any was written before."""
        if not self._closed:
            self._closed = True
            if self.lines:
                self._say(time.monotonic(), done=True)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Text the next lines end with (tqdm's interface): e.g. ``"3,400 tok/s, 0 skipped"``."""
        self.postfix = s

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(show: bool | None, iterable: Any = None, **options: Any) -> Any:
    """A progress display for work of ``options`` (tqdm's: ``total``, ``initial``, ``desc``, ``unit``, ``leave``,
    ``file``...): ``show=True`` a tqdm bar, ``False`` none, ``None`` (the default of every command and function) a
    tqdm bar when stderr is a terminal, else a :class:`LineProgress`. With ``iterable``, iterate the result as tqdm
    (the plain lines count each item)."""
    from tqdm.auto import tqdm

    if show is None and not _stderr_is_terminal():
        bar = LineProgress(**options)
        if iterable is None:
            return bar
        return _counted(iterable, bar)
    return tqdm(iterable, disable=not (True if show is None else show), **options)


def _counted(iterable: Any, bar: LineProgress) -> Any:
    with bar:
        for item in iterable:
            yield item
            bar.update(1)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


__all__ = ["DEFAULT_INTERVAL", "LineProgress", "interval", "progress_bar"]
