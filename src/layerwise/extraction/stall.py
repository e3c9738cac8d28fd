"""The stall watchdog of a Ray run: the stages' progress marks, and a run ended when no part finished for a while.

Each stage notes the parts it finished in the run's progress directory (``OUTPUT/.layerwise-progress``, one file per
stage and process, so no two writers share one: :func:`mark`). :class:`StallWatchdog` watches the parts on disk
and, when none finished for ``stall_timeout`` seconds, ends the driver's wait with a message that says what each
stage has done, what the cluster has free and what to do; the finished parts stay for a resume.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from typing import Any

from ..store.layout import PART_RE

PROGRESS = ".layerwise-progress"  # the stages' progress marks, inside the output while a run goes on


def mark(progress: str | None, stage: str, part: int) -> None:
    """Note that ``stage`` finished ``part`` (one line in this process's own file: no two writers share one)."""
    if progress is None:
        return
    try:
        with open(os.path.join(progress, f"{stage}-{socket.gethostname()}-{os.getpid()}"), "a") as fh:
            fh.write(f"{part}\n")
    except OSError:
        pass  # progress marks only feed the stall message


def progress_counts(progress: str) -> dict[str, int]:
    """How many distinct parts each stage has marked finished."""
    counts: dict[str, set[int]] = {}
    try:
        names = os.listdir(progress)
    except OSError:
        return {}
    for name in names:
        stage = name.split("-", 1)[0]
        try:
            with open(os.path.join(progress, name)) as fh:
                counts.setdefault(stage, set()).update(int(x) for x in fh.read().split())
        except (OSError, ValueError):
            continue
    return {k: len(v) for k, v in counts.items()}


def parts_on_disk(out: str) -> int:
    """How many part stores are in place in ``out``."""
    try:
        return sum(1 for e in os.scandir(out) if PART_RE.match(e.name))
    except OSError:
        return 0


class StallWatchdog(threading.Thread):
    """Ends a run (an exception in the driver's thread) when no part has finished for ``timeout`` seconds; the
    message (``message``) says what each stage has done and what the cluster has free."""

    def __init__(self, ray: Any, out: str, progress: str, parts: int, workers: int, timeout: float):
        super().__init__(daemon=True, name="layerwise-stall-watchdog")
        self.ray, self.out, self.progress, self.parts, self.workers = ray, out, progress, parts, workers
        self.timeout, self.driver = timeout, threading.get_ident()
        self.done = threading.Event()
        self.message: str | None = None

    def run(self) -> None:
        poll = max(0.05, min(5.0, self.timeout / 4))
        seen, since = parts_on_disk(self.out), time.monotonic()
        while not self.done.wait(poll):
            n = parts_on_disk(self.out)
            if n != seen:
                seen, since = n, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                self.message = self.describe(n)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.driver),
                                                           ctypes.py_object(KeyboardInterrupt))
                return

    def describe(self, finished: int) -> str:
        """The stall message: stages, pool, free resources, what to do."""
        stages = progress_counts(self.progress)
        try:
            free = self.ray.available_resources()
            total = self.ray.cluster_resources()
            room = (f"{free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs free"
                    + (f", {free.get('GPU', 0):g} of {total.get('GPU', 0):g} GPUs" if total.get("GPU") else ""))
        except Exception:  # noqa: BLE001 - the message is built even when Ray cannot answer
            room = "Ray did not say what is free"
        return (
            f"no part finished for {self.timeout:g} s (stall_timeout, --stall-timeout): {finished:,} of "
            f"{self.parts:,} parts are on disk. Stages: read and tokenised {stages.get('prepared', 0):,} parts, "
            f"encoded {stages.get('encoded', 0):,} (pool of {self.workers}), written {stages.get('written', 0):,}; "
            f"cluster: {room}. The finished parts are kept: rerun the same command to resume. If a stage holds no "
            f"resources, run `ray status` (or open the Ray dashboard) to see what waits; give fewer --num-workers "
            f"or a longer --stall-timeout for parts that take longer"
        )


__all__ = ["PROGRESS", "StallWatchdog", "mark", "parts_on_disk", "progress_counts"]
