"""Labelled data for heads: reading text+label files, label maps, and frozen features cached in a feature store.

Frozen mode extracts features once and reuses them: sentence pools are cached for *every* layer
(``layers="all", combine="stack"``, one store per pool and site; a sub-layer site such as ``attention`` has no
embeddings output, so its cache holds layers 1..L), so any layer choice of a later run is a slice of the same
cache; ``pool="attention"`` caches token-level features of the selected layers. The cache is a normal feature
store under ``cache_dir`` (default ``~/.cache/layerwise/features``), content-addressed: its key is the input
file's sha256, the weights' fingerprint and the options, never a path, so a copy of the same file reuses it and a
changed file does not. It is resumable like any store.

Labels are class names (strings), normalised by :func:`label_text` when read (from a file or from the cache):
strings are stripped, and a JSON number that is integral becomes its int string, so ``0``, ``0.0`` and ``"0"`` are one
class ``"0"``; a missing, null or empty label leaves the record out (counted and reported as skipped).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..corpus.readers import BadRecord, ReadOptions, detect_format, read_records
from ..encoding.padding import pad_rows
from ..encoding.spec import EncodeSpec
from ..errors import InputError
from ..extraction.engine import ExtractOptions, extract
from ..extractor import Extractor
from ..provenance import content_key, file_sha256
from ..store import FeatureStore, open_store


@dataclass
class Labelled:
    """Texts and their string labels (bad records and records without a label skipped: ``skipped_lines``)."""

    texts: list[str]
    labels: list[str]
    lines: list[int]
    skipped: int = 0
    skipped_lines: list[int] | None = None


# files that hold a tag per word, not a label per record, and the tag columns the probe reads from each
WORD_TAG_FORMATS = {"conll": ("CoNLL-2003", ("ner", "chunk", "pos")), "conllu": ("CoNLL-U", ("upos", "xpos"))}


def check_record_file(path: str | os.PathLike, format: str | None = None, what: str = "the file") -> None:
    """Refuse a file of per-word tags (CoNLL-2003, CoNLL-U) before any work: a head classifies whole records.

    Raises:
        InputError: naming the file, what it holds, and the command that reads it (``layerwise probe --task tagging``).
    """
    fmt = detect_format(path, format)
    if fmt in WORD_TAG_FORMATS:
        name, columns = WORD_TAG_FORMATS[fmt]
        raise InputError(
            f"{what} {os.fspath(path)!r} is {name}, a tag per word; a classifier head takes one label per record "
            f"(a tsv, csv, jsonl or parquet file with text and label columns). To measure which layer knows the tags, "
            f"run layerwise probe --task tagging --column {columns[0]} (tag columns: {', '.join(columns)}), or "
            f"lw.probe.run(..., ProbeConfig(task='tagging')) in Python"
        )


def few(values: Sequence[object], keep: int = 10, width: int = 40) -> str:
    """``values`` for a message: at most ``keep`` of them, each ``repr`` cut to ``width`` characters, and how many
    there are in all when some were left out (a label list may be long, a label may be a whole sentence's tags)."""
    shown = []
    for value in list(values)[:keep]:
        text = repr(value)
        shown.append(text if len(text) <= width else text[: width - 3] + "...")
    more = f", ... ({len(values)} in all)" if len(values) > keep else ""
    return "[" + ", ".join(shown) + more + "]"


def _one_label(value: object, column: str, where: str) -> str | None:
    """:func:`label_text` of one record's label, refusing a list or a mapping (a tag per word is not a label)."""
    if isinstance(value, (list, tuple, dict, np.ndarray)):
        kind = "a mapping" if isinstance(value, dict) else f"a list of {len(value)} values"
        raise InputError(
            f"{where}: label column {column!r} holds {kind}, not one label; a classifier head takes one label per "
            f"record. For a tag per word use layerwise probe --task tagging (CoNLL-2003 or CoNLL-U files)"
        )
    return label_text(value)


def label_text(value: object) -> str | None:
    """A label as a class name; ``None`` for a missing (null) or empty label.

    Strings are stripped. A number that is integral becomes its int string, so the JSON labels ``0``, ``0.0`` and
    ``"0"`` are one class ``"0"`` (a CSV/TSV cell that is a JSON number is read as that number, as in JSONL: see
    :mod:`layerwise.corpus.readers`; so the cell ``0.0`` is the class ``"0"`` too); other
    numbers keep their ``str`` (``1.5`` -> ``"1.5"``); booleans are ``"True"`` / ``"False"``.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value).is_integer():
        return str(int(float(value)))
    text = str(value).strip()
    return text or None


def read_labelled(
    path: str | os.PathLike, *, text_field: str | None = None, label_field: str = "label", format: str | None = None,
    header: bool = True,
) -> Labelled:
    """Read a TSV/CSV/JSONL (or parquet) file with a text and a label column; labels become strings. ``header``:
    whether a csv/tsv file's first row names its columns (``False``: columns by 1-based position, ``"2"``).

    Raises:
        ValueError: missing file or column, or no usable record (an empty file).
    """
    texts: list[str] = []
    labels: list[str] = []
    lines: list[int] = []
    skipped: list[int] = []
    for item in read_records(path, format, text_field=text_field, keep=[label_field], header=header):
        label = None if isinstance(item, BadRecord) else _one_label(
            item.fields.get(label_field), label_field, f"line {item.line} of {os.fspath(path)!r}")
        if isinstance(item, BadRecord) or label is None:
            skipped.append(item.line)
            continue
        texts.append(item.text)
        labels.append(label)
        lines.append(item.line)
    if not texts:
        raise InputError(f"{os.fspath(path)!r} holds no usable record (empty file, or every record was bad)")
    return Labelled(texts, labels, lines, len(skipped), skipped)


def label_map(labels: Sequence[str]) -> list[str]:
    """The sorted distinct labels of a training set; ``ValueError`` if there is only one class."""
    names = sorted(
        set(labels), key=lambda s: (not s.lstrip("-").isdigit(), int(s) if s.lstrip("-").isdigit() else 0, s)
    )
    if len(names) < 2:
        raise InputError(f"the training data has a single class ({few(names)[1:-1]}); a classifier needs at least "
                         f"two")
    return names


def encode_labels(labels: Sequence[str], names: Sequence[str], where: str) -> torch.Tensor:
    """Label strings -> indices; ``ValueError`` listing labels the model does not know."""
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(labels) - set(index))
    if unknown:
        raise InputError(
            f"{where} has label(s) {few(unknown)} that the model was not trained on; known labels are: {few(names, 30)}"
        )
    return torch.tensor([index[label] for label in labels], dtype=torch.long)


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerwise" / "features"


def cached_store(
    ex: Extractor,
    path: str | os.PathLike,
    *,
    pool: str,
    layers: Sequence[int],
    site: str,
    text_field: str | None,
    label_field: str,
    cache_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
    format: str | None = None,
    header: bool = True,
) -> FeatureStore:
    """The feature store for ``path`` under the cache (extracted now if absent or unfinished); ``format`` and
    ``header`` say how the file is read (:class:`~layerwise.corpus.readers.ReadOptions`).

    Sentence pools: every layer the site has, ``[records, L + 1, W]`` (``site="block"``) or ``[records, L, W]``
    (sub-layer sites: layers 1..L); ``pool="attention"``: token level, the selected layers, ``[tokens, K, W]``.
    """
    token_level = pool == "attention"
    every = "all" if site == "block" else "1:"  # sub-layer sites exist in layers 1..L only
    spec = EncodeSpec(layers=list(layers) if token_level else every, site=site, combine="stack",
                      level="token" if token_level else "sentence", pool=None if token_level else pool)
    key = content_key({
        "input": file_sha256(path),
        "weights": ex.fingerprint(),
        "precision": ex.backend.precision,  # int8 / bfloat16 features are other features of the same weights
        "spec": spec.to_dict(),
        "max_length": ex.max_length,
        "text_field": text_field,
        "label_field": label_field,
        **({"format": format} if format is not None else {}),
        **({"header": False} if not header else {}),
    })
    store = cache_root(cache_dir) / key
    extract(path, store, spec, model=ex,
            reading=ReadOptions(format=format, text_field=text_field, keep=(label_field,), header=header),
            options=ExtractOptions(progress=progress))
    return open_store(store)


@dataclass
class FrozenFeatures:
    """Cached features of one split, in memory: sentence ``x [n, K, W]``, or token rows + offsets."""

    x: torch.Tensor
    labels: list[str]
    offsets: torch.Tensor | None = None  # token level: record i owns rows offsets[i]:offsets[i+1] of x [N, K, W]

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features of records ``index``: ``[b, K, W]``, or ``([b, T, K, W], mask [b, T])`` padded at token level."""
        if self.offsets is None:
            return self.x[index], None
        starts, ends = self.offsets[index].tolist(), self.offsets[index + 1].tolist()
        return pad_rows([self.x[s:e] for s, e in zip(starts, ends)])


def frozen_features(store: FeatureStore, layers: Sequence[int], label_field: str,
                    source: str | os.PathLike | None = None) -> FrozenFeatures:
    """Load a cached store into memory, keeping the layers ``layers`` (resolved indices) in that order.

    Records without a label (empty or null) are left out, as :func:`read_labelled` does; a list or mapping as a label
    is refused naming ``source`` (the input file the store was extracted from; default the store).
    """
    where = os.fspath(source if source is not None else store.path)
    raw = [_one_label(v, label_field, f"record {i + 1} of {where!r}") for i, v in enumerate(store.column(label_field))]
    keep = [i for i, v in enumerate(raw) if v is not None]
    labels = [str(raw[i]) for i in keep]
    stored = list(store.spec.layer_indices)
    pos = [stored.index(i) for i in layers]
    if store.level == "sentence":  # chunk by chunk: never hold all layers of the corpus at once
        chunks = []
        for c in store.iter_chunks(8192):  # sentence level: every chunk is one [n, *F] array
            chunks.append(np.asarray(np.asarray(c)[:, pos], dtype=np.float32))
        x = np.concatenate(chunks)
        return FrozenFeatures(torch.from_numpy(x[keep]), labels)
    rows, offsets = store.ragged()
    if len(keep) < len(raw):
        rows = np.concatenate([rows[offsets[i] : offsets[i + 1]] for i in keep])
        offsets = np.concatenate([[0], np.cumsum([offsets[i + 1] - offsets[i] for i in keep])])
    x = np.asarray(rows[:, pos], dtype=np.float32)
    return FrozenFeatures(torch.from_numpy(x), labels, torch.from_numpy(np.asarray(offsets, dtype=np.int64)))
