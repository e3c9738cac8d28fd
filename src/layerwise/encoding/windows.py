"""Long inputs as strided windows, token-budget batches, and the windowed forward pass that stitches them back.

Long inputs are never truncated silently. A text whose tokens do not fit the model's ``max_length`` is cut
into windows of at most ``max_length`` tokens (each with the model's own special tokens around it) that
overlap by ``stride`` tokens. After the forward pass every token takes its state from the window where it
has the most context (the largest distance to a window edge that is not the text's own edge), so the
stitched sequence has one state per token of the whole text: ``[prefix specials] content [suffix specials]``,
the prefix taken from the first window and the suffix from the last.

Batches are planned over windows: sorted by length (longest first), filled while
``count * longest <= batch_tokens``; :func:`forward_windows` runs each batch through a backend's ``forward`` and
yields groups of finished texts (callers restore the original order).

Example::

    >>> starts = window_starts(n_content=1000, capacity=510, stride=128)
    >>> starts
    [0, 382, 490]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..errors import SpecError
from .padding import pad_ids, pad_rows
from .tokenize import Tokenized


@dataclass
class Window:
    """``[start, end)`` over the content tokens of text ``text`` (one forward-pass row)."""

    text: int
    start: int
    end: int
    ids: list[int]


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
class Group:
    """Finished texts of one step: ``states [K, g, T, W]`` padded, one row per text in ``texts``, all of one
    ``segment`` (see :func:`forward_windows`)."""

    texts: list[int]
    states: torch.Tensor
    lengths: list[int]
    segment: int = 0

    def masks(self, toks: Sequence[Tokenized]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention mask [g, T], special-token mask [g, T])`` on the states' device (0 on padding)."""
        special, mask = pad_rows(
            [torch.tensor(toks[t].special[:n], dtype=torch.bool) for t, n in zip(self.texts, self.lengths)],
            longest=self.states.shape[2],
        )
        dev = self.states.device
        return mask.to(dev), special.to(dev)


# run(input_ids, attention_mask) or, with per-row depths, run(input_ids, attention_mask, depths)
RunBatch = Callable[..., "torch.Tensor | Callable[[], torch.Tensor]"]


