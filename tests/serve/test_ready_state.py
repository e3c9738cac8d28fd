"""``/ready`` tells the truth about the warmed depths only: once they are prepared it stays 200, whatever other depths
requests ask for and the background prepares meanwhile (those are listed in ``preparing``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from layerwise.serve.ready import Readiness


class Backend:
    """A backend whose background preparation the test drives: ``pending`` is what it says is being prepared."""

    name = "torch"

    def __init__(self) -> None:
        self.pending_depths: list[int] = [2]
        self.warmed: list[int] = []
        self.release = threading.Event()

    def warm(self, layers):
        self.warmed.append(max(layers))

    def pending(self):
        if self.release.is_set() and 2 in self.pending_depths:
            self.pending_depths.remove(2)
        return list(self.pending_depths)


def test_ready_waits_for_the_warmed_depths_and_then_stays_ready():
    backend = Backend()
    ready = Readiness(SimpleNamespace(backend=backend), [2]).start()
    state = ready.state()
    assert state["ready"] is False and state["pending"] == [2] and state["depths"] == {"2": "preparing"}
    backend.release.set()  # the warmed depth's preparation ends
    assert ready.done.wait(10)
    assert ready.state() == {"ready": True, "depths": {"2": "torch"}, "pending": [], "preparing": [], "error": None}
    backend.pending_depths.append(5)  # a request at an unwarmed depth: its preparation runs in the background
    state = ready.state()
    assert state["ready"] is True and state["pending"] == [] and state["preparing"] == [5], state
    backend.pending_depths.append(2)  # stages of a warmed depth asked by mixed requests: still ready
    assert ready.state()["ready"] is True
