"""Probe data: every layer of every split extracted once into feature stores, then loaded as probe inputs.

Tagging (``task="tagging"``): CoNLL-2003 (``column`` = ``ner`` | ``chunk`` | ``pos``) or CoNLL-U (``upos`` | ``xpos``)
sentences become one feature row per word of the file (``level="word"``, sub-tokens pooled with ``subword``,
default ``first`` as in the BERT paper), with every layer kept (``layers="all"``, ``combine="stack"``).
Sentence tasks (``task="sentence"``): TSV/CSV/JSONL text+label, one row per record, each layer pooled (``pool``).

Stores live in ``OUTPUT/features/<split>`` and are float16 on disk by default (probing does not need more; the fits
compute in float32; ``ProbeConfig.feature_dtype="float32"``, the CLI's ``--feature-dtype float32``, keeps full
precision, for other tools that read the cache); a rerun finds
them complete and skips extraction (with ``overwrite``, only a store made with other options is extracted again).
CoNLL-2003 ``document_context=True`` encodes each sentence together with its
neighbours from the same ``-DOCSTART-`` document and keeps the features of the sentence's own words only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..corpus.readers import ReadOptions, detect_format
from ..encoding.spec import EncodeSpec
from ..errors import ExtractError, InputError, StoreError, StoreFullError
from ..extraction.engine import ExtractOptions, extract
from ..extractor import Extractor
from ..heads.data import label_text
from ..store import FeatureStore, open_store
from ..store.rows import StoredRows

Task = Literal["sentence", "tagging"]
TASKS = ("sentence", "tagging")
TAG_COLUMNS = {"conll": ("ner", "chunk", "pos"), "conllu": ("upos", "xpos")}


@dataclass
class ProbeSplit:
    """Features of one split: ``x [rows, L + 1, W]`` (float16: a tensor in memory, or rows read from the store on
    demand, :class:`~layerwise.store.rows.StoredRows`; either indexed by rows gives a tensor), string labels, and
    sentence offsets.

    For tagging, rows are words and ``offsets [sentences + 1]`` delimits sentences; for sentence tasks rows are
    records and ``offsets`` is ``None``.
    """

    x: torch.Tensor | StoredRows
    labels: list[str]
    offsets: np.ndarray | None
    store: FeatureStore

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sentence_offsets(self) -> np.ndarray:
        """Tagging: ``offsets``; ``TypeError`` for a sentence task, whose split has none."""
        if self.offsets is None:
            raise TypeError("a sentence-task split has no sentence offsets (offsets is None); only tagging splits do")
        return self.offsets

    def take(self, items: np.ndarray) -> "ProbeSplit":
        """The split restricted to ``items`` (sentence indices for tagging, row indices otherwise), in that order."""
        items = np.asarray(items, dtype=np.int64)
        if self.offsets is None:
            return ProbeSplit(self.x[torch.from_numpy(items)], [self.labels[i] for i in items], None, self.store)
        off = self.offsets
        rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in items]) if len(items) else \
            np.zeros(0, dtype=np.int64)
        lengths = np.diff(off)[items]
        return ProbeSplit(self.x[torch.from_numpy(rows)], [self.labels[r] for r in rows],
                          np.concatenate([[0], np.cumsum(lengths)]), self.store)

    @property
    def sentences(self) -> list[list[str]]:
        """Tagging: the gold tags sentence by sentence."""
        off = self.sentence_offsets
        return [self.labels[off[i] : off[i + 1]] for i in range(len(off) - 1)]


def check_task(task: str, path: str | os.PathLike, column: str | None, fmt: str | None) -> tuple[str, str]:
    """Validate the task against the file format; returns ``(format, column)``."""
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}. Valid tasks are: {', '.join(TASKS)}")
    fmt = detect_format(path, fmt)
    if task == "tagging":
        if fmt not in TAG_COLUMNS:
            raise InputError(
                f"task 'tagging' (the default) reads a tag per word from CoNLL-2003 (.conll) or CoNLL-U (.conllu) "
                f"files; {os.fspath(path)!r} is read as {fmt}, a label per record: if it holds CoNLL lines, give "
                f"--format conll (or conllu); otherwise probe it with task='sentence' (layerwise probe --task "
                f"sentence, --column naming the label column, default label)"
            )
        column = column or TAG_COLUMNS[fmt][0]
        if column not in TAG_COLUMNS[fmt]:
            raise InputError(
                f"column {column!r} is not a tag column of {fmt}. Valid columns are: {', '.join(TAG_COLUMNS[fmt])}"
            )
    else:
        if fmt in TAG_COLUMNS:
            raise InputError(
                f"task 'sentence' reads text+label files (tsv, csv, jsonl, parquet); {os.fspath(path)!r} is {fmt}, a "
                f"tag per word: probe it with task='tagging' (layerwise probe --task tagging)"
            )
        column = column or "label"
    return fmt, column


def split_features(
    ex: Extractor,
    path: str | os.PathLike,
    store_dir: Path,
    *,
    task: str,
    fmt: str,
    column: str,
    subword: str = "first",
    pool: str = "mean",
    text_field: str | None = None,
    document_context: bool = False,
    progress: bool | None = None,
    overwrite: bool = False,
) -> ProbeSplit:
    """Extract (or find cached) all-layer features of one split and load them: :func:`extract_split`, then
    :func:`load_split` (a run extracts every split before it loads any, so that the extraction's working memory never
    sits on top of loaded features).

    A store at ``store_dir`` made with the same options is reused (resumed if unfinished); one made with other
    options (or damaged) is extracted again with ``overwrite``, and refused without it.
    """
    extract_split(ex, path, store_dir, task=task, fmt=fmt, column=column, subword=subword, pool=pool,
                  text_field=text_field, document_context=document_context, progress=progress, overwrite=overwrite)
    return load_split(path, store_dir, task=task, column=column)


def extract_split(
    ex: Extractor,
    path: str | os.PathLike,
    store_dir: Path,
    *,
    task: str,
    fmt: str,
    column: str,
    subword: str = "first",
    pool: str = "mean",
    text_field: str | None = None,
    document_context: bool = False,
    progress: bool | None = None,
    overwrite: bool = False,
    feature_dtype: str = "float16",
) -> None:
    """Extract (or find cached) the all-layer features of one split into ``store_dir`` (see
    :func:`split_features`), in ``feature_dtype`` (``float16``, the default, or ``float32``)."""
    if task == "tagging":
        keep = (column, "doc") if fmt == "conll" else (column,)
        spec = EncodeSpec(layers="all", combine="stack", level="word", subword=subword, output_dtype=feature_dtype)
        reading = ReadOptions(format=fmt, keep=keep, context="document" if document_context else None)
    else:
        spec = EncodeSpec(layers="all", combine="stack", level="sentence", pool=pool, output_dtype=feature_dtype)
        reading = ReadOptions(format=fmt, text_field=text_field, keep=(column,))
    try:
        extract(path, store_dir, spec, model=ex, reading=reading, options=ExtractOptions(progress=progress))
    except (StoreError, ExtractError) as exc:
        # the store refused (other options, or damaged; raised as it is or as the cause): overwrite starts it again.
        # Not a full disk: the same command resumes once space is freed
        refused = exc if isinstance(exc, StoreError) else exc.__cause__
        if not (overwrite and isinstance(refused, StoreError) and not isinstance(refused, StoreFullError)):
            raise
        extract(path, store_dir, spec, model=ex, reading=reading,
                options=ExtractOptions(progress=progress, overwrite=True))


def load_split(path: str | os.PathLike, store_dir: Path, *, task: str, column: str,
               resident: bool = True) -> ProbeSplit:
    """The features of a split extracted by :func:`split_features` into ``store_dir`` (from ``path``, named in the
    error when it held no usable record), loaded: ``x [rows, L + 1, W]`` float16, labels, sentence offsets.

    ``resident=False``: ``x`` is read from the store on demand (:meth:`~layerwise.store.FeatureStore.rows`, a split
    only scored, a block of rows at a time), not held in memory; a store whose records are out of its shards' order
    is held anyway."""
    store = open_store(store_dir)
    if len(store) == 0:
        raise InputError(f"{os.fspath(path)!r} holds no usable record (empty file, or every record was bad)")
    values = store.column(column)
    x: torch.Tensor | StoredRows | None = None
    if not resident:
        try:
            x = store.rows()
        except StoreError:  # records out of the shards' order: held in memory
            x = None
    if task == "tagging":
        labels = [str(t) for tags in values for t in tags]
        if x is not None:
            return ProbeSplit(x, labels, np.asarray(store.record_offsets()), store)
        rows, offsets = store.ragged()
        return ProbeSplit(torch.from_numpy(np.ascontiguousarray(rows)), labels, np.asarray(offsets), store)
    if x is None:
        x = torch.from_numpy(np.ascontiguousarray(np.concatenate(list(store.iter_chunks(8192)))))
    labels = [label_text(v) or str(v).strip() for v in values]  # 0, 0.0 and "0" are one class, as for heads
    return ProbeSplit(x, labels, None, store)
