"""Engine-free sharding: ``extract --num-shards N --shard-index I`` parts, resumed alone, merged in input order into
a store equal to a plain local run (arrays, order, error log), and parts that do not belong together refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import layerwise as lw
from layerwise.store import StoreError, link_parts, merge_stores, open_store

from tiny import extract

WORDS = "the quick brown fox jumps over lazy dog EU rejects German call Peter Blackburn Paris naïve cafés".split()


def corpus(path, n=3000, bad_every=700):
    """``n`` jsonl lines, a bad one (no text field) every ``bad_every`` lines."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        if i % bad_every == bad_every - 1:
            rows.append(json.dumps({"txt": "no text field", "id": i}))
        else:
            words = rng.choice(WORDS, size=int(rng.integers(1, 12)))
            rows.append(json.dumps({"text": " ".join(words), "id": i}, ensure_ascii=False))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _same(a, b):
    assert len(a) == len(b) and a.manifest["counts"]["records"] == b.manifest["counts"]["records"]
    assert np.array_equal(a.lines, b.lines)
    assert a.errors == b.errors
    assert a.column("id") == b.column("id")
    assert a.manifest["counts"]["tokens"] == b.manifest["counts"]["tokens"]
    assert a.manifest["counts"]["skipped"] == b.manifest["counts"]["skipped"]
    for i in range(len(a)):  # batching differs between the runs: fp32 noise only
        u, v = a[i], b[i]
        assert u.shape == v.shape and np.abs(u - v).max(initial=0) <= 1e-5, i


@pytest.mark.parametrize("level", ["sentence", "token"])
def test_three_parts_merged_equal_a_plain_run(tiny_extractors, tmp_path, level):
    ex = tiny_extractors["bert"]
    src = corpus(tmp_path / "c.jsonl", n=3000 if level == "sentence" else 600, bad_every=700 if level == "sentence"
                 else 150)
    kw = dict(model=ex, layers="-2:", level=level, keep=("id",), shard_records=256)
    if level == "sentence":
        kw["pool"] = "mean"
    extract(src, tmp_path / "plain", **kw)
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for i in (2, 0, 1):
        extract(src, parts[i], num_shards=3, shard_index=i, **kw)
        assert open_store(parts[i]).manifest["part"] == {"index": i, "of": 3}
    summary = merge_stores(parts[::-1], tmp_path / "merged", records_per_shard=500)
    assert summary.parts == 3 and summary.skipped == len(open_store(tmp_path / "plain").errors) > 0
    merged, plain = open_store(tmp_path / "merged"), open_store(tmp_path / "plain")
    _same(merged, plain)
    assert "part" not in merged.manifest and merged.complete
    if level == "token":
        assert all(np.array_equal(merged.token_ids(i), plain.token_ids(i)) for i in range(len(plain)))
    # no merge: a store that lists the parts reads as the plain run, interleaved by line
    linked_summary = link_parts(parts, tmp_path / "linked")
    assert linked_summary.records == len(plain) and linked_summary.skipped == summary.skipped
    linked = open_store(tmp_path / "linked")
    _same(linked, plain)
    assert linked.manifest["order"] == "lines" and linked.verify().ok
    assert [p["path"] for p in linked.manifest["parts"]] == ["../part0", "../part1", "../part2"]
    def records(chunks):  # chunks (arrays at sentence level, lists of arrays otherwise) as one list of records
        return [r for chunk in chunks for r in chunk]

    for got, want in ((linked[5::37], plain[5::37]), (records(linked.iter_chunks(101)), records(plain.iter_chunks()))):
        assert len(got) == len(want)
        for u, v in zip(got, want):
            np.testing.assert_allclose(u, v, atol=1e-5)
    if level == "sentence":
        np.testing.assert_allclose(linked.to_numpy(), plain.to_numpy(), atol=1e-5)
        assert linked.to_arrow().column("id").to_pylist() == plain.column("id")
    else:
        rows, offsets = linked.ragged()
        want_rows, want_offsets = plain.ragged()
        np.testing.assert_array_equal(offsets, want_offsets)
        np.testing.assert_allclose(rows, want_rows, atol=1e-5)
        assert [a.tolist() for c in linked.iter_token_ids(50) for a in c] == \
            [a.tolist() for c in plain.iter_token_ids(50) for a in c]
    with pytest.raises(StoreError, match="holds a store already"):
        link_parts(parts, tmp_path / "linked")
    shutil.rmtree(parts[1])  # real damage: a part gone is named, never read as complete
    with pytest.raises(lw.StoreCorruptError, match=r"part \.\./part1 is missing"):
        open_store(tmp_path / "linked")


