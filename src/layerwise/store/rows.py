"""The feature rows of a store read on demand: ``[rows, *F]`` (a sentence-level store's records, a token- or
word-level store's tokens or words of every record, in order), indexed like an array and never held whole.

A probe scores its dev and test splits a block of rows at a time, and samples a few thousand rows of dev for the layer
similarity. Held in memory, those splits sat beside the training features for the whole run (0.14 GB each on UD
English-EWT). :class:`StoredRows` reads the rows an index names from the shards' memory-mapped tensors, copies them
out and lets the mappings go (:meth:`~layerwise.store.layout.ShardFile.forget`), so what the process holds is the
copy the caller asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from .layout import ShardFile


class StoredRows:
    """Rows ``[N, *F]`` of a store, read on demand: ``rows[a:b]``, ``rows[indices]`` (an int array or tensor, any
    order, repeats allowed) and ``rows[a:b][:, layers]`` give torch tensors in the store's dtype.

    Made by :meth:`~layerwise.store.FeatureStore.rows`.

    Attributes:
        shape: ``(N, *F)``. dtype: the stored numpy dtype.
    """

    def __init__(self, shards: "list[ShardFile]", level: str, feature_shape: tuple[int, ...], dtype: np.dtype):
        self._shards = shards
        counts = [self._count(s, level) for s in shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.feature_shape = tuple(feature_shape)
        self.shape = (int(self._starts[-1]), *self.feature_shape)
        self.dtype = dtype

    @staticmethod
    def _count(shard: "ShardFile", level: str) -> int:
        if level == "sentence":
            return int(shard.array("features").shape[0])
        return int(shard.array("offsets")[-1])

    def __len__(self) -> int:
        return self.shape[0]

    def _read(self, s: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Rows ``lo:hi`` of shard ``s`` into ``out``; the shard's mapping let go after."""
        shard = self._shards[s]
        feats = shard.array("features").reshape((-1, *self.feature_shape))
        out[...] = feats[lo:hi]
        del feats
        shard.forget("features")

    def __getitem__(self, key: Any) -> "torch.Tensor":
        import torch

        if isinstance(key, tuple):  # rows[a:b, layers] as rows[a:b][:, layers]
            return self[key[0]][(slice(None), *key[1:])]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            out = np.empty((max(0, stop - start), *self.feature_shape), dtype=self.dtype)
            first = int(np.searchsorted(self._starts, start, side="right")) - 1
            at = start
            for s in range(max(first, 0), len(self._shards)):
                if at >= stop:
                    break
                lo, hi = at - int(self._starts[s]), min(stop, int(self._starts[s + 1])) - int(self._starts[s])
                if hi > lo:
                    self._read(s, lo, hi, out[at - start : at - start + hi - lo])
                    at += hi - lo
            return torch.from_numpy(out)
        index = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        if index.dtype == bool:
            index = np.flatnonzero(index)
        index = index.astype(np.int64).reshape(-1)
        index = np.where(index < 0, index + len(self), index)
        if len(index) and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"row index out of range: the store holds {len(self)} rows")
        out = np.empty((len(index), *self.feature_shape), dtype=self.dtype)
        shard_of = np.searchsorted(self._starts, index, side="right") - 1
        for k in np.unique(shard_of).tolist():  # one read per shard touched
            where = np.flatnonzero(shard_of == k)
            shard = self._shards[k]
            feats = shard.array("features").reshape((-1, *self.feature_shape))
            out[where] = feats[index[where] - self._starts[k]]
            del feats
            shard.forget("features")
        return torch.from_numpy(out)


__all__ = ["StoredRows"]
