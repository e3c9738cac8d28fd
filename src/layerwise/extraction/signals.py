"""The process's signal handling as it was before a Ray cluster started here, put back when that cluster ends.

``ray.init`` installs Abseil's failure-signal handler in the driver: its own handlers for SIGSEGV, SIGBUS, SIGILL,
SIGFPE, SIGABRT, SIGTRAP and SIGTERM, running on an alternate signal stack of its own. ``ray.shutdown`` does not
restore what was there before: it resets the fatal signals and SIGTERM to the default action (Python's
``faulthandler`` no longer reports a crash, and a SIGTERM handler the program set no longer runs), and leaves its
SIGBUS and SIGTRAP handlers and its alternate stack in place (Ray pull request #65749 proposes restoring them; open
in 2026). A process that goes on after the run (a notebook, a service, a test session) was left with that state: in
this project's test session a later signal was delivered on a stack that was no longer valid and the process died
with a bare segmentation fault, in whichever test was running.

:class:`SignalState` records the state before the cluster starts and :meth:`SignalState.restore` puts it back after
the cluster ends: the Python-level handlers, ``faulthandler`` (re-enabled where it was), the alternate signal stack
(POSIX ``sigaltstack``, where the C library is reachable), and the default action for the signals Ray caught that
nothing caught before.
"""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import sys
from typing import Any, TextIO, Union

# the signals Ray's failure handler takes over (SIGTERM by a Python-level handler as well)
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT", "SIGTRAP",
                                                     "SIGTERM", "SIGINT") if hasattr(signal, name))


class _Stack(ctypes.Structure):
    """POSIX ``stack_t`` (Linux and macOS layouts agree on these three fields' order)."""

    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def _libc() -> Any:
    """The C library of this process, or None where it cannot be reached (Windows)."""
    if sys.platform == "win32":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class SignalState:
    """What :meth:`save` found; :meth:`restore` puts it back (both in the main thread; elsewhere they do nothing,
    as Python allows signal handlers to be set in the main thread only).

    Attributes:
        handlers: signal number -> its Python-level handler (``signal.getsignal``).
        faulthandler: whether ``faulthandler`` was enabled.
        stack: the alternate signal stack (``stack_t``), or None where it could not be read.
    """

    def __init__(self, main: bool = False, fault_file: Union[TextIO, int, None] = None) -> None:
        self.handlers: dict[int, Any] = {}
        self.faulthandler = False
        self.stack: _Stack | None = None
        self._main = main
        self._file = fault_file

    @classmethod
    def save(cls, fault_file: Union[TextIO, int, None] = None) -> "SignalState":
        """The state now. ``fault_file``: where a re-enabled ``faulthandler`` writes (a file or a file descriptor;
        default ``sys.__stderr__``)."""
        import threading

        main = threading.current_thread() is threading.main_thread()
        state = cls(main, fault_file)
        if not main:
            return state
        state.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        state.faulthandler = faulthandler.is_enabled()
        libc = _libc()
        if libc is not None:
            old = _Stack()
            if libc.sigaltstack(None, ctypes.byref(old)) == 0:
                state.stack = old
        return state

    def restore(self) -> None:
        """Put back what :meth:`save` found (each part on its own: one that fails leaves the others done)."""
        if not self._main:
            return
        if self.stack is not None:
            libc = _libc()
            if libc is not None:
                stack = _Stack(self.stack.ss_sp, self.stack.ss_flags & ~1, self.stack.ss_size)  # not SS_ONSTACK
                if not self.stack.ss_sp:
                    stack.ss_flags = 2  # SS_DISABLE: there was none
                libc.sigaltstack(ctypes.byref(stack), None)
        for number, handler in self.handlers.items():
            # None: set outside Python (the C library's default here); re-set to the default action
            try:
                signal.signal(number, signal.SIG_DFL if handler is None else handler)
            except (OSError, ValueError, TypeError):
                pass
        if self.faulthandler:
            file = sys.__stderr__ if self._file is None else self._file
            faulthandler.disable()
            if file is None:
                return
            try:
                faulthandler.enable(file=file, all_threads=True)
            except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor
                pass


__all__ = ["SignalState"]
