"""One shard's rows: which items a run encodes for its records, tokenising them without the model (a CPU stage of
another process), encoding them into the tensors of :mod:`layerwise.store.layout`, and the header a store records
about the run. The local engine (:mod:`layerwise.extraction.engine`) and the Ray stages
(:mod:`layerwise.extraction.ray`) both write through these."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..corpus.readers import ReadOptions, Record
from ..corpus.sources import Source
from ..encoding.spec import EncodeSpec
from ..encoding.tokenize import TextTokenizer, Tokenized, check_texts
from ..extractor import Extractor
from ..model.describe import model_identity
from ..store import STORE_DTYPES
from ..store.layout import shard_rows


def store_header(ex: Extractor, spec: EncodeSpec, source: Source, reading: ReadOptions, *,
                 quick_input: bool = False) -> dict[str, Any]:
    """What a store records about a run: the resolved spec, the model (its identity from
    :func:`~layerwise.model.describe.describe`, and the :class:`~layerwise.ModelOptions` it was loaded with), the
    tokenizer, the input (``quick_input``: by file names, sizes and times, not a read of every byte), the feature
    shape."""
    tok = ex.tokenizer
    return {
        "spec": spec.to_dict(),
        "model": model_identity(ex.describe(), ex.fingerprint()),
        "model_options": ex.options.to_dict(),
        "tokenizer": {"class": type(tok).__name__, "vocab_size": len(tok), "max_length": ex.max_length,
                      "stride": ex.stride, "do_lower_case": getattr(tok, "do_lower_case", None)},
        "input": source.identity(reading, quick=quick_input),
        "feature_shape": list(spec.feature_shape(ex.site_width(spec.site))),
    }


def shard_items(spec: EncodeSpec, records: list[Record]) -> tuple[list[Any], list[list[str]]]:
    """What to encode for ``records``: texts, or at word level word lists (with their CoNLL document context around
    them); and each record's own words (word level; else empty)."""
    if spec.level != "word":
        return [r.text for r in records], []
    own = [r.words if r.words is not None else r.text.split() for r in records]
    return [(r.context[0] + w + r.context[1]) if r.context else w for r, w in zip(records, own)], own


def tokenize_records(tokenizer: TextTokenizer, spec: EncodeSpec, records: list[Record]) -> list[Tokenized]:
    """Tokenise ``records`` as :func:`shard_tensors` would (``spec`` resolved): the CPU half of a shard, for an engine
    that tokenises in another process than the model's (:mod:`layerwise.extraction.ray`)."""
    items, _ = shard_items(spec, records)
    words = spec.level == "word"
    items = check_texts(items, words=words)
    return tokenizer(items, words=words, truncate=spec.truncate, prompt=spec.prompt, add_eos=spec.add_eos)


def shard_tensors(
    ex: Extractor, spec: EncodeSpec, records: list[Record], keep: tuple[str, ...], batch_tokens: int,
    toks: list[Tokenized] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str], int]:
    """Features of ``records`` as the shard tensors of :mod:`layerwise.store.layout`, its metadata, and its tokens.

    Word level with CoNLL document context: each record is encoded with its neighbours and keeps its own words.
    ``toks``: the records already tokenised by :func:`tokenize_records` (then only the model runs here).
    """
    words = spec.level == "word"
    items, own = shard_items(spec, records)
    dtype = STORE_DTYPES[spec.output_dtype]
    d = int(np.prod(spec.feature_shape(ex.site_width(spec.site))))
    sentence = spec.level == "sentence"
    feats = np.empty((len(records), d), dtype=dtype) if sentence else None  # filled in place
    rows: list[np.ndarray] = []
    ids: list[list[int]] = []
    tokens = 0
    encoded = (ex.stream(items, spec, batch_tokens=batch_tokens) if toks is None
               else ex.encode_tokenized(toks, spec, batch_tokens=batch_tokens))
    for res in encoded:
        vec, rec = res.features, records[res.index]
        if words and rec.context:
            vec = vec[len(rec.context[0]) : len(rec.context[0]) + len(own[res.index])]
        if sentence:
            feats[res.index] = vec.reshape(d).numpy()  # type: ignore[index]
        else:
            rows.append(vec.reshape(-1, d).numpy())
            ids.append(res.tokens.ids)
        tokens += len(res.tokens.ids)
    runtime = ex.backend.runtime_name(spec.layer_indices, spec.site)  # what computed it (a store's is pinned)
    tensors, meta = shard_rows(spec.level, [r.line for r in records], feats if feats is not None else rows, d, dtype,
                               token_ids=ids, words=own if words else (),
                               columns={k: [r.fields.get(k) for r in records] for k in keep}, tokens=tokens)
    return tensors, {**meta, "runtime": runtime}, tokens


__all__ = ["shard_items", "shard_tensors", "store_header", "tokenize_records"]
