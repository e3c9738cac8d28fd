"""Crash safety: SIGKILL an extraction at several points of a multi-shard run, rerun, compare with a clean run.

These run ``auto``'s default path (no ``$LAYERWISE_AUTO_RUNTIME``): the store names the runtime that computed it,
the resume continues on it, and the result equals, bit for bit, a clean run with ``backend=<that runtime>``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import layerwise as lw
from layerwise.store import StoreWarning

from tiny import extract, wait_until

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")

# Killer script: runs one extraction in a fresh process and SIGKILLs itself at the named point.
KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import layerwise as lw
    import layerwise.store.writer as ex_mod
    import layerwise.store.layout as shards
    import layerwise.model.backends.base as base_mod

    point, k, model, corpus, store = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    calls = {"n": 0}

    def counting(fn, on):
        def wrapped(*a, **kw):
            calls["n"] += 1
            if calls["n"] == k and on == "before":
                die()
            out = fn(*a, **kw)
            if calls["n"] == k and on == "after":
                die()
            return out
        return wrapped

    if point == "mid_encode":        # inside the forward passes of shard k's batch
        base_mod.Plan.start = counting(base_mod.Plan.start, "before")
    elif point == "shard_tmp":       # shard k written to its temporary name, not yet renamed
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith(".safetensors"):
                calls["n"] += 1
                if calls["n"] == k:
                    die()
            return real_replace(src, dst)
        shards.os.replace = replace
    elif point == "before_manifest":  # shard k renamed, manifest not yet updated
        ex_mod.write_json = counting(ex_mod.write_json, "before")
    on_shard = (lambda n: die() if n == k else None) if point == "after_shard" else None
    lw.extract(corpus, store, lw.EncodeSpec(layers=[1, 2], combine="concat", level=sys.argv[6]),
               model=lw.Extractor(model, device="cpu"), on_shard=on_shard,
               options=lw.ExtractOptions(shard_records=4, batch_tokens=64, progress=False))
    """
)


def _corpus(path) -> list[str]:
    rng = np.random.default_rng(0)
    words = "eu rejects german call to boycott british lamb peter blackburn went brussels monday".split()
    lines: list[bytes] = []
    texts = []
    for i in range(41):
        if i in (5, 17):
            lines.append(b"   ")  # empty after stripping: skipped and logged
        elif i == 23:
            lines.append(b"caf\xe9 latin-1")  # invalid UTF-8
        else:
            t = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
            lines.append(t.encode())
            texts.append(t)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return texts


def _snapshot(store_path, level):
    st = lw.open_store(store_path)
    feats = st.to_numpy() if level == "sentence" else st.ragged()
    return st, feats


def _same(a, b, level):
    """Two complete stores hold the same records, bit for bit, computed by one runtime (named by each, and by each
    shard)."""
    (sa, fa), (sb, fb) = a, b
    assert len(sa) == len(sb) and sa.complete and sb.complete
    np.testing.assert_array_equal(sa.lines, sb.lines)
    assert sa.errors == sb.errors
    assert sa.manifest["counts"]["records"] == sb.manifest["counts"]["records"]
    assert sa.manifest["counts"]["skipped"] == sb.manifest["counts"]["skipped"]
    runtime = sa.manifest["runtime"]["name"]
    assert sb.manifest["runtime"]["name"] == runtime
    assert {e["runtime"] for e in sa.manifest["shards"]} == {e["runtime"] for e in sb.manifest["shards"]} == {runtime}
    # each shard encodes its own records (a resume starts at a shard's first record), on one runtime: the same bytes
    if level == "sentence":
        np.testing.assert_array_equal(fa, fb)
    else:
        np.testing.assert_array_equal(fa[1], fb[1])
        np.testing.assert_array_equal(fa[0], fb[0])


def _clean(root, corpus, model, level, runtime):
    """The uninterrupted run with ``backend=runtime`` (once per level and runtime)."""
    clean = root / f"clean-{level}-{runtime}"
    if not clean.exists():
        extract(corpus, clean, model=lw.Extractor(model, backend=runtime), layers=[1, 2], combine="concat",
                level=level, shard_records=4, batch_tokens=64, progress=False)
    return clean


