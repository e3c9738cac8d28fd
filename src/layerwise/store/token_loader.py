"""Token rows read back for training at disk speed: a global token-level shuffle across shards without an index in
memory, deterministic for a seed, resumable from any batch, by memory map. torch is imported when batches are made.

**The shuffle.** Batch ``b`` of an epoch holds the rows at positions ``b * batch_size ... (b + 1) * batch_size - 1``
of a pseudo-random permutation of all rows (every shard's, as one sequence): a keyed Feistel network over the next
power of four, with cycle walking down to the row count (:class:`Permutation`). Any position's row is computed
in O(1), so the order costs no memory whatever the store's size, a restart at batch ``b`` needs nothing but ``b``,
and every row appears exactly once per epoch. Each epoch has its own key (``seed``, ``epoch``). Within a batch the
rows are read in store order (one pass over each shard's memory map, which the page cache serves fastest); which
rows form a batch is the shuffle.

**Special tokens.** With ``skip_ids`` the rows whose token id is one of them (the beginning-of-sequence token and the
separators of a packed context) are dropped from the batch that holds them, so such a batch has fewer rows; an epoch
still gives every other row exactly once, and batch ``b`` is the same batch on every run.

**Dtypes.** ``float32`` decodes every stored dtype (bfloat16 bits widened, float8 e4m3 times its per-token scale);
``stored`` gives ``float32``, ``float16`` and ``torch.bfloat16`` as they are on disk (float8 needs its scale: refused).

Example::

    >>> loader = TokenLoader(sources, "bfloat16", 4096, seed=0)          # doctest: +SKIP
    >>> for batch in loader: ...                                        # torch [<=4096, W] float32
    >>> loader.state_dict()                                             # doctest: +SKIP
    {'batch': 12, 'epoch': 0, 'seed': 0, 'batch_size': 4096}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import StoreError

ROUNDS = 6
OUT_DTYPES = ("float32", "stored")
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


class Permutation:
    """A keyed pseudo-random permutation of ``0 .. n-1`` computed position by position (see the module docstring).

    Args:
        n: how many items. seed, epoch: the key.
    """

    def __init__(self, n: int, seed: int, epoch: int = 0):
        self.n = int(n)
        bits = max(2, (max(self.n, 2) - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF, 0x5AE])
        self.keys = rng.integers(0, 2**63, size=ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The items at ``positions`` (int64, each in ``0 .. n-1``) of the permuted order."""
        out = self._encrypt(np.asarray(positions, dtype=np.uint64))
        n = np.uint64(self.n)
        outside = out >= n
        while outside.any():  # cycle walking: a value past n is encrypted again until it lands inside
            out[outside] = self._encrypt(out[outside])
            outside = out >= n
        return out.astype(np.int64)


@dataclass
class RowSource:
    """One shard's rows of one layer: ``values [rows, W]`` (stored bits), float8's ``scale [rows]`` or ``None``, and the
    rows' token ids ``[rows]``."""

    values: np.ndarray
    scale: np.ndarray | None
    token_ids: np.ndarray


