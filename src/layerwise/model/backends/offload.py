"""Build steps in a child process: what ``backend="auto"`` prepares in the background never stalls the caller.

torch's ONNX export (tracing and the exporter's graph passes) and OpenVINO's conversion run in native code that holds
Python's GIL for one to three seconds at a time. Run in the background thread of ``auto``, they froze every other
thread of the process for that long: a server's other requests waited up to 2.4 s (``./dev bench cold_start``). Under
:func:`offloaded` (entered by ``auto``'s background thread, never on a caller's path) those steps run in a child
Python process instead, at the lowest CPU priority (``SCHED_IDLE`` on Linux: it runs on a core the caller leaves idle;
``nice`` 10 elsewhere): the parent thread only waits on it, so the caller's
threads keep the interpreter, and on a machine with few cores the child yields the CPU to them.

A step is a file-to-file function of layerwise named ``"layerwise.<module>:<function>"`` (its arguments are
strings), run as ``python -m layerwise.model.backends.offload STEP ARGS...``: never ``multiprocessing``'s spawn,
which re-runs a user's script that has no ``if __name__ == "__main__"`` guard. The child sees the parent's
``sys.path``. A step that fails in the child (a missing interpreter, a class it cannot import, any error) is run
again in the calling process, where the same error, if any, is raised with its real traceback; the child's last lines
are said once. When the preparation is stopped (process exit), the child is killed and :class:`Stopped` raised in the
waiting thread.

A child never outlives its parent (a server killed with ``kill -9`` during a build): on Linux the kernel sends it
``SIGKILL`` when the thread that started it ends (``PR_SET_PDEATHSIG``, armed by the child's first lines,
:func:`child_setup`: nothing runs between fork and exec, where a process with threads can deadlock), and
everywhere the child watches a pipe from its parent (its stdin) and exits at once when the pipe closes. A step writes
only into the temporary directory its parent's :meth:`~layerwise.model.backends.cache.GraphCache.put` made (named
after the parent's PID), so what a killed child leaves is a dead process's temporary file, which the next trim or
``layerwise cache --clear`` removes.

The steps: :func:`layerwise.model.backends.ort.export_saved` (a truncated model written by
:func:`~layerwise.model.backends.ort.save_truncated` to an ONNX graph), :func:`layerwise.model.backends.openvino.
compile_graph` (an ONNX graph or IR compiled by OpenVINO into a blob), :func:`layerwise.model.backends.openvino.
convert_graph` (an ONNX graph to OpenVINO's int8 IR), :func:`layerwise.model.backends.ort.quantize_graph` (ONNX
Runtime's dynamic int8). This module imports none of them (it runs whichever it is named).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from ...errors import LayerwiseError
from ...notices import notice

NICE = 10  # the child's CPU priority below the caller's
PR_SET_PDEATHSIG = 1  # prctl(2): the signal the child gets when the thread that started it ends
WATCH = "LAYERWISE_OFFLOAD_WATCH"  # set in a child's environment: it exits when its stdin (a pipe from us) closes
PARENT = "LAYERWISE_OFFLOAD_PARENT"  # set in a child's environment: its parent's PID (child_setup)
_LOCAL = threading.local()


class Stopped(Exception):
    """The background preparation was stopped (the process is exiting): the step's child was killed."""


@contextmanager
def offloaded(stop: threading.Event) -> Iterator[None]:
    """Within it, the build steps this thread runs go to a child process (:func:`run`); ``stop`` set: the child is
    killed and :class:`Stopped` raised."""
    before = getattr(_LOCAL, "stop", None)
    _LOCAL.stop = stop
    try:
        yield
    finally:
        _LOCAL.stop = before


def active() -> bool:
    """Whether this thread's build steps run in a child process (inside :func:`offloaded`)."""
    return getattr(_LOCAL, "stop", None) is not None


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the parent's imports, a source checkout too
    env.setdefault("OMP_NUM_THREADS", "1")  # a trace and a conversion need no thread pool; the caller needs the cores
    env["LAYERWISE_QUIET"] = "1"
    env[WATCH] = "1"  # the child ends when its pipe from us closes
    env[PARENT] = str(os.getpid())  # the child lowers its priority and arms PR_SET_PDEATHSIG itself (child_setup)
    return env


