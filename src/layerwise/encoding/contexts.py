"""Token contexts the way sparse-autoencoder trainers cut them: what to compute (:class:`ContextSpec`) and the
corpus's token stream packed into contexts of a fixed length (:class:`ContextPacker`). Imports no torch.

The stream is every record's tokens (no special tokens), one after another, with the model's separator between two
records (its end-of-sequence token, else its ``[SEP]``, else its beginning-of-sequence token, else nothing). Each
context is ``context_size`` tokens: the model's beginning-of-sequence token (its ``[CLS]`` for an encoder) followed by
the next ``context_size - 1`` tokens of the stream, where the model has one (``bos=True``); else the next
``context_size`` tokens. A context may start or end inside a record, as SAELens's and sparsify's do. A stream that ends
inside a context leaves that context out (every context has the same length; the count is said).

The packing is a pure function of the records and the tokenizer: the ``n``-th context is the same on every run, so a
resumed run skips the stream tokens already stored (:attr:`ContextPacker.consumed`) and goes on with the same
contexts.

Example::

    >>> packer = ContextPacker(context_size=4, bos_id=0, separator_id=2)
    >>> [c.tolist() for c, line in packer.feed([5, 6, 7, 8], line=1)]
    [[0, 5, 6, 7]]
    >>> [(c.tolist(), line) for c, line in packer.feed([9, 10], line=2)]
    [([0, 8, 2, 9], 1)]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Sequence, get_args

import numpy as np

from ..errors import SpecError
from .vocab import SITES

ActivationDtype = Literal["float32", "float16", "bfloat16", "float8"]
ACTIVATION_DTYPES: tuple[str, ...] = get_args(ActivationDtype)
# bytes one value takes on disk (float8: e4m3, with one float32 scale per token and layer beside it)
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}
MIN_CONTEXT = 2


def check_dtype(dtype: object) -> str:
    """``dtype`` if it is one of :data:`ACTIVATION_DTYPES`, else a :class:`SpecError` listing them."""
    if dtype not in ACTIVATION_DTYPES:
        raise SpecError(f"activation dtype {dtype!r} is not one of {', '.join(ACTIVATION_DTYPES)} (float8 is e4m3 "
                        f"with a float32 scale per token; bfloat16 keeps float32's range with 8 bits of mantissa)")
    return str(dtype)


@dataclass(frozen=True)
class ContextSpec:
    """What a token-activation store holds: ``layers`` (resolved, ``0..L``) at ``site``, for contexts of
    ``context_size`` tokens, stored as ``dtype``.

    Args:
        layers: model layers in the Hugging Face ``hidden_states`` numbering (0 = embeddings), resolved.
        site: ``block`` (the residual stream, ``hidden_states``), ``attention``, ``intermediate``, ``pre_ln`` or
            ``raw`` (see :data:`~layerwise.encoding.vocab.SITES`).
        context_size: tokens per context (at least 2, at most the model's window).
        dtype: ``float32 | float16 | bfloat16 | float8``.
        bos: put the model's beginning-of-sequence token first in every context (where it has one).
        skip_special: the readers' default: leave the special tokens' rows (beginning of sequence, separators) out.

    Raises:
        SpecError: a bad value, named, with the valid ones.
    """

    layers: tuple[int, ...]
    site: str = "block"
    context_size: int = 128
    dtype: str = "float32"
    bos: bool = True
    skip_special: bool = True

    def __post_init__(self) -> None:
        if not self.layers or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in self.layers):
            raise SpecError(f"layers {self.layers!r} must be resolved layer indices (ints >= 0), e.g. (4, 8, 12)")
        if len(set(self.layers)) != len(self.layers):
            raise SpecError(f"layers {self.layers!r} name a layer twice; give each once")
        if self.site not in SITES:
            raise SpecError(f"site {self.site!r} is not one of {', '.join(SITES)}")
        if not isinstance(self.context_size, int) or isinstance(self.context_size, bool) or \
                self.context_size < MIN_CONTEXT:
            raise SpecError(f"context_size {self.context_size!r} must be an int >= {MIN_CONTEXT} (SAE trainers use "
                            f"128 to 1024), e.g. --context-size 128")
        check_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the store's manifest ``spec``)."""
        out = asdict(self)
        out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ContextSpec":
        """The spec of :meth:`to_dict`."""
        known = {"layers", "site", "context_size", "dtype", "bos", "skip_special"}
        unknown = set(data) - known
        if unknown:
            raise SpecError(f"unknown context spec fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{**data, "layers": tuple(int(k) for k in data["layers"])})

    def row_bytes(self, width: int) -> int:
        """Bytes one token takes on disk for all layers: values, plus float8's float32 scale per layer."""
        scale = 4 if self.dtype == "float8" else 0
        return len(self.layers) * (width * DTYPE_BYTES[self.dtype] + scale)


def special_ids(tokenizer: Any) -> tuple[int | None, int | None, tuple[int, ...]]:
    """``(bos, separator, every special id)`` of a tokenizer (the rules in the module docstring)."""
    def first(*names: str) -> int | None:
        for name in names:
            value = getattr(tokenizer, name, None)
            if isinstance(value, int):
                return value
        return None

    bos = first("bos_token_id", "cls_token_id")
    separator = first("eos_token_id", "sep_token_id", "bos_token_id")
    every = sorted({int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None})
    return bos, separator, tuple(every)


class ContextPacker:
    """Records' tokens in, fixed-length contexts out (see the module docstring).

    Args:
        context_size: tokens per context.
        bos_id: the first token of every context (``None``: contexts are stream tokens only).
        separator_id: put between two records (``None``: nothing).
        skip: stream tokens to pass over before the first context (a resume: :attr:`consumed` of the stored ones).

    Attributes:
        consumed: stream tokens taken into finished contexts so far (skipped ones included).
        contexts: contexts given out so far.
    """

    def __init__(self, context_size: int, bos_id: int | None, separator_id: int | None, *, skip: int = 0):
        self.size = int(context_size)
        self.bos_id = bos_id
        self.separator_id = separator_id
        self.take = self.size - (1 if bos_id is not None else 0)
        self.consumed = 0
        self.contexts = 0
        self._skip = int(skip)
        self._buffer: list[int] = []
        self._line = 0  # the line of the buffer's first token
        self._started = False

    def feed(self, ids: Sequence[int], line: int) -> list[tuple[np.ndarray, int]]:
        """Add one record's tokens (``line``: where it came from); returns the contexts it completes, each
        ``(ids [context_size] int32, the line of its first stream token)``."""
        if not len(ids):  # a record without tokens adds nothing, not even a separator
            return []
        stream = list(ids)
        if self._started and self.separator_id is not None:
            stream.insert(0, self.separator_id)
        self._started = True
        if self._skip:
            cut = min(self._skip, len(stream))
            self._skip -= cut
            self.consumed += cut
            stream = stream[cut:]
        if not stream:
            return []
        if not self._buffer:
            self._line = line
        self._buffer.extend(stream)
        out: list[tuple[np.ndarray, int]] = []
        while len(self._buffer) >= self.take:
            body, self._buffer = self._buffer[:self.take], self._buffer[self.take:]
            head = [self.bos_id] if self.bos_id is not None else []
            out.append((np.asarray(head + body, dtype=np.int32), self._line))
            self.consumed += self.take
            self.contexts += 1
            self._line = line
        return out

    @property
    def left_over(self) -> int:
        """Stream tokens at the end that fill no whole context (left out of the store)."""
        return len(self._buffer)


__all__ = ["ACTIVATION_DTYPES", "ActivationDtype", "ContextPacker", "ContextSpec", "DTYPE_BYTES", "check_dtype",
           "special_ids"]
