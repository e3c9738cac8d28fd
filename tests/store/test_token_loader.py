"""The token loader (layerwise.store.token_loader): a permutation of every row, exactly once per epoch, the same order
for the same seed, resumable from a batch, split over DataLoader workers without loss or repeat, every stored dtype
decoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layerwise.errors import StoreError
from layerwise.store.token_loader import Permutation, RowSource, TokenLoader


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31), epoch=st.integers(0, 3))
def test_the_permutation_is_a_bijection_of_every_size(n, seed, epoch):
    perm = Permutation(n, seed, epoch)(np.arange(n))
    assert np.array_equal(np.sort(perm), np.arange(n))


def test_the_permutation_shuffles_and_depends_on_seed_and_epoch():
    n = 100_003
    a = Permutation(n, 0)(np.arange(n))
    assert np.array_equal(a, Permutation(n, 0)(np.arange(n)))
    assert not np.array_equal(a, Permutation(n, 1)(np.arange(n)))
    assert not np.array_equal(a, Permutation(n, 0, epoch=1)(np.arange(n)))
    # a shuffle, not a rotation: neighbours land far apart and the first rows are spread over the whole range
    assert np.corrcoef(np.arange(n), a)[0, 1] ** 2 < 1e-3
    assert a[:1000].min() < n // 20 and a[:1000].max() > n - n // 20


def sources(rows_per_shard=(37, 50, 13), width=4):
    """Shards whose row r holds the value r (global) in every column; token ids r % 7 (id 0: "special")."""
    out, at = [], 0
    for n in rows_per_shard:
        values = np.repeat(np.arange(at, at + n, dtype=np.float32)[:, None], width, axis=1)
        out.append(RowSource(values, None, (np.arange(at, at + n) % 7).astype(np.int32)))
        at += n
    return out


def seen(loader):
    return [b[:, 0].to(torch.int64).tolist() for b in loader]


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_row_appears_exactly_once_per_epoch(shuffle):
    batches = seen(TokenLoader(sources(), "float32", 16, shuffle=shuffle, seed=3))
    flat = [r for b in batches for r in b]
    assert sorted(flat) == list(range(100))
    assert [len(b) for b in batches] == [16] * 6 + [4]
    assert (flat == sorted(flat)) != shuffle


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    a = seen(TokenLoader(sources(), "float32", 16, seed=7))
    assert a == seen(TokenLoader(sources(), "float32", 16, seed=7))
    assert a != seen(TokenLoader(sources(), "float32", 16, seed=8))
    assert a != seen(TokenLoader(sources(), "float32", 16, seed=7, epoch=1))


def test_a_restart_from_the_state_gives_the_rest_of_the_epoch():
    whole = seen(TokenLoader(sources(), "float32", 16, seed=1))
    loader = TokenLoader(sources(), "float32", 16, seed=1)
    first = []
    for batch in loader:
        first.append(batch[:, 0].to(torch.int64).tolist())
        if len(first) == 3:
            break
    state = loader.state_dict()
    assert state["batch"] == 3
    rest = seen(TokenLoader(sources(), "float32", 16, seed=state["seed"], start=state["batch"]))
    assert first + rest == whole


def test_special_rows_are_dropped_and_every_other_row_still_comes_once():
    batches = seen(TokenLoader(sources(), "float32", 16, seed=2, skip_ids=[0]))
    flat = sorted(r for b in batches for r in b)
    assert flat == [r for r in range(100) if r % 7]
    assert len(batches) == 7 and all(len(b) <= 16 for b in batches)


def test_drop_last_and_len():
    loader = TokenLoader(sources(), "float32", 16, drop_last=True)
    assert len(loader) == 6 == len(seen(loader))
    assert len(TokenLoader(sources(), "float32", 16)) == 7


def test_stored_dtypes_decode_to_float32_or_come_as_stored():
    x = torch.randn(40, 8)
    bf = x.to(torch.bfloat16)
    bits = bf.view(torch.int16).numpy().view(np.uint16)
    ids = np.zeros(40, np.int32) + 5
    loader = TokenLoader([RowSource(bits, None, ids)], "bfloat16", 40, shuffle=False)
    assert torch.equal(next(iter(loader)), bf.float())
    stored = next(iter(TokenLoader([RowSource(bits, None, ids)], "bfloat16", 40, shuffle=False, out_dtype="stored")))
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, bf)
    scale = (x.abs().amax(-1) / 448).numpy()
    q = (x / torch.from_numpy(scale)[:, None]).to(torch.float8_e4m3fn)
    f8 = TokenLoader([RowSource(q.view(torch.uint8).numpy(), scale, ids)], "float8", 40, shuffle=False)
    assert torch.allclose(next(iter(f8)), q.float() * torch.from_numpy(scale)[:, None])
    with pytest.raises(StoreError, match="scale"):
        TokenLoader([RowSource(q.view(torch.uint8).numpy(), scale, ids)], "float8", 4, out_dtype="stored")
    half = x.half().numpy()
    out = next(iter(TokenLoader([RowSource(half, None, ids)], "float16", 40, shuffle=False, out_dtype="stored")))
    assert out.dtype == torch.float16


@pytest.mark.parametrize("bad, match", [({"batch_size": 0}, "batch_size"), ({"out_dtype": "int8"}, "float32, stored"),
                                        ({"start": -1}, "start")])
def test_bad_arguments_are_named(bad, match):
    with pytest.raises(StoreError, match=match):
        TokenLoader(sources(), "float32", **{"batch_size": 4, **bad})
