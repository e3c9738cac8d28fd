"""Reading as documented (issue 40, item 6), measured in a fresh process on a ~100 MB store (peak RSS, VmHWM).

``to_numpy()`` of a one-shard store is a memory map (its peak RSS grows by almost nothing; a copy grows by the
store's size, measured the same way so the bound can fail), a store of several shards copies and ``mmap=True``
refuses it saying what to do, and ``to_dataset()`` streams: its peak stays far below the store's size over the
imports (it was 733 MB for a 118 MB store when the table was built in memory)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import layerwise as lw
from layerwise.store import StoreWriter
from layerwise.store.layout import shard_rows

from tiny import extract

WIDTH = 384
MB = 1 << 20

# The peak is this process's own high-water mark (VmHWM, kB): ru_maxrss of a process started from a large one (pytest
# with torch loaded) keeps its parent's mark across exec, so it cannot see growth below it.
CHILD = r"""
import json, sys
import numpy as np
import layerwise as lw

def hwm():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))

what, path = sys.argv[1], sys.argv[2]
if what == "dataset":
    import datasets  # noqa: F401 - imported before the baseline: its import is not the store's memory
store = lw.open_store(path)
base = hwm()
if what == "map":
    x = store.to_numpy()
    facts = {"memmap": isinstance(x, np.memmap), "writeable": bool(x.flags.writeable), "shape": list(x.shape),
             "row": float(x[len(x) // 2, 7])}
elif what == "copy":
    x = store.to_numpy(mmap=False)
    facts = {"memmap": isinstance(x, np.memmap), "shape": list(x.shape), "row": float(x[len(x) // 2, 7])}
else:
    ds = store.to_dataset()
    facts = {"rows": len(ds), "row": float(ds.with_format("numpy")[len(ds) // 2]["features"][7])}
peak = hwm()
print(json.dumps({"grew_mb": (peak - base) / 1024, **facts}))
"""


def _synthetic(store, header, records, shards):
    """A sentence-level store of ``records`` random [WIDTH] float32 rows in ``shards`` shards, header of a real one."""
    rng = np.random.default_rng(0)
    with StoreWriter(store, header) as writer:
        writer.open()
        per = -(-records // shards)
        for lo in range(0, records, per):
            hi = min(records, lo + per)
            feats = rng.standard_normal((hi - lo, WIDTH), dtype=np.float32)
            tensors, meta = shard_rows("sentence", range(lo + 1, hi + 1), feats, WIDTH, np.float32)
            writer.write_shard(tensors, meta, tokens=hi - lo)
        writer.write_manifest("complete", 0)
    return lw.open_store(store)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_extractors):
    root = tmp_path_factory.mktemp("reading")
    (root / "c.txt").write_text("one text\nanother\n")
    extract(root / "c.txt", root / "real", model=tiny_extractors["bert"])
    header = {k: v for k, v in lw.open_store(root / "real").manifest.items()
              if k in ("spec", "model", "model_options", "tokenizer", "input")}
    header["feature_shape"] = [WIDTH]
    records = 100 * MB // (WIDTH * 4 + 8)
    one = _synthetic(root / "one", header, records, 1)
    four = _synthetic(root / "four", header, records, 4)
    return one, four


def _child(what, store):
    done = subprocess.run([sys.executable, "-c", CHILD, what, str(store.path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_to_numpy_maps_a_one_shard_store_and_a_copy_costs_its_size(stores):
    one, _ = stores
    assert one.nbytes > 95 * MB
    mapped, copied = _child("map", one), _child("copy", one)
    print("to_numpy peak RSS growth (MB): map", round(mapped["grew_mb"], 1), "copy", round(copied["grew_mb"], 1))
    assert mapped["memmap"] and not mapped["writeable"] and not copied["memmap"]
    assert mapped["shape"] == copied["shape"] == [len(one), WIDTH] and mapped["row"] == copied["row"]
    assert mapped["grew_mb"] < 10  # a map: pages come in only as rows are read (it was +199 MB, a copy)
    assert copied["grew_mb"] > 90  # the same measure sees a copy


def test_several_shards_copy_and_mmap_true_says_why_not(stores):
    one, four = stores
    assert four.num_shards == 4
    x = four.to_numpy()
    assert not isinstance(x, np.memmap) and x.flags.writeable
    np.testing.assert_array_equal(x, one.to_numpy())
    with pytest.raises(lw.StoreError, match=r"in 4 shard files.*layerwise export .* --format npy"):
        four.to_numpy(mmap=True)
    with pytest.raises(lw.StoreError, match="takes None, True or False, got 'yes'"):
        four.to_numpy(mmap="yes")


def test_to_dataset_streams_in_bounded_memory(stores):
    """Shards of about 25 MB (the writer's default is about 32 MB): the pass holds one shard's pages and a chunk."""
    one, four = stores
    got = _child("dataset", four)
    print("to_dataset peak RSS growth (MB):", round(got["grew_mb"], 1), "for a", four.nbytes // MB, "MB store")
    assert got["rows"] == len(four) and got["row"] == float(four[len(four) // 2][7])
    # the table was whole in memory: +504 MB for this store (733 MB for a 118 MB one in the issue); now +31 MB
    assert got["grew_mb"] < 0.6 * four.nbytes / MB