def decode(values: np.ndarray, scale: np.ndarray | None, dtype: str) -> np.ndarray:
    """Stored rows as float32 ``[rows, W]`` (numpy; see the module docstring)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "float8":
        import torch

        bits = torch.from_numpy(np.array(values))  # a writable copy (the store's maps are read-only)
        out = bits.view(torch.float8_e4m3fn).float() * torch.from_numpy(np.array(scale, np.float32))[:, None]
        return out.numpy()
    return np.asarray(values, dtype=np.float32)


class TokenLoader:
    """Batches of token rows (see the module docstring); iterate it for one epoch from :attr:`batch`.

    Args:
        sources: every shard's rows, in store order.
        dtype: the stored dtype (``float32 | float16 | bfloat16 | float8``).
        batch_size: rows per batch (fewer where ``skip_ids`` rows are dropped, and in the last batch).
        shuffle: the global shuffle (else store order).
        seed, epoch: the shuffle's key.
        start: the first batch to give.
        out_dtype: ``float32`` or ``stored``.
        skip_ids: token ids whose rows are left out.
        drop_last: no short last batch.
        stride, offset: give batches ``offset, offset + stride, ...`` only (one of ``stride`` readers: a DataLoader
            worker).

    Raises:
        StoreError: a bad argument, naming it and the valid values.
    """

    def __init__(self, sources: Sequence[RowSource], dtype: str, batch_size: int = 4096, *, shuffle: bool = True,
                 seed: int = 0, epoch: int = 0, start: int = 0, out_dtype: str = "float32",
                 skip_ids: Sequence[int] = (), drop_last: bool = False, stride: int = 1, offset: int = 0):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise StoreError(f"batch_size {batch_size!r} must be an int >= 1 (SAE trainers use 1,024 to 8,192 tokens)")
        if out_dtype not in OUT_DTYPES:
            raise StoreError(f"dtype {out_dtype!r} is not one of {', '.join(OUT_DTYPES)}")
        if out_dtype == "stored" and dtype == "float8":
            raise StoreError("float8 rows carry a scale per token: read them with dtype='float32' (decoded)")
        if not isinstance(start, int) or start < 0:
            raise StoreError(f"start {start!r} must be a batch index >= 0 (state_dict()['batch'] of a loader)")
        self.sources = list(sources)
        self.dtype = dtype
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed, self.epoch = int(seed), int(epoch)
        self.out_dtype = out_dtype
        self.skip_ids = np.asarray(sorted(set(int(i) for i in skip_ids)), dtype=np.int32)
        self.drop_last = drop_last
        self.stride, self.offset = int(stride), int(offset)
        self.starts = np.cumsum([0] + [len(s.values) for s in self.sources]).astype(np.int64)
        self.rows = int(self.starts[-1])
        self.width = int(self.sources[0].values.shape[1]) if self.sources else 0
        self.batch = int(start)
        self._perm = Permutation(self.rows, self.seed, self.epoch) if shuffle else None

    def __len__(self) -> int:
        """Batches in an epoch (for this reader's ``stride`` / ``offset``)."""
        full, rest = divmod(self.rows, self.batch_size)
        total = full + (1 if rest and not self.drop_last else 0)
        return len(range(self.offset, total, self.stride))

    @property
    def num_batches(self) -> int:
        """Batches in an epoch, all readers together."""
        full, rest = divmod(self.rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: the next batch, the epoch, the seed, the batch size (give ``batch`` as ``start``)."""
        return {"batch": self.batch, "epoch": self.epoch, "seed": self.seed, "batch_size": self.batch_size}

    def rows_of(self, b: int) -> np.ndarray:
        """The rows (global, sorted) of batch ``b`` before special tokens are dropped."""
        lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self.rows)
        positions = np.arange(lo, hi, dtype=np.int64)
        return np.sort(self._perm(positions)) if self._perm is not None else positions

    def read(self, rows: np.ndarray) -> Any:
        """Rows ``rows`` (global, sorted) of the layer as one torch tensor ``[len, W]``, special tokens dropped."""
        import torch

        shard_of = np.searchsorted(self.starts, rows, side="right") - 1
        cuts = np.searchsorted(shard_of, np.arange(len(self.sources) + 1))
        parts, scales = [], []
        for s in np.unique(shard_of):
            src = self.sources[int(s)]
            local = rows[cuts[s]:cuts[s + 1]] - self.starts[s]
            if len(self.skip_ids):
                local = local[~np.isin(src.token_ids[local], self.skip_ids)]
            parts.append(np.take(src.values, local, axis=0))
            if src.scale is not None:
                scales.append(np.take(src.scale, local))
        values = np.concatenate(parts) if len(parts) != 1 else parts[0]
        if values.size == 0:
            values = values.reshape(0, self.width)
        if self.dtype == "bfloat16":
            t = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
            return t.float() if self.out_dtype == "float32" else t
        if self.dtype == "float8":
            scale = torch.from_numpy(np.concatenate(scales) if len(scales) != 1 else scales[0])
            return torch.from_numpy(values).view(torch.float8_e4m3fn).float() * scale[:, None]
        t = torch.from_numpy(values)
        return t.float() if self.out_dtype == "float32" else t

    def __iter__(self) -> Iterator[Any]:
        total = self.num_batches
        b = self.batch
        while b < total:
            if (b - self.offset) % self.stride:
                b += 1
                continue
            out = self.read(self.rows_of(b))
            self.batch = b + 1
            b += 1
            yield out


__all__ = ["OUT_DTYPES", "Permutation", "RowSource", "TokenLoader", "decode"]
