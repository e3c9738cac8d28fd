"""Tokenisation, strided windows for long input, token-budget batches sorted by length, word alignment.

Long inputs are never truncated silently. A text whose tokens do not fit the model's ``max_length`` is cut
into windows of at most ``max_length`` tokens (each with the model's own special tokens around it) that
overlap by ``stride`` tokens. After the forward pass every token takes its state from the window where it
has the most context (the largest distance to a window edge that is not the text's own edge), so the
stitched sequence has one state per token of the whole text: ``[prefix specials] content [suffix specials]``,
the prefix taken from the first window and the suffix from the last.

Batches are planned over windows: sorted by length (longest first), filled while
``count * longest <= batch_tokens``; callers restore the original order.

Example::

    >>> starts = window_starts(n_content=1000, capacity=510, stride=128)
    >>> starts
    [0, 382, 490]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch


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


@dataclass
class Window:
    """``[start, end)`` over the content tokens of text ``text`` (one forward-pass row)."""

    text: int
    start: int
    end: int
    ids: list[int]


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


def window_starts(n_content: int, capacity: int, stride: int) -> list[int]:
    """Start offsets of windows of ``capacity`` content tokens overlapping by ``stride``; last one flush right."""
    if n_content <= capacity:
        return [0]
    step = capacity - stride
    starts = list(range(0, n_content - capacity, step)) + [n_content - capacity]
    return sorted(set(starts))


def make_windows(
    tok: Tokenized, text: int, max_length: int, stride: int, truncate: bool = False
) -> list[Window]:
    """The forward-pass rows of one text: one window if it fits (or ``truncate``), else strided windows."""
    capacity = max_length - tok.n_prefix - tok.n_suffix
    prefix = tok.ids[: tok.n_prefix]
    suffix = tok.ids[len(tok.ids) - tok.n_suffix :]
    content = tok.ids[tok.n_prefix : len(tok.ids) - tok.n_suffix]
    if truncate or len(content) <= capacity:
        end = min(len(content), capacity)
        return [Window(text, 0, end, prefix + content[:end] + suffix)]
    return [
        Window(text, s, s + capacity, prefix + content[s : s + capacity] + suffix)
        for s in window_starts(len(content), capacity, stride)
    ]


def best_window(n_content: int, windows: Sequence[Window]) -> list[int]:
    """For each content token, the index of the window that gives it the most context (ties: earlier)."""
    best = [0] * n_content
    score = [-1] * n_content
    for w_idx, w in enumerate(windows):
        for t in range(w.start, w.end):
            left = t - w.start if w.start > 0 else n_content
            right = w.end - 1 - t if w.end < n_content else n_content
            s = min(left, right)
            if s > score[t]:
                best[t], score[t] = w_idx, s
    return best


def stitch(tok: Tokenized, windows: Sequence[Window], states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join per-window states into one state per token of the whole text.

    Args:
        tok: the text.
        windows: its windows, in order.
        states: one tensor per window, ``[layers, window_tokens, width]`` (no padding).

    Returns:
        ``[layers, n_tokens, width]`` where ``n_tokens = len(tok.ids)`` (or the truncated length).
    """
    if len(windows) == 1:
        return states[0]
    p, s = tok.n_prefix, tok.n_suffix
    n_content = windows[-1].end
    choice = best_window(n_content, windows)
    parts = [states[0][:, :p]]
    t = 0
    while t < n_content:  # contiguous runs taken from the same window
        w = choice[t]
        u = t
        while u < n_content and choice[u] == w:
            u += 1
        lo = p + t - windows[w].start
        parts.append(states[w][:, lo : lo + (u - t)])
        t = u
    last = states[-1]
    parts.append(last[:, last.shape[1] - s :] if s else last[:, :0])
    return torch.cat(parts, dim=1)


def plan_batches(lengths: Sequence[int], batch_tokens: int, sort: bool = True) -> list[list[int]]:
    """Group row indices into batches whose padded size ``rows * longest`` stays within ``batch_tokens``.

    With ``sort=True`` rows are taken longest first (padding is minimal and an out-of-memory error shows up
    in the first batch); otherwise in the given order. A row longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else list(range(len(lengths)))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and (len(current) + 1) * new_longest > batch_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


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
        if add_eos:
            eos = self.tokenizer.eos_token_id
            if eos is None:
                raise ValueError(
                    f"add_eos=True, but the tokenizer of {self.name!r} has no end-of-sequence token; drop "
                    f"add_eos (pool='last' then reads the last token of the text)"
                )
            append_eos(toks, eos)
        if words:
            for t, item in zip(toks, items):
                t.n_words = len(item)
        if truncate:
            for t in toks:
                cap = self.max_length - t.n_prefix - t.n_suffix
                if t.n_content > cap:
                    keep = list(range(t.n_prefix + cap)) + list(range(len(t.ids) - t.n_suffix, len(t.ids)))
                    t.ids, t.offsets = [t.ids[i] for i in keep], [t.offsets[i] for i in keep]
                    t.word_ids, t.special = [t.word_ids[i] for i in keep], [t.special[i] for i in keep]
        return toks
