"""``ExtractOptions``: how an extraction runs (what it computes is the :class:`~layerwise.EncodeSpec`, which model
computes it the :class:`~layerwise.ModelOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import positive_ints
from ..errors import ExtractError
from ..store.integrity import RESUME_CHECKS


@dataclass(frozen=True)
class ExtractOptions:
    """How an extraction runs (what it computes is the :class:`~layerwise.EncodeSpec`).

    Attributes:
        batch_tokens: token budget per forward batch (default: the Extractor's).
        max_records: stop once the store holds this many records (``status`` ``partial``).
        shard_records: records per shard (default: about 32 MB of features per shard).
        strict: stop at the first bad record (``ExtractError`` with its line and reason) instead of skipping it.
        overwrite: replace a store made with other options.
        progress: ``True`` a progress bar, ``False`` none; default: a bar when stderr is a terminal, else a plain
            line every 30 s once the work has run that long (:mod:`layerwise.progress`).
        resume_check: what a resume checks of every shard the store lists before it relies on it: ``sha256``
            (every byte; the default; about 1 s per GB, see ``benchmarks/resume_check.py``) or ``headers`` (sizes
            and headers, and the last shard's sha256). Damage found is recomputed from the first damaged shard.
        num_shards, shard_index: process only part ``shard_index`` of ``num_shards`` of the input: the records whose
            number in the input (counting bad ones, from 0) is ``shard_index`` modulo ``num_shards``. Stable across
            reruns, so each part resumes alone and any scheduler (Slurm arrays, Kubernetes jobs, Spark) can run the
            parts; ``layerwise merge`` (:func:`layerwise.store.merge_stores`) joins them in input order.
    """

    batch_tokens: int | None = None
    max_records: int | None = None
    shard_records: int | None = None
    strict: bool = False
    overwrite: bool = False
    progress: bool | None = None
    num_shards: int = 1
    shard_index: int = 0
    resume_check: str = "sha256"

    def __post_init__(self) -> None:
        given = {k: getattr(self, k) for k in ("max_records", "shard_records", "batch_tokens", "num_shards")}
        try:
            positive_ints(**{k: v for k, v in given.items() if v is not None})
        except ValueError as exc:
            raise ExtractError(str(exc)) from exc
        if self.resume_check not in RESUME_CHECKS:
            raise ExtractError(f"resume_check={self.resume_check!r} is not one of {', '.join(RESUME_CHECKS)} "
                               f"(sha256: every byte of every listed shard; headers: sizes and headers, and the last "
                               f"shard's sha256)")
        index = self.shard_index
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_shards:
            raise ExtractError(
                f"shard_index={index!r} must be an int in 0..{self.num_shards - 1} (one part of num_shards="
                f"{self.num_shards}); run one command per index"
            )


__all__ = ["ExtractOptions"]
