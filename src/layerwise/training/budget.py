"""How long a head or a probe trains when the user does not say: a budget that follows the data.

A fixed epoch count gives a small set a few dozen optimiser steps (1,000 sentences in batches of 256: 32 steps in
8 epochs), far from converged, and a large one far more than it needs. The budget is ``MAX_EPOCHS_BY_DATA`` epochs
held within ``[MIN_STEPS, MAX_STEPS]`` optimiser steps; early stopping on a held-out part of train usually ends it
sooner. Its patience follows the budget too (:func:`patience_for`): on a small set the held-out score is noisy
(100 records: a few points from one check to the next), and a fixed patience of 3 epochs stopped an MLP head on
1,000 SST-2 sentences after 4 of its 40 epochs, 10 points below a converged linear probe. Below ``MIN_HELD_OUT``
held-out items a choice would be noise: the whole budget is trained and the last step kept.
"""

from __future__ import annotations

MIN_STEPS, MAX_STEPS, MAX_EPOCHS_BY_DATA = 300, 20_000, 40
MIN_PATIENCE = 3
MIN_HELD_OUT = 50  # items (records, or sentences) a held-out part needs to choose on; fewer: the last step is kept


def steps_by_data(batches_per_epoch: int) -> int:
    """Optimiser steps for a training split of ``batches_per_epoch`` batches: ``MAX_EPOCHS_BY_DATA`` epochs, at least
    ``MIN_STEPS`` and at most ``MAX_STEPS``."""
    return min(MAX_STEPS, max(MIN_STEPS, MAX_EPOCHS_BY_DATA * max(1, batches_per_epoch)))


def held_out_count(items: int, share: float) -> int:
    """How many of ``items`` to hold out of training to choose on: ``share`` of them, or 0 (hold none out: train the
    whole budget, keep the last step) when that is under ``MIN_HELD_OUT``."""
    k = round(share * items) if share > 0 else 0
    return k if k >= MIN_HELD_OUT else 0


def patience_for(checks: int) -> int:
    """Checks (epochs, or held-out evaluations) without a better score before stopping, for a budget of ``checks``:
    a quarter of them, at least ``MIN_PATIENCE``."""
    return max(MIN_PATIENCE, checks // 4)
