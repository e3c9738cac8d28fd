"""The corpus the explorer shows: a sample of per-layer sentence vectors with their texts and labels.

A :class:`Corpus` comes from a sentence-level store (:func:`corpus_from_store`) or from texts encoded on the fly
(:func:`corpus_from_texts`). Either way it holds at most ``sample`` records (a seeded random sample, stated in
:attr:`Corpus.note`), so a store of any size opens in the same time and nothing larger reaches the browser.

Which stores hold layers: ``combine="stack"`` (rows ``[K, width]``) and ``combine="concat"`` (rows ``[K * width]``,
split back into ``K`` layers) give one view per layer; any other combine (``mean``, ``sum``, ``weighted``) is one
view of that mix.

    >>> c = corpus_from_store("sst2-dev-layers", labels="label")   # doctest: +SKIP
    >>> c.vectors.shape, c.layer_names[:2]                           # doctest: +SKIP
    ((872, 7, 384), ['embeddings', 'layer 1'])
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import LayerwiseError

if TYPE_CHECKING:
    from ..extractor import Extractor

DEFAULT_SAMPLE = 2000


@dataclass
class Corpus:
    """A sample of records with one sentence vector per layer.

    Attributes:
        vectors: ``[n, K, width]`` float32, the sampled records' vectors, one per layer view.
        layer_names: ``K`` names (``"embeddings"``, ``"layer 3"``, or the mix, e.g. ``"mean of layers 3-6"``).
        layers: ``K`` layer indices (``-1`` for a mix of layers).
        texts: ``n`` texts (``"record i"`` where the store's input is gone).
        labels: ``n`` labels as strings, or ``None`` without a label column.
        rows: ``n`` record numbers in the source (0-based), sorted.
        total: records in the source.
        source: what the records came from (a store path or a file).
        model: the model's name.
    """

    vectors: np.ndarray
    layer_names: list[str]
    layers: list[int]
    texts: list[str]
    labels: list[str] | None
    rows: np.ndarray
    total: int
    source: str
    model: str

    @property
    def note(self) -> str:
        """What the sample is, said for the page: e.g. ``"2,000 of 67,349 records (random sample, seed 0)"``."""
        n = len(self.texts)
        if n == self.total:
            return f"all {n:,} records"
        return f"{n:,} of {self.total:,} records (random sample, seed 0)"

    def info(self) -> dict:
        """JSON for the page: layers, texts, labels and the sample note (no vectors)."""
        return {"source": self.source, "model": self.model, "layers": self.layers, "layer_names": self.layer_names,
                "texts": self.texts, "labels": self.labels, "note": self.note, "total": self.total,
                "n": len(self.texts), "width": int(self.vectors.shape[2])}


def sample_rows(total: int, sample: int, seed: int = 0) -> np.ndarray:
    """``min(total, sample)`` sorted record numbers drawn without replacement (all of them when they fit)."""
    if sample < 1:
        raise LayerwiseError(f"sample must be a positive number of records, got {sample}")
    if total <= sample:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, size=sample, replace=False))


def layer_views(spec_layers: Sequence[int], combine: str, feature_shape: Sequence[int]) -> tuple[list[int], list[str]]:
    """The views a store's rows split into: ``(layer indices, names)`` (see the module docstring)."""
    layers = list(spec_layers)
    if combine in ("stack", "concat") and (combine == "stack" or feature_shape[-1] % len(layers) == 0):
        return layers, [layer_name(i) for i in layers]
    contiguous = layers == list(range(layers[0], layers[-1] + 1))
    span = f"{layers[0]}-{layers[-1]}" if contiguous else ", ".join(map(str, layers))
    return [-1], [f"{combine} of layers {span}" if len(layers) > 1 else layer_name(layers[0])]


def layer_name(i: int) -> str:
    """``"embeddings"`` for 0, else ``"layer i"``."""
    return "embeddings" if i == 0 else f"layer {i}"


def corpus_from_store(path: str | os.PathLike, labels: str | None = None, sample: int = DEFAULT_SAMPLE,
                      seed: int = 0) -> Corpus:
    """A :class:`Corpus` from a sentence-level store made by ``layerwise extract``.

    Args:
        path: the store directory.
        labels: a column kept with ``--keep`` (e.g. ``label``) to colour by; ``None``: uncoloured.
        sample: at most this many records (seeded random sample).

    Raises:
        ValueError: not a sentence-level store, or ``labels`` was not kept (the message says how to fix it).
    """
    from ..store import open_store

    store = open_store(path)
    if store.level != "sentence":
        raise LayerwiseError(f"the explorer's corpus view needs sentence vectors; {os.fspath(path)!r} is a "
                         f"{store.level}-level store. Extract with --level sentence (and --combine stack "
                         f"--layers all to see every layer)")
    if labels is not None and labels not in store.columns:
        raise LayerwiseError(f"column {labels!r} was not kept in {os.fspath(path)!r} "
                             f"(kept: {store.columns or 'none'}); extract with --keep {labels}")
    rows = sample_rows(len(store), sample, seed)
    picked = _read_rows(store, rows)  # Shape: (n, *feature_shape)
    layers, names = layer_views(store.spec.layer_indices, str(store.spec.combine), store.feature_shape)
    vectors = picked.reshape(len(rows), len(layers), -1).astype(np.float32)
    label_values = None
    if labels is not None:
        column = store.column(labels)
        label_values = [str(column[i]) for i in rows]
    return Corpus(vectors=vectors, layer_names=names, layers=layers, texts=_store_texts(store, rows),
                  labels=label_values, rows=rows, total=len(store), source=os.fspath(path),
                  model=str(store.model.get("name")))


def _read_rows(store, rows: np.ndarray) -> np.ndarray:
    """The features of ``rows`` (sorted), read chunk by chunk: never the whole store at once."""
    out, start, want = [], 0, iter(rows.tolist())
    nxt = next(want, None)
    for chunk in store.iter_chunks():
        end = start + len(chunk)
        while nxt is not None and nxt < end:
            out.append(np.asarray(chunk[nxt - start]))
            nxt = next(want, None)
        start = end
        if nxt is None:
            break
    return np.stack(out) if out else np.zeros((0, *store.feature_shape), np.float32)


def _store_texts(store, rows: np.ndarray) -> list[str]:
    """The sampled records' texts: a kept text column, else re-read from the store's input file when it is still
    there and unchanged, else ``"record i"``."""
    from ..corpus.readers import ReadOptions
    from ..corpus.records import Record
    from ..corpus.sources import open_source

    inp = store.manifest.get("input", {})
    for name in (inp.get("text_field"), "text", "sentence"):
        if name and name in store.columns:
            column = store.column(name)
            return [str(column[i]) for i in rows]
    path = inp.get("path")
    lines = store.lines
    if path and path != "-" and Path(path).is_file():
        wanted = {int(lines[i]): k for k, i in enumerate(rows)}
        texts = [f"record {i}" for i in rows]
        reading = ReadOptions(format=inp.get("format"), text_field=inp.get("text_field"))
        for item in open_source(path, reading).records(reading):
            if isinstance(item, Record) and item.line in wanted:
                texts[wanted[item.line]] = item.text
        return texts
    return [f"record {i}" for i in rows]


def corpus_from_texts(ex: Extractor, texts: Sequence[str], labels: Sequence[object] | None = None,
                      sample: int = DEFAULT_SAMPLE, seed: int = 0, source: str = "texts") -> Corpus:
    """A :class:`Corpus` of ``texts`` encoded now: every layer of ``ex``, mean-pooled, block site.

    Args:
        ex: the extractor.
        texts: the texts (a seeded sample of ``sample`` of them is encoded).
        labels: one label per text, or ``None``.
    """
    if labels is not None and len(labels) != len(texts):
        raise LayerwiseError(f"got {len(labels)} labels for {len(texts)} texts; give one label per text")
    rows = sample_rows(len(texts), sample, seed)
    picked = [texts[i] for i in rows]
    feats = ex.encode(picked, layers="all", combine="stack", pool="mean")  # Shape: (n, L + 1, hidden)
    layers = list(range(ex.num_layers + 1))
    return Corpus(vectors=np.asarray(feats, dtype=np.float32), layer_names=[layer_name(i) for i in layers],
                  layers=layers, texts=picked, labels=None if labels is None else [str(labels[i]) for i in rows],
                  rows=rows, total=len(texts), source=source, model=ex.loaded.name)




def corpus_from_file(ex: Extractor, path: str | os.PathLike, labels: str | None = None, text_field: str | None = None,
                     sample: int = DEFAULT_SAMPLE, seed: int = 0) -> Corpus:
    """A :class:`Corpus` of a text file in any input format ``layerwise extract`` reads (txt, TSV/CSV, JSONL,
    parquet, CoNLL), encoded now (see :func:`corpus_from_texts`); ``labels`` names the label column.

    Raises:
        ValueError: an unreadable file or a missing column (the reader's message), or no records.
    """
    from ..corpus.readers import ReadOptions
    from ..corpus.records import Record
    from ..corpus.sources import open_source

    reading = ReadOptions(text_field=text_field, keep=(labels,) if labels else ())
    texts: list[str] = []
    values: list[object] = []
    for item in open_source(path, reading).records(reading):
        if isinstance(item, Record):
            texts.append(item.text)
            if labels:
                values.append(item.fields.get(labels))
    if not texts:
        raise LayerwiseError(f"{os.fspath(path)!r} holds no records to encode")
    return corpus_from_texts(ex, texts, values if labels else None, sample, seed, source=os.fspath(path))


__all__ = ["DEFAULT_SAMPLE", "Corpus", "corpus_from_file", "corpus_from_store", "corpus_from_texts", "layer_name",
           "layer_views", "sample_rows"]
