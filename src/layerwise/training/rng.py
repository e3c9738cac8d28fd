"""Seeded randomness without touching global state: training is reproducible and the caller's RNGs are left alone.

:func:`seeded` forks torch's global generators (CPU, and every CUDA device when present), seeds them inside the
block (module initialisation and dropout draw from them) and restores them on exit; it yields a local
``torch.Generator`` for the caller's own draws (batch order). Python's ``random`` and NumPy's global state are never
touched.

Example::

    >>> import torch
    >>> before = torch.get_rng_state()
    >>> with seeded(0) as gen:
    ...     order = torch.randperm(5, generator=gen)
    >>> torch.equal(before, torch.get_rng_state())
    True
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int, device: str | torch.device = "cpu") -> Iterator[torch.Generator]:
    """Inside: torch's CPU generator (and ``device``'s, on CUDA) seeded with ``seed``; outside: as before.

    Yields a local CPU generator for the caller's own draws. Only the generators of ``device`` are touched (
    ``torch.manual_seed`` would reseed every CUDA device, which ``fork_rng`` would not restore).
    """
    dev = torch.device(device)
    cuda = [torch.cuda.current_device() if dev.index is None else dev.index] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield torch.Generator().manual_seed(seed)
