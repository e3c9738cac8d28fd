"""A token-activation store as a ``torch.utils.data.IterableDataset`` of batches, for a ``DataLoader`` with any number
of workers (imports torch; :meth:`ActivationStore.token_dataset <layerwise.store.activations.ActivationStore.
token_dataset>` imports it on use).

Each worker opens the store itself (the dataset pickles as a path and options) and gives every ``num_workers``-th
batch of the same global order (:class:`~layerwise.store.token_loader.TokenLoader`), so the workers together give
every row exactly once per epoch and the same batches for the same seed. Use ``DataLoader(dataset, batch_size=None,
num_workers=n)``: the dataset's items are batches already.

Example::

    >>> ds = lw.open_store("acts").token_dataset(layer=8, batch_size=4096, seed=0)   # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)    # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info


class TokenDataset(IterableDataset):
    """Batches ``[<= batch_size, W]`` of one layer of a token-activation store.

    Args:
        make_loader: ``make_loader(layer, batch_size, epoch=, **options)`` gives the
            :class:`~layerwise.store.token_loader.TokenLoader` (picklable: it opens the store in each worker).
        layer: a stored layer. batch_size: rows per batch.
        options: :meth:`~layerwise.store.activations.ActivationStore.token_loader`'s keywords (``shuffle``, ``seed``,
            ``epoch``, ``start``, ``dtype``, ``skip_special``, ``drop_last``).
    """

    def __init__(self, make_loader: Callable[..., Any], layer: int = -1, batch_size: int = 4096, **options: Any):
        super().__init__()
        self.make_loader = make_loader
        self.layer, self.batch_size, self.options = layer, batch_size, dict(options)
        self.epoch = int(self.options.pop("epoch", 0))
        self.loader(1, 0)  # the arguments checked here, not in a worker

    def set_epoch(self, epoch: int) -> None:
        """The next iteration's epoch (each epoch its own order)."""
        self.epoch = int(epoch)

    def loader(self, stride: int, offset: int) -> Any:
        """The :class:`~layerwise.store.token_loader.TokenLoader` of one of ``stride`` readers."""
        loader = self.make_loader(self.layer, self.batch_size, epoch=self.epoch, **self.options)
        loader.stride, loader.offset = stride, offset
        return loader

    def __len__(self) -> int:
        """Batches in an epoch, all workers together."""
        return int(self.loader(1, 0).num_batches)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        stride, offset = (info.num_workers, info.id) if info is not None else (1, 0)
        yield from self.loader(stride, offset)


__all__ = ["TokenDataset"]