def child_setup(parent: int, *, idle: bool = True) -> None:
    """What a child runs first, in its own interpreter (never between fork and exec: ``preexec_fn`` runs Python in a
    forked copy of a process with threads, where a lock another thread held at the fork, the dynamic loader's or an
    allocator's, is never released and the child hangs before its step starts; its parent then waited for ever,
    holding the build lock every later export needed). A lower CPU priority (``SCHED_IDLE`` on Linux, else ``nice``
    :data:`NICE`), and on Linux ``SIGKILL`` when the thread that started it ends (``PR_SET_PDEATHSIG``); it exits at
    once when its parent (PID ``parent``) ended before the signal was armed. ``idle=False``: the priority is left
    as it is (a child doing the caller's own work, e.g. a probe run's extraction)."""
    if idle:
        try:
            os.nice(NICE)
        except OSError:  # not permitted here: the child runs at the caller's priority
            pass
        try:  # Linux: runs only on a core the caller leaves idle
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the pipe watch (watch_parent) still ends the child
            pass
    if parent and os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def watch_parent(fd: int = 0) -> threading.Thread:
    """In a child: a daemon thread that reads the descriptor ``fd`` (default: stdin, a pipe from the parent) until it
    closes, then ends the process at once (the parent died, or gave up the step); returns the thread. It reads the raw
    descriptor (never ``sys.stdin``, whose buffer lock would stall the interpreter's exit)."""

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        os._exit(3)

    thread = threading.Thread(target=watch, name="layerwise-parent-watch", daemon=True)
    thread.start()
    return thread


def run(step: str, *args: str) -> bool:
    """Run ``step`` (``"layerwise.<module>:<function>"``, a function that takes strings, :func:`step_function`)
    with ``args`` in a child process when this thread is inside
    :func:`offloaded`: ``True`` when the child did it; ``False`` (not offloaded, or the child failed: the caller runs
    the step itself, and its error, if any, is raised there). :class:`Stopped` when the preparation is stopped."""
    stop = getattr(_LOCAL, "stop", None)
    if stop is None:
        return False
    if stop.is_set():
        raise Stopped
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__, step, *args], env=_child_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        notice(f"could not start a child process for {step} ({exc}); it runs in this process")
        return False
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        code = _wait(proc, stop)
    finally:
        _LOCAL.waited = getattr(_LOCAL, "waited", 0.0) + time.monotonic() - started
    reader.join(5)
    if proc.stdin is not None:  # held open while the child ran: its end of the pipe closes when we die
        proc.stdin.close()
    if code != 0:
        tail = "".join(err[-5:]).strip().replace("\n", " | ")
        notice(f"{step} in a child process failed (exit {code}: {tail[-400:]}); it runs in this process")
        return False
    return True


def waited() -> float:
    """Seconds this thread has spent waiting for its children's steps (a background step's own work is its wall time
    less what it waited: :meth:`~layerwise.model.backends.preparer.Activity.pace`)."""
    return float(getattr(_LOCAL, "waited", 0.0))


def _wait(proc: subprocess.Popen, stop: threading.Event) -> int:
    """The child's exit code; killed (and :class:`Stopped` raised) once ``stop`` is set."""
    while True:
        try:
            code = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            if stop.is_set():
                proc.kill()
                proc.wait()
                if proc.stdin is not None:
                    proc.stdin.close()
                raise Stopped from None
    return code


def step_function(step: str) -> Callable[..., object]:
    """The function a step names: ``"layerwise.<module>:<function>"`` (a function of layerwise's own that takes
    strings); :class:`~layerwise.LayerwiseError` for anything else."""
    module, _, name = step.partition(":")
    if not module.startswith("layerwise.") or not name.isidentifier():
        raise LayerwiseError(f"unknown step {step!r}: a step is 'layerwise.<module>:<function>', e.g. "
                         f"'layerwise.model.backends.ort:export_saved'")
    function = getattr(importlib.import_module(module), name, None)
    if not callable(function):
        raise LayerwiseError(f"unknown step {step!r}: {module} has no function {name!r}")
    return function


def main(argv: list[str] | None = None) -> int:
    """The child's entry: ``STEP ARGS...``; exit 0 when done, 2 for an unknown step, 1 (with the traceback on
    stderr) when the step failed, 3 when its parent's pipe closed first (``$LAYERWISE_OFFLOAD_WATCH``)."""
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(PARENT, "").isdigit():
        child_setup(int(os.environ[PARENT]))
    if os.environ.get(WATCH) == "1":
        watch_parent()
    try:
        function = step_function(argv[0] if argv else "")
    except (LayerwiseError, ImportError) as exc:
        print(exc, file=sys.stderr)
        return 2
    function(*argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
