"""The early-stopping loop that heads and probes share: train epoch by epoch, score on dev, keep the best epoch's
weights, stop after ``patience`` epochs without a better score, and leave the model at its best epoch.

Example::

    >>> stop = EarlyStopping(patience=2)
    >>> [stop.update(epoch, score, lambda: {"w": epoch}) for epoch, score in enumerate([0.5, 0.7, 0.6, 0.6], 1)]
    [True, True, False, False]
    >>> stop.stopped, stop.best_epoch, stop.best_state
    (True, 2, {'w': 2})
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from ..errors import LayerwiseError

State = TypeVar("State")


class EarlyStopping(Generic[State]):
    """Which epoch is best so far, and whether to stop.

    Args:
        patience: stop after this many epochs in a row without a better score (a positive int).

    Attributes:
        best: the best score so far (``-inf`` before the first epoch).
        best_epoch: its epoch (0 before the first).
        best_state: what ``snapshot()`` returned at that epoch (e.g. copies of the weights).
        stopped: the last :meth:`update` used up the patience.
    """

    def __init__(self, patience: int):
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise LayerwiseError(f"patience must be a positive int (epochs), got {patience!r}")
        self.patience = patience
        self.best = float("-inf")
        self.best_epoch = 0
        self.best_state: State | None = None
        self.stale = 0
        self.stopped = False

    def update(self, epoch: int, score: float, snapshot: Callable[[], State]) -> bool:
        """Record ``epoch``'s dev ``score``; on a better one keep ``snapshot()``. Returns whether it improved."""
        if score > self.best:
            self.best, self.best_epoch, self.stale = score, epoch, 0
            self.best_state = snapshot()
            return True
        self.stale += 1
        self.stopped = self.stale >= self.patience
        return False

    def best_or_raise(self) -> State:
        """The best epoch's state (``RuntimeError`` if no epoch was recorded: a bug, epochs >= 1 is validated)."""
        if self.best_state is None:
            raise RuntimeError("no epoch was trained (epochs >= 1 is validated)")
        return self.best_state


__all__ = ["EarlyStopping"]
