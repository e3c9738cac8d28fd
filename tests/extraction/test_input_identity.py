"""The input a store records is the input that was read: a file rewritten during a run (by another process, same
inode) stops the run with what changed, keeping the shards read before the change for a resume on the right input;
a rewrite that keeps size and modification time is caught by the hash of the bytes read; an input changed between
runs is called a changed input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.corpus.readers import read_records
from layerwise.corpus.watch import ReadDigest
from layerwise.provenance import input_sha256
from layerwise.store import verify_store

from tiny import extract

# Extracts CORPUS into STORE; after its first shard waits until its stdin closes; an ExtractError is printed, exit 3.
HOLDER = textwrap.dedent(
    """
    import sys
    import layerwise as lw

    model, corpus, store, per_shard = sys.argv[1:5]

    def hold(n):
        if n == 1:
            print("holding", flush=True)
            sys.stdin.read()  # until the test closes it

    try:
        lw.extract(corpus, store, lw.EncodeSpec(layers=[1, 2]), model=lw.Extractor(model, device="cpu"),
                   reading=lw.ReadOptions(text_field="sentence"), on_shard=hold,
                   options=lw.ExtractOptions(shard_records=int(per_shard), progress=False))
    except lw.ExtractError as exc:
        print(exc, file=sys.stderr)
        sys.exit(3)
    """
)
WORDS = "eu rejects german call to boycott british lamb peter blackburn went brussels monday".split()


def rows(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(n)]


def tsv(path: Path, texts: list[str]) -> bytes:
    data = ("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(texts))).encode()
    path.write_bytes(data)
    return data


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("input")
    script = root / "holder.py"
    script.write_text(HOLDER)
    return root, script, str(tiny_dirs["bert"])


def run_holder(setup, corpus: Path, store: Path, per_shard: int, change) -> subprocess.CompletedProcess:
    """Run the holder; once it has written its first shard, ``change()`` the corpus; then let it go on."""
    root, script, model = setup
    proc = subprocess.Popen([sys.executable, str(script), model, str(corpus), str(store), str(per_shard)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding", proc.stderr.read()  # type: ignore[union-attr]
    change()
    out, err = proc.communicate(timeout=300)  # closes its stdin first: it goes on
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def clean_store(tmp_path: Path, ex, corpus: Path, per_shard: int) -> Path:
    store = tmp_path / "clean"
    extract(corpus, store, model=ex, layers=[1, 2], text_field="sentence", shard_records=per_shard, progress=False)
    return store


def same(a: Path, b: Path) -> None:
    sa, sb = lw.open_store(a), lw.open_store(b)
    assert sa.complete and sb.complete and len(sa) == len(sb)
    np.testing.assert_array_equal(sa.lines, sb.lines)
    np.testing.assert_allclose(sa.to_numpy(), sb.to_numpy(), atol=1e-5, rtol=0)


def test_an_input_rewritten_during_the_run_stops_it_and_keeps_the_shards_read_before(setup, tmp_path, tiny_extractors):
    """The repro: `cat other.tsv > chg.tsv` while the run goes (same inode, later rows changed)."""
    corpus, store = tmp_path / "chg.tsv", tmp_path / "store"
    original = tsv(corpus, rows(40, 0))
    inode = os.stat(corpus).st_ino
    other = ("sentence\tlabel\n" + "".join(f"{t}\t0\n" for t in rows(4, 0) + rows(36, 1))).encode()

    def rewrite():
        with open(corpus, "wb") as fh:  # truncates and writes the same file, as the shell's `>` does
            fh.write(other)

    done = run_holder(setup, corpus, store, 4, rewrite)
    assert os.stat(corpus).st_ino == inode
    said = " ".join(done.stderr.split())
    assert done.returncode == 3, done.stderr
    assert f"the input {corpus} changed during the run: {corpus}: " in said, said
    assert "modified " in said and "The store" in said and "keeps the 4 records of its finished shards" in said
    assert f"sha256 {hashlib.sha256(original).hexdigest()[:16]}" in said, said
    assert "Put that input back and rerun the same command to resume" in said and "--overwrite" in said
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["status"] == "running" and [e["records"] for e in manifest["shards"]] == [4]
    assert manifest["input"]["sha256"] == hashlib.sha256(original).hexdigest()
    assert sorted(p.name for p in store.glob("shard-*")) == ["shard-000000.safetensors"]
    assert verify_store(store).ok

    # a rerun on the changed input: "the input changed", not "made with other options"
    res = CliRunner().invoke(app, ["extract", str(corpus), "-o", str(store), "--layers", "1,2", "--text-column",
                                   "sentence", "--shard-records", "4", "--model", setup[2], "--device", "cpu"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"the input {corpus} changed since the store" in said, said
    assert "made with other options" not in said and "(4 records, running)" in said
    assert f"{hashlib.sha256(original).hexdigest()[:16]}... when the store was made" in said, said

    # the right input back: the resume finishes the store, equal to an uninterrupted run
    corpus.write_bytes(original)
    summary = extract(corpus, store, model=tiny_extractors["bert"], layers=[1, 2], text_field="sentence",
                      shard_records=4, progress=False)
    assert summary.status == "complete" and summary.resumed_from == 4 and summary.records == 36
    same(store, clean_store(tmp_path, tiny_extractors["bert"], corpus, 4))
    assert verify_store(store).ok


def test_a_rewrite_that_keeps_size_and_mtime_is_caught_by_the_hash_of_what_was_read(setup, tmp_path,
                                                                                    tiny_extractors):
    """Rows far past the reader's position rewritten in place with the same length, the modification time put
    back: only the sha256 of the bytes read tells. This run's shards are dropped."""
    corpus, store = tmp_path / "big.tsv", tmp_path / "store"
    texts = rows(6000, 2)
    original = tsv(corpus, texts)
    st = os.stat(corpus)
    at = original.index(f"\n{texts[5000]}\t".encode()) + 1  # ~190 KB in; the reader holds 64 KB by shard 1
    tail = original[at:]
    swapped = bytes(b if b in b"\t\n" else (ord("x") if b != ord("x") else ord("y")) for b in tail)

    def rewrite_in_place():
        with open(corpus, "r+b") as fh:
            fh.seek(at)
            fh.write(swapped)
        os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))

    done = run_holder(setup, corpus, store, 500, rewrite_in_place)
    assert os.stat(corpus).st_size == st.st_size and os.stat(corpus).st_mtime_ns == st.st_mtime_ns
    said = " ".join(done.stderr.split())
    assert done.returncode == 3, done.stderr
    want = hashlib.sha256(original).hexdigest()
    got = hashlib.sha256(original[:at] + swapped).hexdigest()
    assert f"the bytes read hash to {got[:16]}..., not to the sha256 {want[:16]}... it had when the run started" \
           in said, said
    assert "The 6,000 records this run computed are dropped" in said and "keeps the 0 records" in said, said
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["status"] == "running" and manifest["shards"] == [] and not list(store.glob("shard-*"))
    corpus.write_bytes(original)
    summary = extract(corpus, store, model=tiny_extractors["bert"], layers=[1, 2], text_field="sentence",
                      shard_records=500, progress=False)
    assert summary.status == "complete" and summary.records == 6000
    same(store, clean_store(tmp_path, tiny_extractors["bert"], corpus, 500))


