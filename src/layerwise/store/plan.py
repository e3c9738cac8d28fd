"""A run's options, validated and written down: what the manifest records and what a resume must match."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ..extractor import Extractor

Level = Literal["sentence", "token", "word"]

LEVELS = ("sentence", "token", "word")
STORE_DTYPES = {"float32": np.float32, "float16": np.float16}
FORMAT_VERSION = 1


class ExtractError(ValueError):
    """A run that cannot start or must stop (bad options, a store mismatch, a bad record under ``strict``)."""


@dataclass
class ExtractSummary:
    """What one run did. ``records``/``tokens``/``skipped`` count this run; ``total_records`` the whole store."""

    store: str
    records: int = 0
    tokens: int = 0
    skipped: int = 0
    seconds: float = 0.0
    write_seconds: float = 0.0
    bytes_written: int = 0
    shards_written: int = 0
    total_records: int = 0
    resumed_from: int = 0
    status: str = "complete"  # complete | partial (stopped at max_records) | already_complete

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the command prints."""
        if self.status == "already_complete":
            return f"{self.store}: already complete ({self.total_records} records); nothing to do"
        resumed = f", resumed after {self.resumed_from}" if self.resumed_from else ""
        return (
            f"{self.records:,} records, {self.tokens:,} tokens in {self.seconds:.1f}s ({self.tokens_per_second:,.0f} "
            f"tokens/s), {self.bytes_written / 1e6:,.1f} MB in {self.shards_written} shard"
            f"{'' if self.shards_written == 1 else 's'}, {self.skipped:,} skipped{resumed} -> {self.store} "
            f"({self.total_records:,} records)"
        )


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_sha256(model_dir: str) -> str | None:
    """One hash over the model's weight files (safetensors, else pickle checkpoints); ``None`` for hub ids."""
    root = Path(model_dir)
    if not root.is_dir():
        return None
    files = sorted(root.glob("*.safetensors")) or sorted(root.glob("pytorch_model*.bin"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest() if files else None


def _model_dir(ex: Extractor) -> str:
    path = getattr(ex.model, "name_or_path", "") or ex.loaded.name
    return str(getattr(ex.model.config, "_name_or_path", "") or path)


def _count_records(path: str, fmt: str) -> int | None:
    """A quick estimate of the number of records (for the progress bar's ETA); ``None`` when unknown."""
    if path == "-":
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    n = blocks = 0
    prev_blank = True
    with open(path, "rb") as fh:
        for line in fh:
            blank = not line.strip()
            n += not blank
            blocks += (not blank) and prev_blank
            prev_blank = blank
    if fmt in ("conll", "conllu"):
        return blocks
    return n - 1 if fmt in ("csv", "tsv") else n


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key} (store: {json.dumps(a)}, now: {json.dumps(b)})")
    return out


@dataclass
class _Plan:
    """Validated options of a run: what is compared on resume lives in ``options`` and ``input``."""

    options: dict
    input: dict
    feature_shape: list[int]
    layers: tuple[int, ...]
    kwargs: dict = field(default_factory=dict)


def _plan(
    ex: Extractor, input_path: str, fmt: str, *, layers, site, combine, weights, pool, level, subword,
    skip_special_tokens, truncate, dtype, text_field, keep, context=None,
) -> _Plan:
    if level not in LEVELS:
        raise ExtractError(f"unknown level {level!r}. Valid levels are: {', '.join(LEVELS)}")
    if dtype not in STORE_DTYPES:
        raise ExtractError(f"unknown store dtype {dtype!r}. Valid dtypes are: {', '.join(STORE_DTYPES)}")
    if not isinstance(combine, str):
        raise ExtractError("the store needs a named combine mode (concat, sum, mean, weighted, stack), not a module")
    resolved, site = ex._prepare(layers, site, combine, weights)
    if level == "sentence":
        if pool is None or not isinstance(pool, str):
            raise ExtractError("level 'sentence' needs a named pool (cls, pooler, mean, max, mean_max, last)")
        ex._check_pool_fits(pool, combine, resolved, site, skip_special_tokens)
    elif level == "word":
        ex._check_subword(subword, combine)
    width = ex.loaded.site_width(site)
    k = len(resolved)
    shape = [k * width] if combine == "concat" else ([k, width] if combine == "stack" else [width])
    if level == "sentence" and pool == "mean_max":
        shape[-1] *= 2
    if level == "word" and subword == "first_last":
        shape[-1] *= 2
    tok = ex.tokenizer
    options = {
        "model": ex.loaded.name,
        "model_sha256": weights_sha256(_model_dir(ex)),
        "family": ex.loaded.family.name,
        "num_layers": ex.num_layers,
        "layers": list(resolved),
        "site": site,
        "combine": combine,
        "weights": None if weights is None else [float(w) for w in weights],
        "level": level,
        "pool": pool if level == "sentence" else None,
        "skip_special_tokens": bool(skip_special_tokens) if level == "sentence" else None,
        "subword": subword if level == "word" else None,
        "dtype": dtype,
        "truncate": bool(truncate),
        "context": context,
        "tokenizer": {
            "class": type(tok).__name__,
            "vocab_size": len(tok),
            "max_length": ex.max_length,
            "stride": ex.stride,
            "do_lower_case": getattr(tok, "do_lower_case", None),
        },
    }
    source = {
        "path": os.path.abspath(input_path) if input_path != "-" else "-",
        "format": fmt,
        "sha256": file_sha256(input_path) if input_path != "-" else None,
        "text_field": text_field,
        "keep": list(keep),
    }
    return _Plan(options, source, shape, resolved)