def test_a_part_resumes_alone_and_the_cli_merges(tiny_dirs, tmp_path):
    src = corpus(tmp_path / "c.jsonl", n=400, bad_every=97)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "-m", "layerwise.cli.main"]
    common = ["--model", str(tiny_dirs["bert"]), "--layers", "-1", "--keep", "id", "--shard-records", "16", "--quiet",
              "--device", "cpu"]
    ex = lw.Extractor(str(tiny_dirs["bert"]), device="cpu")
    extract(src, tmp_path / "p1", model=ex, layers=-1, keep=("id",), shard_records=16, num_shards=2, shard_index=1,
            max_records=40)  # interrupted after 40 records: the same command resumes it
    assert open_store(tmp_path / "p1").manifest["status"] == "partial"
    for i in (0, 1):
        done = subprocess.run([*base, "extract", str(src), "-o", str(tmp_path / f"p{i}"), "--num-shards", "2",
                               "--shard-index", str(i), *common], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
    done = subprocess.run([*base, "merge", str(tmp_path / "p0"), str(tmp_path / "p1"), "-o", str(tmp_path / "all")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "merged 2 parts" in done.stderr, done.stderr
    extract(src, tmp_path / "plain", model=ex, layers=-1, keep=("id",), shard_records=16)
    _same(open_store(tmp_path / "all"), open_store(tmp_path / "plain"))
    done = subprocess.run([*base, "merge", "--link", str(tmp_path / "p0"), str(tmp_path / "p1"), "-o",
                           str(tmp_path / "linked")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "linked 2 parts" in done.stderr, done.stderr
    _same(open_store(tmp_path / "linked"), open_store(tmp_path / "plain"))
    checked = subprocess.run([*base, "verify", str(tmp_path / "linked")], capture_output=True, text=True, env=env,
                             timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shown = subprocess.run([*base, "inspect", str(tmp_path / "all")], capture_output=True, text=True, env=env,
                           timeout=300)
    assert shown.returncode == 0 and "records" in shown.stdout


def test_parts_that_do_not_belong_together_are_refused(tiny_extractors, tmp_path):
    ex = tiny_extractors["bert"]
    src = corpus(tmp_path / "c.jsonl", n=60, bad_every=1000)
    other = corpus(tmp_path / "d.jsonl", n=61, bad_every=1000)
    for i in range(3):
        extract(src, tmp_path / f"p{i}", model=ex, layers=-1, num_shards=3, shard_index=i)
    extract(other, tmp_path / "q1", model=ex, layers=-1, num_shards=3, shard_index=1)
    extract(src, tmp_path / "r1", model=ex, layers=-2, num_shards=3, shard_index=1)
    extract(src, tmp_path / "s1", model=ex, layers=-1, num_shards=2, shard_index=1)
    extract(src, tmp_path / "whole", model=ex, layers=-1)
    extract(src, tmp_path / "half", model=ex, layers=-1, num_shards=3, shard_index=2, max_records=5)
    p = [str(tmp_path / f"p{i}") for i in range(3)]
    cases = [
        ([p[0], p[2]], r"parts \[1\] of 3 are missing"),
        ([p[0], p[1], p[1], p[2]], r"part 1 is given twice"),
        ([p[0], str(tmp_path / "q1"), p[2]], r"does not belong with .*input\.sha256"),
        ([p[0], str(tmp_path / "r1"), p[2]], r"does not belong with .*spec\.layers"),
        ([p[0], str(tmp_path / "s1")], r"is part 1 of 2, the others of 3"),
        ([p[0], p[1], str(tmp_path / "whole")], r"is a whole store, not a part of a sharded run"),
        ([p[0], p[1], str(tmp_path / "half")], r"part 2 .* is partial: rerun its extract command"),
        ([str(tmp_path / "nothing")], r"is not a layerwise store"),
    ]
    for parts, message in cases:
        with pytest.raises(StoreError, match=message):
            merge_stores(parts, tmp_path / "out")
    with pytest.raises(StoreError, match=r"cannot be one of its parts"):
        merge_stores(p, p[0])
    with pytest.raises(lw.ExtractError, match=r"shard_index=3 must be an int in 0\.\.2"):
        extract(src, tmp_path / "bad", model=ex, num_shards=3, shard_index=3)
    with pytest.raises(lw.ExtractError, match=r"num_shards must be a positive int, got 0"):
        extract(src, tmp_path / "bad", model=ex, num_shards=0)
    with pytest.raises(lw.StoreError, match=r"made with other options: part\.index"):
        extract(src, tmp_path / "p0", model=ex, layers=-1, num_shards=3, shard_index=1)
