"""A Ray cluster started by layerwise leaves the process's signal handling as it found it (``ray.shutdown`` alone
does not: :mod:`layerwise.extraction.signals`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from layerwise.extraction.signals import SignalState

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and sigaltstack")

STATE = textwrap.dedent("""
    import ctypes, faulthandler, signal

    class Stack(ctypes.Structure):
        _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]

    def state():
        '''The caught signals (the kernel's mask), the alternate stack, faulthandler, the SIGTERM handler.'''
        (caught,) = [int(line.split()[1], 16) for line in open("/proc/self/status") if line.startswith("SigCgt")]
        stack = Stack()
        ctypes.CDLL(None).sigaltstack(None, ctypes.byref(stack))
        return {"caught": sorted(signal.Signals(i + 1).name for i in range(64)
                                 if caught >> i & 1 and i + 1 in signal.valid_signals()),
                "stack": [stack.ss_sp or 0, stack.ss_size], "faulthandler": faulthandler.is_enabled(),
                "sigterm": repr(signal.getsignal(signal.SIGTERM))}
""")

RAY_RUN = STATE + textwrap.dedent("""
    import json, sys
    import ray
    from layerwise.extraction.cluster import RayCluster

    before = state()
    with RayCluster(ray, None) as cluster:
        assert cluster.owned
        during = state()
    print(json.dumps({"before": before, "during": during, "after": state()}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the caught signals from /proc")
def test_a_local_ray_cluster_leaves_the_signal_handling_as_it_found_it(tmp_path):
    pytest.importorskip("ray")
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", RAY_RUN], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    before, during, after = seen["before"], seen["during"], seen["after"]
    # what Ray changes while it runs (were it not so, this test would check nothing)
    assert during["stack"] != before["stack"] and "SIGTERM" in during["caught"]
    assert after == before  # faulthandler's signals caught again, its stack back, SIGTERM's default back


def test_restore_puts_back_handlers_stack_and_faulthandler():
    """What Ray's shutdown leaves (a handler of its own, a fatal signal reset to default, another alternate stack,
    faulthandler's handlers gone) is undone by restore."""
    import ctypes
    import faulthandler

    from layerwise.extraction.signals import _Stack

    libc = ctypes.CDLL(None)
    was_enabled = faulthandler.is_enabled()
    faulthandler.enable()
    saved = SignalState.save(sys.__stderr__)
    before = _Stack()
    libc.sigaltstack(None, ctypes.byref(before))
    other = ctypes.create_string_buffer(65536)
    try:
        libc.sigaltstack(ctypes.byref(_Stack(ctypes.addressof(other), 0, 65536)), None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # as Ray's shutdown does: faulthandler no longer called
        saved.restore()
        now = _Stack()
        libc.sigaltstack(None, ctypes.byref(now))
        assert (now.ss_sp, now.ss_size) == (before.ss_sp, before.ss_size)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert faulthandler.is_enabled()
        if os.path.exists("/proc/self/status"):  # faulthandler's own (C) handler again
            (caught,) = [int(ln.split()[1], 16) for ln in open("/proc/self/status") if ln.startswith("SigCgt")]
            assert caught >> (signal.SIGSEGV - 1) & 1
    finally:
        libc.sigaltstack(ctypes.byref(before), None)
        if not was_enabled:
            faulthandler.disable()
