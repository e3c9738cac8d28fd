"""Tokenisation with the model's special tokens, word alignment, and the checks on what is tokenised.

:class:`TextTokenizer` is the model-free, picklable tokenising half of an :class:`~layerwise.Extractor`: texts (or
pre-tokenised word lists) become :class:`Tokenized` rows (ids, character offsets, word ids, a special-token mask)
that may be longer than the model's maximum; :mod:`layerwise.encoding.windows` cuts those into windows.
:func:`check_texts` refuses what cannot be tokenised (a bare string, a wrong type, a lone surrogate) naming the
item, before any compute.

Example::

    >>> import layerwise as lw
    >>> toks = lw.Extractor().tokenize(["I love Paris"], words=False)
    >>> toks[0].ids[:1], toks[0].n_prefix, toks[0].n_suffix           # [CLS] ... [SEP]
    ([101], 1, 1)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import InputError, SpecError


@dataclass
class Tokenized:
    """One text after tokenisation, with the model's special tokens (the stitched view).

    ``ids``, ``offsets``, ``word_ids`` and ``special`` all have the same length ``n_tokens``, which may
    exceed the model's maximum when the text is long.
    """

    ids: list[int]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]
    special: list[bool]
    n_prefix: int
    n_suffix: int
    n_words: int = 0  # pre-tokenised input: how many words the item has (some may produce no token)

    @property
    def n_content(self) -> int:
        return len(self.ids) - self.n_prefix - self.n_suffix


def special_template(tokenizer) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before and after one sequence (BERT: 1, 1)."""
    enc = tokenizer("a", add_special_tokens=True, return_special_tokens_mask=True, verbose=False)
    mask = enc["special_tokens_mask"]
    n_prefix = next((i for i, m in enumerate(mask) if not m), len(mask))
    n_suffix = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
    return n_prefix, n_suffix


