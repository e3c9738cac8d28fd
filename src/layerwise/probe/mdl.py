"""Minimum description length of a layer's labels: the online code (Voita & Titov, 2020, "Information-Theoretic
Probing with Minimum Description Length").

Accuracy says how well a probe reads a property from a layer once it has seen all the training data; the online code
also says how much data it needed. The training rows are put in a random order (whole sentences for a tagging task)
and cut into blocks at :data:`FRACTIONS` of them. The first block's labels are sent with the uniform code
(``log2 K`` bits each, ``K`` classes); every later block's with the probe trained on all the blocks before it (its
cross-entropy in bits). The sum is the online code length: small when a probe learns the labels from few examples.
Compression is the uniform code length of all the rows over the online code length (1: nothing learned).

The probe is the linear one of :mod:`layerwise.probe.linear` at a fixed strength (the strength its full fit chose),
solved to convergence by the same solver on the cached features, read in chunks. A code must give every label a
non-zero probability, also a label no earlier block held: each block's probabilities are mixed with the uniform one at
weight :data:`SMOOTHING` (at most ``-log2(1 - SMOOTHING)`` = 0.0014 bits more per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import LayerwiseError
from .linear import MAX_ITER
from .solver import FeatureView, Problem, solve

FRACTIONS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.0625, 0.125, 0.25, 0.5, 1.0)  # Voita & Titov's blocks
SMOOTHING = 1e-3


@dataclass
class OnlineCode:
    """The online code of a probe's labels on the training rows.

    Attributes:
        bits: the online code length in bits (first block uniform, each later one under the probe trained on the
            blocks before it).
        uniform_bits: ``rows * log2(classes)``: the code length without a probe.
        rows: the rows coded (training rows with a known label).
        blocks: per block, ``{"rows": end of the block, "bits": its code length}``.
    """

    bits: float
    uniform_bits: float
    rows: int
    blocks: list[dict] = field(default_factory=list)

    @property
    def compression(self) -> float:
        """``uniform_bits / bits``: how many times shorter the labels are to send with the probe (1: not at all)."""
        return self.uniform_bits / self.bits if self.bits > 0 else float("inf")

    def report(self) -> dict:
        """JSON-ready: the code length in kbits, the uniform one, the compression and the blocks."""
        return {"kbits": round(self.bits / 1000, 3), "uniform_kbits": round(self.uniform_bits / 1000, 3),
                "compression": round(self.compression, 4), "rows": self.rows,
                "blocks": [{"rows": b["rows"], "bits": round(b["bits"], 2)} for b in self.blocks]}


def block_ends(n: int, groups: np.ndarray | None, order: np.ndarray,
               fractions: tuple[float, ...] = FRACTIONS) -> list[int]:
    """The end row of each block (positions in ``order``, ascending, the last ``n``): at ``fractions`` of the rows,
    moved forward to the end of a group (a tagging task's sentence) so that no sentence is cut; empty blocks are
    dropped."""
    ends: list[int] = []
    for f in fractions:
        end = min(n, max(1, int(round(f * n))))
        if groups is not None:
            g = groups[order]
            while end < n and g[end] == g[end - 1]:
                end += 1
        if not ends or end > ends[-1]:
            ends.append(end)
    if ends[-1] != n:
        ends.append(n)
    return ends


def online_code(x: torch.Tensor, y: np.ndarray, classes: int, strength: float, *, groups: np.ndarray | None = None,
                combine: str = "concat", seed: int = 0, fractions: tuple[float, ...] = FRACTIONS) -> OnlineCode:
    """The online code length of labels ``y [rows]`` (``0 <= y < classes``; rows with a negative label are left out)
    given features ``x [rows, K, W]`` (float16 or float32; read in chunks, never copied whole), with the linear
    probe at strength ``strength`` (``C``) trained on the blocks before each one.

    Args:
        groups: ``[rows]`` group ids (a tagging task's sentence index): the order is drawn by group, and a block
            never cuts one.
        combine: how the ``K`` layers are combined (``concat`` or ``sum``).
        seed: the order of the rows (and of the groups).
        fractions: where the blocks end, as shares of the rows (ascending, the last 1.0).
    """
    y = np.asarray(y)
    keep = np.flatnonzero(y >= 0)
    n = len(keep)
    if n < 2:
        raise LayerwiseError(f"an online code needs at least 2 labelled rows, got {n}: give the probe more labelled "
                             f"training data")
    rng = np.random.default_rng(seed)
    if groups is None:
        order = rng.permutation(n)
        kept_groups = None
    else:
        kept_groups = np.asarray(groups)[keep]
        unique = np.unique(kept_groups)
        rank = np.empty(len(unique), dtype=np.int64)
        rank[rng.permutation(len(unique))] = np.arange(len(unique))
        order = np.lexsort((np.arange(n), rank[np.searchsorted(unique, kept_groups)]))  # groups in random order
    view = FeatureView(x if x.dtype in (torch.float16, torch.float32) else x.float(), combine)
    rows = keep[order]  # into x, in coding order
    labels = torch.from_numpy(y[rows].astype(np.int64))
    mean, scale = view.moments(rows)
    everything = Problem(view, rows, labels, classes, mean, scale)
    ends = block_ends(n, kept_groups, order, fractions)
    uniform = float(np.log2(classes))
    blocks = [{"rows": ends[0], "bits": ends[0] * uniform}]
    start = None
    for a, b in zip(ends[:-1], ends[1:]):
        seen = everything.subset(np.arange(a))
        # a probe per block, warm-started from the previous one (its weights on the same standardised features)
        sol = solve(seen, strength, start=start, max_iter=MAX_ITER, seed=seed)
        start = (sol.weight, sol.bias)
        nxt = everything.subset(np.arange(a, b))
        bias = torch.from_numpy(np.nan_to_num(sol.bias, neginf=-1e30).astype(np.float32))
        p = torch.softmax(nxt.logits(sol.effective, bias).double(), 1)
        p = (1 - SMOOTHING) * p + SMOOTHING / classes
        bits = float(-torch.log2(p.gather(1, nxt.y[:, None])).sum())
        blocks.append({"rows": b, "bits": bits})
    return OnlineCode(bits=sum(blk["bits"] for blk in blocks), uniform_bits=n * uniform, rows=n, blocks=blocks)


__all__ = ["FRACTIONS", "SMOOTHING", "OnlineCode", "block_ends", "online_code"]
