"""Long inputs: no silent truncation; strided windows stitched so each token gets its best-context window."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

import layerwise as lw
from layerwise.encoding.windows import plan_batches, window_starts

LONG = " ".join(
    f"Sentence {i} says that layer {i % 12} of the encoder knows something about token {i * 7 % 101}."
    for i in range(140)
)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_2000_token_text_default_model(default_extractor):
    ex = default_extractor
    n_tokens = len(ex.tokenizer(LONG, verbose=False)["input_ids"])
    assert n_tokens >= 2000
    handler = _Records()
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stack = ex.hidden_states([LONG, "short"], layers=[2, -1])
            vec = ex.encode([LONG], layers=-1, pool="mean")
            words = ex.encode_words([LONG.split()], layers=-1)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in handler.messages if "longer than" in m or "truncat" in m.lower()], handler.messages
    assert stack.tensor.shape == (2, 2, n_tokens, 384)
    assert int(stack.attention_mask[0].sum()) == n_tokens
    assert vec.shape == (1, 384) and np.isfinite(vec).all()
    assert words[0].shape == (len(LONG.split()), 384)
    # the pooled vector is the mean over all stitched tokens
    np.testing.assert_allclose(vec[0], stack.tensor[1, 0].mean(0).numpy(), atol=1e-5)


def _best_window_reference(n, windows):
    best = []
    for t in range(n):
        scores = []
        for s, e in windows:
            if s <= t < e:
                left = t - s if s > 0 else float("inf")
                right = e - 1 - t if e < n else float("inf")
                scores.append(min(left, right))
            else:
                scores.append(-1)
        best.append(int(np.argmax(scores)))  # first maximum = earliest window
    return best


@pytest.mark.parametrize("fam", ["bert", "roberta", "deberta-v2"])
@pytest.mark.parametrize("stride", [0, 3, 5])
def test_window_stitching_small_max_length(tiny_dirs, fam, stride):
    ex = lw.Extractor(str(tiny_dirs[fam]), device="cpu", max_length=12, stride=stride)
    text = "The quick brown fox jumps over the lazy dog while EU rejects German call to boycott British lamb ."
    enc = ex.tokenizer(text, verbose=False)
    ids = enc["input_ids"]
    prefix, suffix, content = ids[:1], ids[-1:], ids[1:-1]
    n = len(content)
    cap = 10
    assert n > 2 * cap
    starts = list(range(0, n - cap, cap - stride)) + [n - cap]
    windows = [(s, s + cap) for s in sorted(set(starts))]
    with torch.inference_mode():
        runs = []
        for s, e in windows:
            row = torch.tensor([prefix + content[s:e] + suffix])
            out = ex.model(input_ids=row, attention_mask=torch.ones_like(row), output_hidden_states=True)
            runs.append(out.hidden_states)
    best = _best_window_reference(n, windows)
    stack = ex.hidden_states([text, "short"], layers="all")
    assert stack.tensor.shape[2] == len(ids)
    for layer in range(ex.num_layers + 1):
        got = stack.tensor[layer, 0]
        torch.testing.assert_close(got[0], runs[0][layer][0, 0], atol=1e-5, rtol=0)  # [CLS] from the first window
        torch.testing.assert_close(got[-1], runs[-1][layer][0, -1], atol=1e-5, rtol=0)  # [SEP] from the last
        for t in range(n):
            w = best[t]
            want = runs[w][layer][0, 1 + t - windows[w][0]]
            torch.testing.assert_close(got[1 + t], want, atol=1e-5, rtol=0)
    # batching cannot change the stitched result
    again = ex.encode([text] * 3 + ["short"], layers="all", combine="mean", pool="mean", batch_tokens=12)
    np.testing.assert_allclose(again[0], again[2], atol=1e-5)
    np.testing.assert_allclose(again[0], stack.select("all").tensor[:, 0].mean(0).mean(0).numpy(), atol=1e-5)


def test_truncate_only_when_asked(tiny_dirs):
    ex = lw.Extractor(str(tiny_dirs["bert"]), device="cpu", max_length=12)
    text = "The quick brown fox jumps over the lazy dog while EU rejects German call"
    full = ex.hidden_states([text], layers=-1)
    cut = ex.hidden_states([text], layers=-1, truncate=True)
    assert full.tensor.shape[2] > 12 and cut.tensor.shape[2] == 12
    enc = ex.tokenizer([text], truncation=True, max_length=12, return_tensors="pt")
    with torch.inference_mode():
        ref = ex.model(**{k: enc[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
    torch.testing.assert_close(cut.tensor[0, 0], ref.hidden_states[-1][0], atol=1e-5, rtol=0)
    assert cut.word_ids[0][-1] is None  # the final [SEP] is kept


def test_window_and_batch_planning():
    assert window_starts(10, 10, 2) == [0]
    assert window_starts(25, 10, 0) == [0, 10, 15]
    assert window_starts(1000, 510, 128) == [0, 382, 490]
    lengths = [5, 50, 7, 49, 3]
    batches = plan_batches(lengths, batch_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert all(len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1 for b in batches)
    assert batches[0][0] == 1  # longest first
    assert plan_batches(lengths, batch_tokens=1) == [[1], [3], [2], [0], [4]]
    assert plan_batches(lengths, batch_tokens=1000, sort=False) == [[0, 1, 2, 3, 4]]


def test_roberta_words_get_a_prefix_space(tiny_extractors):
    """Byte-level BPE sees each pre-tokenised word as word-initial (HF's add_prefix_space=True behaviour)."""
    from layerwise.encoding.tokenize import needs_prefix_space, tokenize

    ex = tiny_extractors["roberta"]
    assert needs_prefix_space(ex.tokenizer) and not needs_prefix_space(tiny_extractors["bert"].tokenizer)
    tok = tokenize(ex.tokenizer, [["EU", "rejects", "German"]], words=True, template=(1, 1))[0]
    pieces = ex.tokenizer.convert_ids_to_tokens(tok.ids)
    starts = [pieces[i] for i in range(1, len(pieces) - 1) if tok.word_ids[i] != tok.word_ids[i - 1]]
    assert all(p.startswith("Ġ") for p in starts), pieces
    same = ex.tokenizer(" EU rejects German", verbose=False)["input_ids"]
    assert tok.ids == same  # identical to the running text with a leading space


def test_batches_started_ahead_give_the_same_groups(tiny_extractors):
    """A runtime that runs batches asynchronously (``Backend.start`` returning a waiter) gets up to ``ahead`` batches
    in flight, never more, and the stitched groups are the same as one batch at a time."""
    from layerwise.encoding.windows import forward_windows

    ex = lw.Extractor(tiny_extractors["bert"].loaded, backend="torch", max_length=16)
    toks = ex.tokenize(["a long text " * 20, "short", "", "another medium text here " * 3, "x"] * 3, words=False)
    layers = (0, 2)
    flight, most = [], []

    def start(ids, mask):
        states = ex.backend.forward(ids, mask, layers, "block")
        flight.append(1)
        most.append(len(flight))

        def wait():
            flight.pop()
            return states

        return wait

    def empty(n):
        return torch.zeros((len(layers), n, 0, 32))

    def run(fn, ahead):
        groups = forward_windows(toks, fn, max_length=16, stride=4, batch_tokens=64, pad_id=0, empty=empty,
                                 ahead=ahead)
        return {t: g.states[:, i, :n] for g in groups for i, (t, n) in enumerate(zip(g.texts, g.lengths))}

    want = run(lambda ids, mask: ex.backend.forward(ids, mask, layers, "block"), 1)
    got = run(start, 3)
    assert max(most) == 3 and not flight  # three in flight at most, every one waited for
    assert want.keys() == got.keys() == set(range(len(toks)))
    for t in want:
        torch.testing.assert_close(got[t], want[t], rtol=0, atol=0)


@pytest.mark.parametrize("ahead", [1, 2])
def test_control_returns_before_the_wait_for_the_last_batch_of_an_asynchronous_runtime(tiny_extractors, ahead):
    """With ``idle=True`` and a runtime that runs batches asynchronously (``ahead > 1``), an empty group comes once
    the last batch is started and before anything waits for it (the service starts its next call there); a runtime
    that computes in ``start`` (``ahead`` 1) gets no such group, which would only delay the call's answers."""
    from layerwise.encoding.windows import forward_windows

    ex = lw.Extractor(tiny_extractors["bert"].loaded, backend="torch")
    toks = ex.tokenize(["one text", "another text here", "a third"] * 4, words=False)
    events: list[str] = []

    def start(ids, mask):
        states = ex.backend.forward(ids, mask, (2,), "block")
        events.append("start")

        def wait():
            events.append("wait")
            return states

        return wait

    for group in forward_windows(toks, start, max_length=32, stride=8, batch_tokens=40, pad_id=0, ahead=ahead,
                                 idle=True):
        events.append("group" if group.texts else "empty")
    last = len(events) - 1 - events[::-1].index("start")
    if ahead > 1:
        assert events[last + 1] == "empty" and events.count("empty") == 1, events
    else:
        assert "empty" not in events, events
    assert events.count("start") == events.count("wait") >= 2


def test_windowing_below_the_positions_is_said_once_with_how_to_change_it(default_extractor, capfd):
    """The default model windows at 256 tokens (its sentence-transformers max_seq_length) though its positions allow
    512: the first text longer than the window says so, once per Extractor, with max_length to change it."""
    ex = lw.Extractor(default_extractor.loaded)
    text = " ".join(["layer"] * 290)  # 292 tokens with [CLS] and [SEP]
    capfd.readouterr()
    ex.encode(["short", "texts only"])
    assert "longer than the window" not in capfd.readouterr().err  # nothing windowed: nothing said
    ex.encode([text])
    said = capfd.readouterr().err
    assert "a text of 292 tokens is longer than the window of 256 tokens" in said, said
    assert "(max_seq_length); its positions allow 512" in said and "max_length=512 (--max-length 512)" in said
    ex.encode([text, text])
    assert "longer than the window" not in capfd.readouterr().err  # once per Extractor
    one_pass = lw.Extractor(default_extractor.loaded, max_length=512)
    one_pass.encode([text])
    assert "longer than the window" not in capfd.readouterr().err  # it fits: nothing is windowed
