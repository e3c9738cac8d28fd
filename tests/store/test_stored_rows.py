"""``FeatureStore.rows()``: a store's feature rows read on demand (``layerwise.store.rows.StoredRows``), indexed like
the array ``ragged()`` / ``to_numpy()`` would give, across shards, with the shards' mappings let go after each read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import layerwise as lw

from tiny import extract

TEXTS = [f"sentence number {i} has {'a few more words ' * (i % 4)}in it" for i in range(23)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_extractors):
    root = tmp_path_factory.mktemp("rows")
    (root / "c.txt").write_text("\n".join(TEXTS) + "\n")
    kw = dict(model=tiny_extractors["bert"], layers="all", combine="stack", output_dtype="float16",
              shard_records=5)
    extract(root / "c.txt", root / "words", level="word", **kw)
    extract(root / "c.txt", root / "sent", level="sentence", pool="mean", **kw)
    return lw.open_store(root / "words"), lw.open_store(root / "sent")


def test_rows_index_as_the_whole_array_does_across_shards(stores):
    words, sent = stores
    assert words.num_shards == sent.num_shards == 5
    for store, whole in ((words, words.ragged()[0]), (sent, sent.to_numpy())):
        rows = store.rows()
        assert rows.shape == whole.shape and len(rows) == len(whole) and rows.dtype == whole.dtype
        n = len(whole)
        for key in (slice(None), slice(3, n - 2), slice(0, 0), slice(n - 7, None), slice(1, n, 3)):
            got = rows[key]
            assert isinstance(got, torch.Tensor)
            np.testing.assert_array_equal(got.numpy(), whole[key])
        picked = np.array([n - 1, 0, 7, 7, 2, -1])
        np.testing.assert_array_equal(rows[picked].numpy(), whole[picked])
        np.testing.assert_array_equal(rows[torch.from_numpy(picked[:3])].numpy(), whole[picked[:3]])
        np.testing.assert_array_equal(rows[2:9, 1].numpy(), whole[2:9, 1])
        np.testing.assert_array_equal(rows[2:9][:, 0:2].numpy(), whole[2:9, 0:2])
        with pytest.raises(IndexError, match=f"the store holds {n} rows"):
            rows[np.array([n])]
    off = words.record_offsets()
    np.testing.assert_array_equal(off, words.ragged()[1])
    np.testing.assert_array_equal(words.rows()[int(off[4]) : int(off[5])].numpy(), words[4])


def test_a_read_lets_the_shards_mappings_go(stores):
    words, _ = stores
    rows = words.rows()
    rows[0 : len(rows)]
    assert all("features" not in shard._cache for shard in rows._shards)


def test_record_offsets_are_for_word_and_token_stores(stores):
    _, sent = stores
    with pytest.raises(lw.StoreError, match="token- and word-level stores"):
        sent.record_offsets()