def forward_windows(
    toks: list[Tokenized],
    run_batch: RunBatch | Sequence[RunBatch],
    *,
    max_length: int,
    stride: int,
    batch_tokens: int,
    pad_id: int,
    sort: bool = True,
    empty: Callable[[int], torch.Tensor] | Sequence[Callable[[int], torch.Tensor]] | None = None,
    ahead: int = 1,
    idle: bool = False,
    segments: Sequence[int] | None = None,
    depths: Sequence[int] | None = None,
) -> Iterator[Group]:
    """Run every window of ``toks``; yield groups of finished texts (stitched when windowed).

    ``run_batch(input_ids [b, T], attention_mask [b, T]) -> states [K, b, T, W]``, or a callable that waits for them
    (a runtime that runs batches asynchronously: :meth:`~layerwise.model.backends.base.Backend.start`). Up to
    ``ahead`` batches are started before the oldest is waited for, so the runtime computes the next batches while the
    caller reduces this one's groups. A text with no token at all (an empty string for a tokenizer that adds no
    special tokens, e.g. GPT-2) is not run: ``empty(n)`` gives its states ``[K, n, 0, W]`` (it pools to zeros).
    With ``idle=True`` a batch that finishes no text (windows of a long text whose others are still to run) yields
    an empty group (``texts == []``), so a caller that shares the model between requests gets control back after
    every batch; and once the last batch is started in a runtime that runs batches asynchronously (``ahead > 1``), an
    empty group comes before it is waited for, so that caller can start other work behind it.

    Segments: with ``segments`` (the segment of each text), ``run_batch`` and ``empty`` are sequences with one
    function per segment (say, each to its own depth). A batch holds windows of one segment only, every segment's
    batches go through the same pipeline of ``ahead`` batches (so the runtime never waits between segments), and each
    group says its ``segment``.

    Depths: with ``depths`` (the deepest layer each text needs), the rows of every batch are ordered deepest first
    and ``run_batch(input_ids, attention_mask, row_depths)`` gets each row's depth, so a runtime that can lets each
    row leave the batch at its own depth (:meth:`~layerwise.model.backends.base.Backend.start_ragged`).
    """
    runs = list(run_batch) if isinstance(run_batch, Sequence) else [run_batch]
    empties = list(empty) if isinstance(empty, Sequence) else [empty] * len(runs)
    segment_of = list(segments) if segments is not None else [0] * len(toks)
    windows: list[Window] = []
    per_text: list[list[int]] = []
    for i, t in enumerate(toks):
        ws = make_windows(t, i, max_length, stride)
        per_text.append(list(range(len(windows), len(windows) + len(ws))))
        windows.extend(ws)
    for seg in range(len(runs)):
        blank = [i for i, t in enumerate(toks) if not t.ids and segment_of[i] == seg]
        if blank:
            make_empty = empties[seg]
            if make_empty is None:
                raise SpecError(f"text {blank[0]} has no token (the tokenizer adds no special tokens); give empty=")
            yield Group(texts=blank, states=make_empty(len(blank)), lengths=[0] * len(blank), segment=seg)
    pending: dict[int, dict[int, torch.Tensor]] = {}

    def finish(batch: list[int], states: torch.Tensor, seg: int) -> Iterator[Group]:  # states: [K, b, T, W]
        single = [r for r, j in enumerate(batch) if len(per_text[windows[j].text]) == 1]
        if single:
            yield Group(
                texts=[windows[batch[r]].text for r in single],
                states=states if len(single) == len(batch) else states[:, single],  # no copy when all are whole
                lengths=[len(windows[batch[r]].ids) for r in single],
                segment=seg,
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
                yield Group(texts=[text], states=full[:, None], lengths=[full.shape[1]], segment=seg)

    def finished(done: list[int], result: torch.Tensor | Callable[[], torch.Tensor], seg: int) -> Iterator[Group]:
        states = result if isinstance(result, torch.Tensor) else result()
        groups = 0
        for group in finish(done, states, seg):
            groups += 1
            yield group
        if idle and not groups:
            yield Group(texts=[], states=states[:, :0], lengths=[], segment=seg)

    batches: list[tuple[int, list[int]]] = []  # (segment, windows), in the order they run
    for seg in range(len(runs)):
        runnable = [j for j, w in enumerate(windows) if w.ids and segment_of[w.text] == seg]
        batches += [(seg, [runnable[j] for j in planned])
                    for planned in plan_batches([len(windows[j].ids) for j in runnable], batch_tokens, sort=sort)]
    inflight: deque[tuple[list[int], torch.Tensor | Callable[[], torch.Tensor], int]] = deque()
    for k, (seg, batch) in enumerate(batches):
        if depths is not None:
            batch.sort(key=lambda j: -depths[windows[j].text])
        ids, mask = pad_ids([windows[j].ids for j in batch], pad_id)
        run = runs[seg]
        started = run(ids, mask) if depths is None else run(ids, mask, [depths[windows[j].text] for j in batch])
        inflight.append((batch, started, seg))
        if idle and k == len(batches) - 1 and ahead > 1:
            # the last batch runs in the runtime (one that runs batches asynchronously: ahead > 1) and nothing is
            # left to start: control goes back to the caller before the wait, so it can prepare and start other
            # work behind it (the service's next call). A runtime that computes in start() would only delay this
            # call's answers by the next call's forward pass.
            yield Group(texts=[], states=torch.empty((0, 0, 0, 0)), lengths=[], segment=seg)
        while len(inflight) >= max(1, ahead):
            yield from finished(*inflight.popleft())
    while inflight:
        yield from finished(*inflight.popleft())