def test_a_changed_input_between_runs_is_called_a_changed_input(setup, tmp_path, tiny_extractors):
    corpus, store = tmp_path / "in.tsv", tmp_path / "store"
    tsv(corpus, rows(10, 3))
    ex = tiny_extractors["bert"]
    extract(corpus, store, model=ex, layers=[1, 2], text_field="sentence", progress=False)
    with open(corpus, "a") as fh:
        fh.write("one more row\t1\n")
    with pytest.raises(lw.StoreError) as info:
        extract(corpus, store, model=ex, layers=[1, 2], text_field="sentence", progress=False)
    said = str(info.value)
    assert said.startswith(f"the input {corpus} changed since the store") and "(10 records, complete)" in said, said
    assert "made with other options" not in said and "pass --overwrite to replace the store" in said
    with pytest.raises(lw.StoreError) as info:  # another option too: both are said
        extract(corpus, store, model=ex, layers=[2], text_field="sentence", progress=False)
    said = str(info.value)
    assert "made with other options: " in said and "spec.layers (store: [1, 2], now: [2]); and the input" in said, said
    assert "changed: its sha256 is" in said


def test_what_a_reader_reads_hashes_as_the_recorded_input(tmp_path):
    """ReadDigest over a single file and over a directory of files gives input_sha256's value once read through."""
    one = tmp_path / "one.txt"
    one.write_text("a\nb\n\nc\n")
    folder = tmp_path / "dir"
    folder.mkdir()
    for i in range(3):
        (folder / f"p{i}.jsonl").write_text("".join(json.dumps({"text": f"t{i}{j}"}) + "\n" for j in range(5)))
    for path in (one, folder):
        digest = ReadDigest()
        items = list(read_records(path, digest=digest))
        assert items and digest.complete and digest.hexdigest() == input_sha256(path)
    digest = ReadDigest()
    reader = read_records(one, digest=digest)
    next(reader)
    reader.close()
    assert not digest.complete  # a reader stopped early did not read the whole input
    shutil.rmtree(folder)