def needs_prefix_space(tokenizer) -> bool:
    """Whether pre-tokenised words must get a leading space (byte-level BPE without ``add_prefix_space``).

    RoBERTa-style tokenizers mark word starts with a space ("Ġ"); fed word by word without one, every word
    would be encoded as if glued to the previous one. Hugging Face's advice is ``add_prefix_space=True`` for
    pre-tokenised input; layerwise applies the same effect by prefixing each word with a space.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    parts = spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]
    return any(p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False) for p in parts)


def tokenize(tokenizer, items: Sequence, *, words: bool, template: tuple[int, int]) -> list[Tokenized]:
    """Tokenise texts (``words=False``) or pre-tokenised word lists (``words=True``) without truncation.

    Returns one :class:`Tokenized` per item; ``word_ids`` index the words of the item (for texts: the
    tokenizer's own pre-tokenised words). A pre-tokenised word that is empty or only whitespace gets no token.
    """
    items = list(items)
    if words:
        # One rule for every family: a word that is empty or only whitespace has no token (its vector is zeros).
        # Byte-level BPE would otherwise turn the prefix space into a lone 'Ġ' token.
        prefix = " " if needs_prefix_space(tokenizer) else ""
        items = [[prefix + w if w.strip() else "" for w in ws] for ws in items]
    enc = tokenizer(
        items,
        add_special_tokens=True,
        truncation=False,
        is_split_into_words=words,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )
    n_prefix, n_suffix = template
    out = []
    for i, ids in enumerate(enc["input_ids"]):
        word_ids = enc.word_ids(i)
        special = [bool(s) for s in enc["special_tokens_mask"][i]]
        out.append(
            Tokenized(
                ids=list(ids),
                offsets=[tuple(o) for o in enc["offset_mapping"][i]],
                word_ids=[None if s else w for w, s in zip(word_ids, special)],
                special=special,
                n_prefix=min(n_prefix, len(ids)),
                n_suffix=min(n_suffix, max(len(ids) - n_prefix, 0)),
            )
        )
    return out


def append_eos(toks: Sequence[Tokenized], eos_id: int) -> None:
    """Append ``eos_id`` as a special suffix token to every text that does not already end with it (in place).

    Decoder embedding models (e5-mistral, gte-Qwen) read the state of an end-of-sequence token appended to each
    text; tokenizers that do not add one themselves get it here. It is a suffix special token, so a windowed text
    has it at the end of every window, like ``[SEP]``.
    """
    for t in toks:
        if t.ids and t.ids[-1] == eos_id and t.special[-1]:
            continue
        end = t.offsets[-1][1] if t.offsets else 0
        t.ids.append(eos_id)
        t.offsets.append((end, end))
        t.word_ids.append(None)
        t.special.append(True)
        t.n_suffix += 1


@dataclass
class TextTokenizer:
    """The tokenising half of an :class:`~layerwise.Extractor`, without the model: picklable, so a CPU stage (a Ray
    task) can make the :class:`Tokenized` inputs that the model's stage then runs (``Extractor.encode_tokenized``).

    Attributes:
        tokenizer: the model's fast tokenizer. template: special tokens before/after the content.
        max_length: the window length (``truncate`` keeps this many tokens). name: the model, for messages.
    """

    tokenizer: Any
    template: tuple[int, int]
    max_length: int
    name: str

    def __call__(
        self, items: Sequence[Any], *, words: bool, truncate: bool = False, prompt: str = "", add_eos: bool = False
    ) -> list[Tokenized]:
        """Tokenise texts (or word lists with ``words=True``) with the model's special tokens.

        With ``truncate`` a text longer than ``max_length`` keeps its first tokens and its special tokens; otherwise
        it is kept whole (windowed by the forward pass). ``prompt`` is put before every text; ``add_eos`` appends
        the tokenizer's end-of-sequence token where the tokenizer does not (see :class:`~layerwise.EncodeSpec`).
        """
        if prompt:
            items = [prompt + text for text in items]
        toks = tokenize(self.tokenizer, items, words=words, template=self.template)
        if words:
            for t, item in zip(toks, items):
                t.n_words = len(item)
        return self._finish(toks, truncate=truncate, add_eos=add_eos)

    def from_ids(self, id_lists: Sequence[Sequence[int]], *, truncate: bool = False, add_eos: bool = False
                 ) -> list[Tokenized]:
        """Texts given as the model's own token ids (``[n_i]`` each, without special tokens), with the special
        tokens added as the tokenizer adds them to a text; ``truncate`` and ``add_eos`` as for a text.

        Raises:
            InputError: an id outside the vocabulary (naming the text, the position and the id).
        """
        vocab = len(self.tokenizer)
        for i, ids in enumerate(id_lists):
            bad = next((j for j, x in enumerate(ids) if not 0 <= x < vocab), None)
            if bad is not None:
                raise InputError(f"token id {ids[bad]} (input {i}, position {bad}) is outside the vocabulary of "
                                 f"{self.name!r} (ids 0..{vocab - 1}); token ids must be this model's own")
        enc = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        pre, suf = list(enc[: self.template[0]]), list(enc[len(enc) - self.template[1]:]) if self.template[1] else []
        toks = []
        for ids in id_lists:
            content = [int(x) for x in ids]
            n = len(pre) + len(content) + len(suf)
            toks.append(Tokenized(ids=pre + content + suf, offsets=[(0, 0)] * n,
                                  word_ids=[None] * len(pre) + list(range(len(content))) + [None] * len(suf),
                                  special=[True] * len(pre) + [False] * len(content) + [True] * len(suf),
                                  n_prefix=len(pre), n_suffix=len(suf)))
        return self._finish(toks, truncate=truncate, add_eos=add_eos)

    def _finish(self, toks: list[Tokenized], *, truncate: bool, add_eos: bool) -> list[Tokenized]:
        if add_eos:
            eos = self.tokenizer.eos_token_id
            if eos is None:
                raise SpecError(
                    f"add_eos=True, but the tokenizer of {self.name!r} has no end-of-sequence token; drop "
                    f"add_eos (pool='last' then reads the last token of the text)"
                )
            append_eos(toks, eos)
        if truncate:
            for t in toks:
                cap = self.max_length - t.n_prefix - t.n_suffix
                if t.n_content > cap:
                    keep = list(range(t.n_prefix + cap)) + list(range(len(t.ids) - t.n_suffix, len(t.ids)))
                    t.ids, t.offsets = [t.ids[i] for i in keep], [t.offsets[i] for i in keep]
                    t.word_ids, t.special = [t.word_ids[i] for i in keep], [t.special[i] for i in keep]
        return toks


BLANK_RULE = ("blank input has no meaning to encode: Extractor.encode refuses it naming its index, the service "
              "answers 422, and layerwise extract skips such a record, counts it and lists it in the store's "
              "errors.jsonl. Leave it out (e.g. [t for t in texts if t.strip()])")


def check_texts(texts: object, *, words: bool = False, start: int = 0, allow_empty: bool = False,
                refuse_blank: bool = False) -> list[Any]:
    """Check texts (or word lists with ``words=True``) and return them as a list (word lists as lists).

    Any iterable of strings is taken, in its order: a list, a tuple, a pandas ``Series``, a numpy array of strings,
    a generator (read once); items that subclass ``str`` (``numpy.str_``) become plain ``str``. A word list may be
    any iterable of strings too.

    Args:
        texts: the iterable.
        words: items are word lists (pre-tokenised input), not texts.
        start: the index of the first item in messages (a chunk of a longer stream).
        allow_empty: an empty iterable is returned as ``[]`` instead of refused.
        refuse_blank: a blank text (nothing left after stripping whitespace), an empty word list or a blank word is
            refused naming its index: the one rule of blank input (:data:`BLANK_RULE`).

    Raises:
        TypeError: a bare string or bytes (wrap it in a list), something that is not iterable, an iterable whose
            order means nothing (a set) or that iterates something else than its texts (a mapping's keys, a
            DataFrame's column names), or an item of the wrong type, naming its index (``start`` + position).
        ValueError: an empty iterable (unless ``allow_empty``), a text with a lone surrogate (naming its index
            and position), or a blank one (with ``refuse_blank``, naming its index).
    """
    what = "word lists" if words else "texts"
    kind = "lists of strings" if words else "strings"
    got = type(texts).__name__
    if isinstance(texts, (str, bytes)):
        raise TypeError(
            f"{what} must be a list of {kind}, got {got}; wrap a single item in a list: "
            f"[{'[...]' if words else 'text'}] (any iterable of {kind} works: a tuple, a pandas Series, a numpy "
            f"array, a generator)"
        )
    if isinstance(texts, (AbstractSet, Mapping)):
        why = ("a set has no order, so the results could not be matched to their items: pass list(...) or "
               "sorted(...)" if isinstance(texts, AbstractSet) else
               "iterating a mapping gives its keys: pass list(d.values()) or the keys themselves as a list")
        raise TypeError(f"{what} must be a list of {kind}, got {got}; {why}")
    if hasattr(texts, "columns") and hasattr(texts, "iloc"):  # a pandas DataFrame iterates its column names
        raise TypeError(f"{what} must be a list of {kind}, got {got} (iterating it gives its column names); pass "
                        f"one column of it, e.g. df['text']")
    try:
        items = list(texts)  # type: ignore[call-overload]
    except TypeError:  # not iterable (None, a number, a 0-d numpy array)
        raise TypeError(
            f"{what} must be a list of {kind}, got {got}; pass a list (or any iterable) of {kind}, e.g. "
            f"[{'[...]' if words else 'text'}]"
        ) from None
    if not items and not allow_empty:
        raise SpecError(f"{what} is an empty list; give at least one item")
    for i, item in enumerate(items):
        n = start + i
        if words:
            if isinstance(item, (str, bytes)) or not isinstance(item, Iterable):
                raise TypeError(f"item {n} must be a list of word strings, got {type(item).__name__}: {item!r:.60}")
            item = items[i] = list(item)
            if refuse_blank and not item:
                raise InputError(f"item {n} has no word; {BLANK_RULE}")
            for j, w in enumerate(item):
                if not isinstance(w, str):
                    raise TypeError(f"word {j} of item {n} must be a string, got {type(w).__name__}: {w!r:.60}")
                if type(w) is not str:
                    item[j] = w = str(w)
                if refuse_blank and not w.strip():
                    raise InputError(f"word {j} of item {n} is empty (nothing left after stripping whitespace), so it "
                                    f"would have no vector; {BLANK_RULE}")
                _check_encodable(w, f"word {j} of item {n}")
        elif not isinstance(item, str):
            raise TypeError(f"text {n} must be a string, got {type(item).__name__}: {item!r:.60}")
        else:
            if type(item) is not str:
                items[i] = item = str(item)
            if refuse_blank and not item.strip():
                raise InputError(f"text {n} is empty (nothing left after stripping whitespace); {BLANK_RULE}")
            _check_encodable(item, f"text {n}")
    return items


def _check_encodable(text: str, what: str) -> None:
    """``ValueError`` for a lone surrogate (what undecodable bytes become with ``errors="surrogateescape"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise SpecError(
            f"{what} holds a lone surrogate {bad!r} at character {exc.start} (invalid UTF-8 in the input?); "
            f"decode the input as UTF-8 with errors='replace', or remove the character"
        ) from exc
