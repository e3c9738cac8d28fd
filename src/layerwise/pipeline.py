"""The windowed, batched forward pass behind every Extractor call, and input checks.

:func:`forward_windows` turns tokenised texts into strided windows, plans token-budget batches (sorted by length),
runs each batch through ``run_batch`` (PyTorch capture or ONNX Runtime) and yields groups of finished texts,
stitching the windows of long texts back into one state per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .pooling import pool as pool_tokens
from .pooling import pool_words
from .tokenize import Tokenized, Window, make_windows, pad_batch, plan_batches, stitch


@dataclass
class _Group:
    """Finished texts of one step: ``states [K, g, T, W]`` padded, one row per text in ``texts``."""

    texts: list[int]
    states: torch.Tensor
    lengths: list[int]


def _check_texts(texts: object, *, words: bool = False) -> list:
    what = "word lists" if words else "texts"
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(
            f"{what} must be a list of {'lists of strings' if words else 'strings'}, got {type(texts).__name__}; "
            f"wrap a single item in a list: [{'[...]' if words else 'text'}]"
        )
    if len(texts) == 0:
        raise ValueError(f"{what} is an empty list; give at least one item")
    for i, item in enumerate(texts):
        if words:
            if isinstance(item, str) or not isinstance(item, Sequence):
                raise TypeError(f"item {i} must be a list of word strings, got {type(item).__name__}: {item!r:.60}")
            for j, w in enumerate(item):
                if not isinstance(w, str):
                    raise TypeError(f"word {j} of item {i} must be a string, got {type(w).__name__}: {w!r:.60}")
        elif not isinstance(item, str):
            raise TypeError(f"text {i} must be a string, got {type(item).__name__}: {item!r:.60}")
    return list(texts)


def forward_windows(
    toks: list[Tokenized],
    run_batch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    max_length: int,
    stride: int,
    batch_tokens: int,
    pad_id: int,
    sort: bool = True,
) -> Iterator[_Group]:
    """Run every window of ``toks``; yield groups of finished texts (stitched when windowed).

    ``run_batch(input_ids [b, T], attention_mask [b, T]) -> states [K, b, T, W]``.
    """
    windows: list[Window] = []
    per_text: list[list[int]] = []
    for i, t in enumerate(toks):
        ws = make_windows(t, i, max_length, stride)
        per_text.append(list(range(len(windows), len(windows) + len(ws))))
        windows.extend(ws)
    pending: dict[int, dict[int, torch.Tensor]] = {}
    for batch in plan_batches([len(w.ids) for w in windows], batch_tokens, sort=sort):
        ids, mask = pad_batch([windows[j].ids for j in batch], pad_id)
        states = run_batch(ids, mask)  # [K, b, T, W]
        single = [r for r, j in enumerate(batch) if len(per_text[windows[j].text]) == 1]
        if single:
            yield _Group(
                texts=[windows[batch[r]].text for r in single],
                states=states[:, single],
                lengths=[len(windows[batch[r]].ids) for r in single],
            )
        for r, j in enumerate(batch):
            text = windows[j].text
            if len(per_text[text]) == 1:
                continue
            got = pending.setdefault(text, {})
            got[j] = states[:, r, : len(windows[j].ids)].clone()  # do not pin the whole batch
            if len(got) == len(per_text[text]):
                del pending[text]
                order = per_text[text]
                full = stitch(toks[text], [windows[k] for k in order], [got[k] for k in order])
                yield _Group(texts=[text], states=full[:, None], lengths=[full.shape[1]])


def sentence_reducer(pool, skip_special_tokens: bool, pooler=None):
    """``(x, mask, special, rows) -> per-row vectors``: a sentence pool, or token vectors for ``pool=None``."""

    def reduce(x, mask, special, rows):
        if pool is None:
            return [x[r, : len(t.ids)].clone() for r, t in enumerate(rows)]
        return pool_tokens(x, mask, pool, special=special, skip_special_tokens=skip_special_tokens, pooler=pooler)

    return reduce


def word_reducer(subword: str):
    """``(x, mask, special, rows) -> per-row [n_words, D]``, pooled from each word's sub-tokens."""

    def reduce(x, mask, special, rows):
        return pool_words(x, [t.word_ids for t in rows], [t.n_words for t in rows], subword)

    return reduce
