"""The guard of a driver's own cluster (layerwise.extraction.guard), without Ray: a real driver process starts the
guard, then a "cluster" of processes carrying its marker (one in a session of its own with a child, as Ray's agents
are), and another child without it. ``kill -9`` of the driver ends the cluster's processes and only them; a driver
that closes the guard (its run ended) has the same effect while it lives on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tiny import wait_until

DRIVER = r"""
import os, subprocess, sys, time
from layerwise.extraction.cluster import Guard
guard = Guard().start()
env = {**os.environ, **guard.environment()}
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
# the "cluster": a process in its own session whose child outlives it (as Ray's agents outlive the raylet), and a
# plain child; then a child of the driver that is not the cluster's
agent = subprocess.Popen([sys.executable, "-c",
                          "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)", *sleeper],
                         env=env, start_new_session=True)
worker = subprocess.Popen(sleeper, env=env)
other = subprocess.Popen(sleeper)
time.sleep(1.5)  # the guard sees the tree at least once
print(agent.pid, worker.pid, other.pid, guard.process.pid, flush=True)
if sys.argv[1] == "close":
    sys.stdin.readline()  # the test has seen the cluster's processes: only now is the guard closed
    guard.close()
    guard.wait(30)
    print("closed", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as fh:
                if int(fh.read().split(")")[-1].split()[1]) == pid:
                    out.append(int(p))
        except OSError:
            continue
    return out


@pytest.mark.parametrize("how", ["kill", "close"])
def test_the_guard_ends_the_cluster_and_only_it(how):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    started: list[int] = []
    try:
        agent, worker, other, guard = map(int, driver.stdout.readline().split())
        # the agent starts its child itself: on a loaded machine that can come after the driver's line
        agent_child = wait_until(lambda: _children(agent), 30, "the agent's child started", interval=0.05)
        assert len(agent_child) == 1
        started = [agent, *agent_child, worker, other, guard]
        cluster = [agent, agent_child[0], worker]
        if how == "kill":
            os.kill(driver.pid, signal.SIGKILL)  # the driver alone, as an out-of-memory kill would
            driver.wait(10)
        else:
            driver.stdin.write("go\n")
            driver.stdin.flush()
            assert driver.stdout.readline().strip() == "closed"
        wait_until(lambda: not any(map(_alive, cluster)), 15, "the cluster's processes ending with the driver's run",
                   interval=0.1)
        wait_until(lambda: not _alive(guard), 10, "the guard ending", interval=0.1)
        assert _alive(other), "a child of the driver that is not the cluster's was ended"
    finally:
        for pid in [driver.pid, *started]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        driver.wait(10)


def test_the_guard_refuses_bad_arguments():
    done = subprocess.run([sys.executable, "-m", "layerwise.extraction.guard", "x"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage: python -m layerwise.extraction.guard DRIVER_PID MARKER" in done.stderr