@pytest.fixture
def default_path(monkeypatch):
    """``auto`` as a user meets it: no runtime named."""
    monkeypatch.delenv("LAYERWISE_AUTO_RUNTIME", raising=False)
    return {k: v for k, v in os.environ.items() if k != "LAYERWISE_AUTO_RUNTIME"} | {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("kill")
    corpus = root / "corpus.txt"
    texts = _corpus(corpus)
    script = root / "killer.py"
    script.write_text(KILLER)
    return root, corpus, texts, script, str(tiny_dirs["bert"])


@pytest.mark.parametrize(
    "level,point,k",
    [
        ("sentence", "after_shard", 1),
        ("sentence", "after_shard", 5),
        ("sentence", "mid_encode", 3),
        ("sentence", "shard_tmp", 2),
        ("token", "before_manifest", 4),  # manifest writes: 1 = creation, 2..: after shards 1, 2, ...
        ("word", "shard_tmp", 7),
    ],
)
def test_sigkill_then_rerun_equals_clean_run(setup, default_path, level, point, k):
    root, corpus, texts, script, model = setup
    store = root / f"killed-{level}-{point}-{k}"
    env = default_path
    proc = subprocess.run(
        [sys.executable, str(script), point, str(k), model, str(corpus), str(store), level],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        before = lw.open_store(store)  # the manifest is the truth: a shard renamed after its last update is unlisted
    assert not before.complete and len(before) < len(texts)  # the kill left an unfinished store
    orphan = [w for w in seen if issubclass(w.category, StoreWarning)]
    assert bool(orphan) == (point == "before_manifest"), [str(w.message) for w in seen]
    done_before = len(before) + (4 if orphan else 0)  # the resume takes in the finished, unlisted shard (4 records)
    summary = extract(
        corpus,
        store,
        model=lw.Extractor(model),
        layers=[1, 2],
        combine="concat",
        level=level,
        shard_records=4,
        batch_tokens=64,
        progress=False,
    )
    assert summary.status == "complete" and summary.resumed_from == done_before
    assert summary.records == len(texts) - done_before  # finished shards were not redone
    runtime = lw.open_store(store).manifest["runtime"]["name"]
    _same(_snapshot(store, level), _snapshot(_clean(root, corpus, model, level, runtime), level), level)
    assert not [p for p in store.iterdir() if ".tmp-" in p.name]  # no half-written file survives the resume
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every shard file is listed again
        assert lw.open_store(store, verify=True).verify().ok
    assert [e["line"] for e in lw.open_store(store).errors] == [6, 18, 24]


def _start_and_kill(cmd: list[str], store, env) -> bool:
    """Start the command, SIGKILL it once 3 shards exist; False if it finished first."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: proc.poll() is not None or len(list(store.glob("shard-*.safetensors"))) >= 3, 120,
               "3 shards written or the run ended", interval=0.005)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return True


def test_external_sigkill_of_the_command(setup, tiny_extractors, default_path):
    """A real `layerwise extract` process killed from outside once its first shards exist, then rerun.

    The kill must land mid-run: if a corpus is done before 3 shards are seen, a 10x larger one is tried (never a skip).
    """
    root, corpus, texts, _, model = setup
    env = default_path
    for repeat in (40, 400, 4000):
        big = root / f"big-{repeat}.txt"
        big.write_text("\n".join(texts * repeat) + "\n")
        store = root / f"external-{repeat}"
        cmd = [sys.executable, "-m", "layerwise.cli.main", "extract", str(big), "-o", str(store), "--model", model,
               "--device", "cpu", "--layers", "1,2", "--shard-records", "8", "--batch-tokens", "64", "--quiet"]
        if _start_and_kill(cmd, store, env):
            break
    else:
        pytest.fail("even 4000 copies of the corpus were extracted before 3 shards could be seen")
    assert not lw.open_store(store).complete
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    st = lw.open_store(store)
    assert st.complete and len(st) == len(texts) * repeat
    runtime = st.manifest["runtime"]["name"]
    assert {e["runtime"] for e in st.manifest["shards"]} == {runtime}
    want = lw.Extractor(model, backend=runtime).encode(texts * repeat, layers=[1, 2], combine="concat", pool="mean")
    np.testing.assert_allclose(st.to_numpy(), want, atol=1e-5, rtol=0)
    assert json.loads((store / "manifest.json").read_text())["counts"]["records"] == len(want)


FIRST_MANIFEST = textwrap.dedent(
    """
    import os, signal, sys
    import layerwise as lw
    real = os.replace

    def replace(src, dst):  # killed with the first manifest written to its temporary name, not yet renamed
        if str(dst).endswith("manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)

    os.replace = replace
    lw.extract(sys.argv[2], sys.argv[3], lw.EncodeSpec(layers=[1, 2], combine="concat"),
               model=lw.Extractor(sys.argv[1], device="cpu"),
               options=lw.ExtractOptions(shard_records=4, progress=False))
    """
)


def test_a_kill_during_the_first_manifest_write_does_not_wedge_the_store(setup, default_path, tmp_path):
    """Killed while its first manifest is a temporary file: the directory holds only layerwise's own leftovers and a
    dead writer's lock. The same command takes it over (one line says so), completes, and the store verifies."""
    root, corpus, texts, _, model = setup
    script, store = tmp_path / "first.py", tmp_path / "store"
    script.write_text(FIRST_MANIFEST)
    proc = subprocess.run([sys.executable, str(script), model, str(corpus), str(store)], env=default_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = sorted(p.name for p in store.iterdir())
    assert any(n.startswith(".manifest.json.tmp-") for n in left) and "manifest.json" not in left, left
    summary = lw.extract(corpus, store, lw.EncodeSpec(layers=[1, 2], combine="concat"), model=lw.Extractor(model),
                         options=lw.ExtractOptions(shard_records=4, progress=False))
    assert summary.status == "complete" and summary.total_records == len(texts)
    assert any("killed before its first manifest was written" in r for r in summary.repairs), summary.repairs
    assert lw.open_store(store, verify=True).verify().ok


def test_ctrl_c_says_what_is_safe_and_the_rerun_resumes(setup, default_path, tmp_path):
    """SIGINT (Ctrl-C) on `layerwise extract`: exit 130 with one line saying how many records are safe and that the
    same command resumes; it does."""
    root, corpus, texts, _, model = setup
    big = tmp_path / "big.txt"
    big.write_text("\n".join(texts * 400) + "\n")
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "layerwise.cli.main", "extract", str(big), "-o", str(store), "--model", model,
           "--device", "cpu", "--layers", "1,2", "--shard-records", "8", "--batch-tokens", "64"]
    proc = subprocess.Popen(cmd, env=default_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: proc.poll() is not None or len(list(store.glob("shard-*.safetensors"))) >= 3, 120,
               "3 shards written or the run ended", interval=0.005)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    line = [ln for ln in err.splitlines() if ln.startswith("interrupted:")]
    assert line and "finished shards of" in line[0] and "rerun the same command to resume" in line[0], err[-2000:]
    safe = int(line[0].split()[1].replace(",", ""))
    assert safe == len(lw.open_store(store))
    rerun = subprocess.run(cmd, env=default_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert lw.open_store(store).complete and len(lw.open_store(store)) == len(texts) * 400
