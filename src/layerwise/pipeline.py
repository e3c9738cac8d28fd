"""The windowed, batched forward pass behind every Extractor call, the per-record reducers, and input checks.

:func:`forward_windows` turns tokenised texts into strided windows, plans token-budget batches (sorted by length),
runs each batch through ``run_batch`` (a backend's ``forward``) and yields groups of finished texts, stitching the
windows of long texts back into one state per token. :func:`make_reducer` turns an :class:`~layerwise.EncodeSpec`
into the step that makes one result per record from combined token states (a sentence pool, the token vectors, or
word vectors pooled from sub-tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .padding import pad_ids, pad_rows
from .pooling import pool as pool_tokens
from .pooling import pool_words
from .spec import EncodeSpec
from .tokenize import Tokenized, Window, make_windows, plan_batches, stitch

# (combined token states [b, T, *D], mask [b, T], special [b, T], tokenised rows) -> one result per row
Reducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Tokenized]], Sequence[torch.Tensor]]


@dataclass
class Group:
    """Finished texts of one step: ``states [K, g, T, W]`` padded, one row per text in ``texts``."""

    texts: list[int]
    states: torch.Tensor
    lengths: list[int]

    def masks(self, toks: Sequence[Tokenized]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention mask [g, T], special-token mask [g, T])`` on the states' device (0 on padding)."""
        special, mask = pad_rows(
            [torch.tensor(toks[t].special[:n], dtype=torch.bool) for t, n in zip(self.texts, self.lengths)],
            longest=self.states.shape[2],
        )
        dev = self.states.device
        return mask.to(dev), special.to(dev)


@dataclass
class Encoded:
    """One record's result from :meth:`Extractor.stream <layerwise.Extractor.stream>`.

    Attributes:
        index: the record's position in the input (results come in input order).
        features: on the CPU in the spec's dtype: ``[*D]`` (sentence), ``[n_tokens, *D]`` (token, special tokens
            included) or ``[n_words, *D]`` (word).
        tokens: the tokenised record (ids, offsets, word ids; longer than the model maximum when windowed).
    """

    index: int
    features: torch.Tensor
    tokens: Tokenized


def check_texts(texts: object, *, words: bool = False, start: int = 0) -> list[Any]:
    """Check a list of texts (or of word lists with ``words=True``); returns it as a list.

    Raises:
        TypeError: not a list (a bare string is refused: wrap it in a list), or an item of the wrong type,
            naming its index (``start`` + position).
        ValueError: an empty list, or a text with a lone surrogate (naming its index and position).
    """
    what = "word lists" if words else "texts"
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(
            f"{what} must be a list of {'lists of strings' if words else 'strings'}, got {type(texts).__name__}; "
            f"wrap a single item in a list: [{'[...]' if words else 'text'}]"
        )
    if len(texts) == 0:
        raise ValueError(f"{what} is an empty list; give at least one item")
    for i, item in enumerate(texts, start):
        if words:
            if isinstance(item, str) or not isinstance(item, Sequence):
                raise TypeError(f"item {i} must be a list of word strings, got {type(item).__name__}: {item!r:.60}")
            for j, w in enumerate(item):
                if not isinstance(w, str):
                    raise TypeError(f"word {j} of item {i} must be a string, got {type(w).__name__}: {w!r:.60}")
                _check_encodable(w, f"word {j} of item {i}")
        elif not isinstance(item, str):
            raise TypeError(f"text {i} must be a string, got {type(item).__name__}: {item!r:.60}")
        else:
            _check_encodable(item, f"text {i}")
    return list(texts)


def _check_encodable(text: str, what: str) -> None:
    """``ValueError`` for a lone surrogate (what undecodable bytes become with ``errors="surrogateescape"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ValueError(
            f"{what} holds a lone surrogate {bad!r} at character {exc.start} (invalid UTF-8 in the input?); "
            f"decode the input as UTF-8 with errors='replace', or remove the character"
        ) from None


def forward_windows(
    toks: list[Tokenized],
    run_batch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    max_length: int,
    stride: int,
    batch_tokens: int,
    pad_id: int,
    sort: bool = True,
    empty: Callable[[int], torch.Tensor] | None = None,
) -> Iterator[Group]:
    """Run every window of ``toks``; yield groups of finished texts (stitched when windowed).

    ``run_batch(input_ids [b, T], attention_mask [b, T]) -> states [K, b, T, W]``. A text with no token at all (an
    empty string for a tokenizer that adds no special tokens, e.g. GPT-2) is not run: ``empty(n)`` gives its states
    ``[K, n, 0, W]`` (it pools to zeros).
    """
    windows: list[Window] = []
    per_text: list[list[int]] = []
    for i, t in enumerate(toks):
        ws = make_windows(t, i, max_length, stride)
        per_text.append(list(range(len(windows), len(windows) + len(ws))))
        windows.extend(ws)
    blank = [i for i, t in enumerate(toks) if not t.ids]
    if blank:
        if empty is None:
            raise ValueError(f"text {blank[0]} has no token (the tokenizer adds no special tokens); give empty=")
        yield Group(texts=blank, states=empty(len(blank)), lengths=[0] * len(blank))
    pending: dict[int, dict[int, torch.Tensor]] = {}
    runnable = [j for j, w in enumerate(windows) if w.ids]
    for planned in plan_batches([len(windows[j].ids) for j in runnable], batch_tokens, sort=sort):
        batch = [runnable[j] for j in planned]
        ids, mask = pad_ids([windows[j].ids for j in batch], pad_id)
        states = run_batch(ids, mask)  # [K, b, T, W]
        single = [r for r, j in enumerate(batch) if len(per_text[windows[j].text]) == 1]
        if single:
            yield Group(
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
                yield Group(texts=[text], states=full[:, None], lengths=[full.shape[1]])


def make_reducer(spec: EncodeSpec, pooler: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Reducer:
    """The per-record step of a resolved ``spec``: a sentence pool, the token vectors, or word vectors.

    Args:
        spec: the spec (its level, pool, subword and skip_special_tokens are used).
        pooler: the model's pooler, for ``pool="pooler"``.
    """
    if spec.level == "word":
        subword = str(spec.subword)

        def words(x, mask, special, rows):
            return pool_words(x, [t.word_ids for t in rows], [t.n_words for t in rows], subword)

        return words
    if spec.level == "token":

        def tokens(x, mask, special, rows):
            return [x[r, : len(t.ids)] for r, t in enumerate(rows)]

        return tokens
    mode = spec.pool if spec.pool is not None else "mean"  # a sentence-level spec always has one
    skip, unit = spec.skip_special_tokens, spec.normalize

    def sentences(
        x: torch.Tensor, mask: torch.Tensor, special: torch.Tensor, rows: Sequence[Tokenized]
    ) -> Sequence[torch.Tensor]:
        out = pool_tokens(x, mask, mode, special=special, skip_special_tokens=skip, pooler=pooler)
        return (torch.nn.functional.normalize(out, dim=-1) if unit else out).unbind(0)

    return sentences
