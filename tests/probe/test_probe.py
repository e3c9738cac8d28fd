"""Layer-wise probing (``layerwise.probe``) on the tiny random BERT: outputs, metrics by hand, restarts, caching,
features, CoNLL-2003 document context, linear CKA, the CRF against brute force, bad input by message, the output
directory (a probe replaces only its own files, and only with ``overwrite``) and dev/test labels train lacks.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import itertools
import json
import re
from html import unescape

import numpy as np
import pytest
import torch
from PIL import Image

import layerwise.probe.data as probe_data
from layerwise.corpus.readers import Record, read_records, with_document_context
from layerwise.errors import LayerwiseError
from layerwise.explore.probe_dir import read_probe_dir
from layerwise.probe import CRF, ProbeConfig, cka_matrix, detect_scheme, linear_cka, run, tagging_scores
from layerwise.probe.data import ProbeSplit
from layerwise.probe.metrics import sentence_scores
from layerwise.probe.models import ProbeSpec
from layerwise.probe.report import OUTPUT_FILES, unseen_notes
from layerwise.probe.train import ProbeOptions, fit_probe
from layerwise.store import open_store

from tiny import extract

QUIET = dict(log=lambda line: None, progress=False)  # with ProbeConfig(epochs=1, ...): see cfg()


def cfg(**kw) -> ProbeConfig:
    """A one-epoch probing config."""
    return ProbeConfig(**{"epochs": 1, **kw})


# CoNLL-2003 documents (IOB1: I- starts an entity, B- only between adjacent entities of one type).
DOCS = [
    [
        [
            ("EU", "NNP", "B-NP", "I-ORG"),
            ("rejects", "VBZ", "B-VP", "O"),
            ("German", "JJ", "B-NP", "I-MISC"),
            ("call", "NN", "I-NP", "O"),
            ("to", "TO", "B-VP", "O"),
            ("boycott", "VB", "I-VP", "O"),
            ("British", "JJ", "B-NP", "I-MISC"),
            ("lamb", "NN", "I-NP", "O"),
            (".", ".", "O", "O"),
        ],
        [("Peter", "NNP", "B-NP", "I-PER"), ("Blackburn", "NNP", "I-NP", "I-PER")],
        [
            ("Paris", "NNP", "B-NP", "I-LOC"),
            ("Brussels", "NNP", "I-NP", "B-LOC"),
            ("love", "VB", "B-VP", "O"),
            ("the", "DT", "B-NP", "O"),
            ("fox", "NN", "I-NP", "O"),
        ],
    ],
    [
        [
            ("Peter", "NNP", "B-NP", "I-PER"),
            ("went", "VBD", "B-VP", "O"),
            ("to", "TO", "B-PP", "O"),
            ("Brussels", "NNP", "B-NP", "I-LOC"),
            ("on", "IN", "B-PP", "O"),
            ("Monday", "NNP", "B-NP", "O"),
            (".", ".", "O", "O"),
        ],
        [(w, "X", "O", "O") for w in "The quick brown fox jumps over the lazy dog !".split()],
    ],
]
CONLLU = """# sent_id = 1
# text = Peter went to the store.
1	Peter	Peter	PROPN	NNP	_	2	nsubj	_	_
2	went	go	VERB	VBD	_	0	root	_	_
3-4	tothe	_	_	_	_	_	_	_	_
3	to	to	ADP	IN	_	5	case	_	_
4	the	the	DET	DT	_	5	det	_	_
5	store	store	NOUN	NN	_	2	obl	_	_
5.1	bought	buy	VERB	VBD	_	_	_	2:conj	_
6	.	.	PUNCT	.	_	2	punct	_	_

# sent_id = 2
1	The	the	DET	DT	_	3	det	_	_
2	quick	quick	ADJ	JJ	_	3	amod	_	_
3	fox	fox	NOUN	NN	_	4	nsubj	_	_
4	jumps	jump	VERB	VBZ	_	0	root	_	_
5	!	!	PUNCT	.	_	4	punct	_	_
"""
UD_WORDS = [["Peter", "went", "to", "the", "store", "."], ["The", "quick", "fox", "jumps", "!"]]
UD_TAGS = ["PROPN", "VERB", "ADP", "DET", "NOUN", "PUNCT", "DET", "ADJ", "NOUN", "VERB", "PUNCT"]
TSV = "sentence\tlabel\n" + "".join(
    f"{t}\t{y}\n"
    for t, y in [
        ("I love Paris", "pos"),
        ("a gorgeous film", "pos"),
        ("the quick brown fox", "pos"),
        ("Paris in the springtime", "pos"),
        ("EU rejects German call", "neg"),
        ("boycott British lamb", "neg"),
        ("the lazy dog", "neg"),
        ("rejects the call", "neg"),
    ]
)


def iob2(tags):
    return [
        f"B-{t[2:]}" if t.startswith("I-") and (i == 0 or tags[i - 1][2:] != t[2:]) else t for i, t in enumerate(tags)
    ]


def conll_text(docs, convert=lambda tags: tags):
    out = []
    for doc in docs:
        out.append("-DOCSTART- -X- -X- O\n\n")
        for sent in doc:
            tags = convert([r[3] for r in sent])
            out.append("".join(f"{w} {p} {c} {t}\n" for (w, p, c, _), t in zip(sent, tags)) + "\n")
    return "".join(out)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_dirs, tiny_extractors):
    root = tmp_path_factory.mktemp("probe")
    files = {"iob1": root / "iob1.conll", "iob2": root / "iob2.conll", "ud": root / "ud.conllu", "tsv": root / "s.tsv"}
    files["iob1"].write_text(conll_text(DOCS))
    files["iob2"].write_text(conll_text(DOCS, iob2))
    files["ud"].write_text(CONLLU)
    files["tsv"].write_text(TSV)
    return dict(root=root, ex=tiny_extractors["bert"], model_dir=tiny_dirs["bert"], **files)


@pytest.fixture(scope="module")
def runs(env):
    """The three kinds of run: CoNLL-2003 NER (3 restarts), CoNLL-U UPOS and a sentence task."""
    r, ex = env["root"], env["ex"]
    return {
        "ner": run(
            env["iob1"],
            env["iob1"],
            config=cfg(task="tagging", column="ner", restarts=3, lr=0.05),
            model=ex,
            output=r / "ner",
            **QUIET,
        ),
        "upos": run(
            env["ud"], env["ud"], env["ud"], cfg(task="tagging", column="upos"), model=ex, output=r / "upos", **QUIET
        ),
        "sentence": run(env["tsv"], env["tsv"], config=cfg(task="sentence"), model=ex, output=r / "sent", **QUIET),
    }


EXPECTED = {  # (name, layers, combine) for a 2-layer model; one layer combines nothing: "-" (results.json too)
    ("embeddings", (0,), "-"),
    ("layer 1", (1,), "-"),
    ("layer 2", (2,), "-"),
    ("second-to-last", (1,), "-"),
    ("last", (2,), "-"),
    ("sum last 2", (1, 2), "sum"),
    ("weighted sum last 2", (1, 2), "scalar_mix"),
    ("concat last 2", (1, 2), "concat"),
    ("weighted sum all 2 layers", (1, 2), "scalar_mix"),
    ("scalar mix all (with embeddings)", (0, 1, 2), "scalar_mix"),
}


@pytest.mark.parametrize("kind", ["ner", "upos", "sentence"])
def test_run_writes_every_output(runs, env, kind):
    res = runs[kind]
    out = {"ner": "ner", "upos": "upos", "sentence": "sent"}[kind]
    out = env["root"] / out
    names = ("results.md", "results.csv", "results.json", "layers.png", "similarity.png", "report.html")
    assert {p.name for p in res.files.values()} == set(names)
    for name in names:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in ("layers.png", "similarity.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(out / png) as im:
            im.verify()
    data = json.loads((out / "results.json").read_text())
    assert {(r["name"], tuple(r["layers"]), r["combine"]) for r in data["rows"]} == EXPECTED
    assert len(data["rows"]) == len(EXPECTED)
    assert [r["dev_mean"] for r in data["rows"]] == [r["dev_mean"] for r in res.rows]  # the file says what ran
    cka = np.array(data["cka"])
    assert cka.shape == (3, 3) and np.allclose(cka, cka.T) and np.allclose(np.diag(cka), 1)
    with open(out / "results.csv", newline="") as fh:
        assert [r["probe"] for r in csv.DictReader(fh)] == [r["name"] for r in data["rows"]]
    md = (out / "results.md").read_text()
    assert all(f"| {r['name']} |" in md for r in data["rows"]) and "layerwise" in md
    html = (out / "report.html").read_text()
    imgs = re.findall(r"<img src='data:image/png;base64,([A-Za-z0-9+/=]+)'>", html)
    assert [base64.b64decode(i) for i in imgs] == [
        (out / "layers.png").read_bytes(),
        (out / "similarity.png").read_bytes(),
    ]
    assert "<table>" in html and "scalar mix all (with embeddings)" in html and "Provenance" in html
    assert str(env["model_dir"]) in html or res.provenance["model"] in html
    expected = {"ner": ("entity F1", "IOB1"), "upos": ("accuracy", "none"), "sentence": ("accuracy", "none")}[kind]
    assert (data["metric_name"], data["options"]["scheme"]) == expected
    assert all(("test_mean" in r) == (kind == "upos") for r in data["rows"])  # only the UPOS run has a test file


def test_tagging_scores_by_hand():
    # IOB2: gold PER, LOC | ORG (3 entities); predicted PER (right), MISC (wrong) -> P 1/2, R 1/3, F1 0.4
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["O", "B-MISC"]]
    s = tagging_scores(gold, pred, "IOB2")
    assert s["precision"] == pytest.approx(1 / 2) and s["recall"] == pytest.approx(1 / 3)
    assert s["f1"] == pytest.approx(0.4) and s["accuracy"] == pytest.approx(3 / 6) and s["words"] == 6
    # IOB1: I- after O starts an entity; B-LOC splits two LOCs. Gold PER, LOC, LOC | ORG (4); predicted PER (right)
    # and one merged LOC (wrong span) -> P 1/2, R 1/4, F1 1/3
    gold = [["I-PER", "I-PER", "O", "I-LOC", "B-LOC"], ["I-ORG"]]
    pred = [["I-PER", "I-PER", "O", "I-LOC", "I-LOC"], ["O"]]
    s = tagging_scores(gold, pred, "IOB1")
    assert (s["precision"], s["recall"]) == pytest.approx((1 / 2, 1 / 4))
    assert s["f1"] == pytest.approx(1 / 3) and s["accuracy"] == pytest.approx(4 / 6)
    s = tagging_scores([["NOUN", "VERB"]], [["NOUN", "NOUN"]], "none")
    assert s == {"accuracy": 0.5, "words": 2}


def test_detect_scheme():
    assert detect_scheme(["O", "I-PER", "I-PER", "O", "I-LOC", "B-LOC"]) == "IOB1"
    assert detect_scheme(["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC"]) == "IOB2"
    assert detect_scheme(["B-PER", "E-PER", "O", "S-LOC"]) == "IOBES"
    assert detect_scheme(UD_TAGS) == "none"
    assert detect_scheme(["O", "O"]) == "none"
    labels = [t for doc in DOCS for s in doc for t in (r[3] for r in s)]
    assert detect_scheme(labels) == "IOB1"
    assert detect_scheme([t for doc in DOCS for s in doc for t in iob2([r[3] for r in s])]) == "IOB2"


def test_restarts_mean_and_std(runs):
    rows = runs["ner"].rows
    for r in rows:  # a linear probe on fixed features is convex, solved exactly: fitted once; a learned mix restarts
        n = 3 if r["combine"] == "scalar_mix" else 1
        assert len(r["dev_runs"]) == n and len(r["epochs"]) == n and len(r["fits"]) == n
        assert r["dev_mean"] == pytest.approx(np.mean(r["dev_runs"]), abs=1e-5)
        assert r["dev_std"] == (pytest.approx(np.std(r["dev_runs"], ddof=1), abs=1e-4) if n > 1 else 0.0)

    from layerwise.probe.run import summarise
    from layerwise.probe.train import ProbeRun

    fake = [ProbeRun(dev={"accuracy": 0.5, "f1": f}, test=None, epochs=1) for f in (0.2, 0.4, 0.9)]
    s = summarise(fake)  # the seeds of a tiny model may tie; the statistic itself is checked on known values
    assert s["dev_runs"] == [0.2, 0.4, 0.9] and s["dev_mean"] == pytest.approx(0.5)
    assert s["dev_std"] == pytest.approx(np.std([0.2, 0.4, 0.9], ddof=1))
    for r in runs["upos"].rows:
        assert (
            len(r["dev_runs"]) == 1
            and r["dev_std"] == 0.0
            and r["dev_mean"] == pytest.approx(r["dev_runs"][0], abs=1e-5)
        )


def test_cached_store_is_reused(runs, env, monkeypatch):
    statuses = []
    real = probe_data.extract

    def spy(*args, **kwargs):
        summary = real(*args, **kwargs)
        statuses.append(summary.status)
        return summary

    monkeypatch.setattr(probe_data, "extract", spy)
    shards = sorted((env["root"] / "ner" / "features").rglob("shard-*.safetensors"))
    before = {p: p.stat().st_mtime_ns for p in shards}
    again = run(  # overwrite replaces the earlier results; the features, made with the same options, are reused
        env["iob1"],
        env["iob1"],
        config=cfg(task="tagging", column="ner", restarts=3, lr=0.05),
        model=env["ex"],
        output=env["root"] / "ner",
        overwrite=True,
        **QUIET,
    )
    assert statuses == ["already_complete", "already_complete"]
    assert shards and {p: p.stat().st_mtime_ns for p in shards} == before
    assert [r["dev_runs"] for r in again.rows] == [r["dev_runs"] for r in runs["ner"].rows]


def test_features_equal_encode_words(runs, env):
    ex = env["ex"]
    split = probe_data.split_features(
        ex,
        env["ud"],
        env["root"] / "upos" / "features" / "train",
        task="tagging",
        fmt="conllu",
        column="upos",
        progress=False,
    )
    assert split.labels == UD_TAGS and list(split.offsets) == [0, 6, 11]
    ref = np.concatenate(ex.encode_words(UD_WORDS, layers="all", combine="stack", subword="first"))
    x = split.x.float().numpy()
    assert x.shape == ref.shape == (11, 3, 32)
    assert np.all(np.abs(x - ref) <= 1e-3 * np.abs(ref) + 1e-4)
    assert [split.store.words(i) for i in range(2)] == UD_WORDS


def test_document_context_features(env):
    ex = env["ex"]
    summary = extract(
        env["iob2"],
        env["root"] / "doc-ctx",
        model=ex,
        layers="all",
        combine="stack",
        level="word",
        context="document",
        keep=["ner", "doc"],
        progress=False,
    )
    assert summary.status == "complete"
    store = open_store(env["root"] / "doc-ctx")
    sents = [(d, [r[0] for r in s]) for d, doc in enumerate(DOCS) for s in doc]
    assert len(store) == len(sents) and store.column("doc") == [d for d, _ in sents]
    plain = ex.encode_words([w for _, w in sents], layers="all", combine="stack")
    for i, (d, words) in enumerate(sents):
        same = [w for dd, w in sents if dd == d]
        k = same.index(words)
        left, right = sum(same[:k], []), sum(same[k + 1 :], [])
        ref = ex.encode_words([left + words + right], layers="all", combine="stack")[0][
            len(left) : len(left) + len(words)
        ]
        assert store.words(i) == words
        np.testing.assert_allclose(store[i], ref, atol=1e-5, rtol=0)
        assert not np.allclose(store[i], plain[i], atol=1e-3)  # the context changed the features
    # the probe passes the context on: its (float16) features are these
    res = run(
        env["iob2"],
        env["iob2"],
        config=cfg(document_context=True, layers_only=True),
        model=ex,
        output=env["root"] / "ner-ctx",
        **QUIET,
    )
    assert res.options["document_context"] is True and res.options["scheme"] == "IOB2"
    rows, _ = open_store(env["root"] / "ner-ctx" / "features" / "train").ragged()
    np.testing.assert_allclose(rows.astype(np.float32), store.ragged()[0], rtol=2e-3, atol=1e-4)
    items = list(read_records(env["iob2"], document_context=True, keep=["ner"]))
    assert "doc" not in items[0].fields
    first_of_doc2 = items[3]
    assert first_of_doc2.context == ([], sents[4][1]) and items[2].context == (sents[0][1] + sents[1][1], [])


def test_with_document_context_respects_max_words():
    lens = [3, 4, 5, 2, 6]
    recs = [Record(i + 1, "x", words=[f"s{i}w{j}" for j in range(n)], fields={"doc": 0}) for i, n in enumerate(lens)]
    recs.append(Record(9, "x", words=["other"], fields={"doc": 1}))
    out = list(with_document_context(iter(recs), max_words=10))
    assert out[2].context == (recs[1].words, [])  # 5 + 4 fits; adding 2 or 3 more would exceed 10
    assert out[0].context == ([], recs[1].words)  # 3 + 4 = 7; + 5 > 10
    assert out[5].context == ([], [])  # alone in its document
    for o in out:
        left, right = o.context
        assert len(left) + len(o.words) + len(right) <= 10
        assert all(w.startswith("s") for w in left + right) or o.fields["doc"] == 1
    big = list(
        with_document_context(iter([Record(1, "x", words=["a"] * 12, fields={"doc": 0}), recs[0]]), max_words=10)
    )
    assert big[0].context == ([], [])


def test_linear_cka():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8))
    y = x @ rng.normal(size=(8, 5)) + 0.5 * rng.normal(size=(60, 5))
    q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    assert linear_cka(x, x) == pytest.approx(1.0)
    base = linear_cka(x, y)
    assert 0 < base < 1
    assert linear_cka(x, 3.7 * y @ q) == pytest.approx(base)
    h = np.eye(60) - 1 / 60
    k, lm = h @ x @ x.T @ h, h @ y @ y.T @ h
    assert base == pytest.approx(np.trace(k @ lm) / np.sqrt(np.trace(k @ k) * np.trace(lm @ lm)))
    stack = rng.normal(size=(40, 4, 6))
    stack[:, 1] = stack[:, 0] * 2 + 1
    m = cka_matrix(stack)
    assert m.shape == (4, 4) and np.allclose(m, m.T) and np.allclose(np.diag(m), 1)
    assert m[0, 1] == pytest.approx(1.0) and m[2, 3] == pytest.approx(linear_cka(stack[:, 2], stack[:, 3]))


def test_crf_matches_brute_force():
    torch.manual_seed(0)
    crf = CRF(3)
    for p in crf.parameters():
        torch.nn.init.normal_(p)
    em = torch.randn(2, 3, 3) * 2
    tags = torch.tensor([[0, 2, 1], [1, 1, 2]])  # row 1 has length 2: its last tag is padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s, e, tr = crf.start.detach(), crf.end.detach(), crf.trans.detach()

    def score(r, seq):
        v = s[seq[0]] + em[r, 0, seq[0]] + e[seq[-1]]
        return v + sum(tr[seq[t - 1], seq[t]] + em[r, t, seq[t]] for t in range(1, len(seq)))

    nll, best = [], []
    for r, n in enumerate(mask.sum(1).tolist()):
        seqs = list(itertools.product(range(3), repeat=n))
        scores = torch.stack([score(r, q) for q in seqs])
        nll.append(torch.logsumexp(scores, 0) - score(r, tags[r, :n].tolist()))
        best.append(list(seqs[int(scores.argmax())]))
    assert float(crf.nll(em, tags, mask).detach()) == pytest.approx(float(torch.stack(nll).mean()), abs=1e-5)
    assert crf.decode(em, mask) == best
    assert float(crf.nll(em[:1], tags[:1], mask[:1]).detach()) == pytest.approx(float(nll[0]), abs=1e-5)


def test_bilstm_crf_probe(env):
    train = env["root"] / "iob1x4.conll"  # each sentence 4 times: the held-out part of train it stops on is seen
    train.write_text(conll_text(DOCS * 4))
    res = run(
        train,
        env["iob1"],
        config=cfg(task="tagging", probe="bilstm", crf=True, hidden=16, layers_only=True, epochs=40, lr=0.05,
                   patience=40),
        model=env["ex"],
        output=env["root"] / "lstm",
        **QUIET,
    )
    assert [r["name"] for r in res.rows] == ["embeddings", "layer 1", "layer 2"]
    # trained on the same few sentences as scored, the BiLSTM + CRF fits them: entity F1 far above the all-"O"
    # answer (F1 0, token accuracy 0.73), so training, Viterbi decoding and scoring all work. On so little data a
    # layer can land one entity short (seen once: 85.7 on a loaded machine, where float reductions run in another
    # order), so every layer must beat 0.5 and the best must fit the set
    assert all(r["kind"] == "layer" and r["dev_mean"] >= 0.5 and r["dev_accuracy"] >= 0.8 for r in res.rows), \
        [(r["dev_mean"], r["dev_accuracy"], r["fits"]) for r in res.rows]
    assert max(r["dev_mean"] for r in res.rows) >= 0.9 and max(r["dev_accuracy"] for r in res.rows) >= 0.9
    assert res.options["probe"] == "bilstm" and res.options["crf"] is True
    assert (env["root"] / "lstm" / "report.html").is_file()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(task="parsing"), "Valid tasks are: sentence, tagging"),
        (dict(probe="svm"), "Valid probes are: linear, mlp, bilstm"),
        (dict(scheme="BIO"), "Valid schemes are: auto, none, IOB1, IOB2, IOBES"),
        (dict(column="lemma"), "Valid columns are: ner, chunk, pos"),
        (dict(train="ud", column="ner"), "Valid columns are: upos, xpos"),
        (dict(train="tsv"), "from CoNLL-2003 (.conll) or CoNLL-U (.conllu) files"),
        (dict(task="sentence"), "reads text+label files (tsv, csv, jsonl, parquet)"),
        (dict(restarts=0), "restarts must be a positive int, got 0"),
        (dict(probe="bilstm", task="sentence", train="tsv"), "use it with task='tagging'"),
        (dict(crf=True), "crf=True is the output layer of the bilstm probe; use probe='bilstm' (got 'linear')"),
        (dict(crf=True, probe="mlp"), "use probe='bilstm' (got 'mlp')"),
    ],
)
def test_bad_input(env, tmp_path, kw, message):
    kw = dict(kw)
    train = env[kw.pop("train", "iob1")]
    with pytest.raises(ValueError, match=re.escape(message)):
        run(train, train, config=ProbeConfig(**kw), model=env["ex"], output=tmp_path / "out", log=lambda line: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(task="parsing"), "Valid tasks are: sentence, tagging"),
        (dict(probe="svm"), "Valid probes are: linear, mlp, bilstm"),
        (dict(scheme="BIO"), "Valid schemes are: auto, none, IOB1, IOB2, IOBES"),
        (dict(restarts=0), "restarts must be a positive int, got 0"),
        (dict(probe="bilstm", task="sentence"), "use it with task='tagging'"),
        (dict(crf=True), "use probe='bilstm'"),
    ],
)
def test_probe_config_validates_itself(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ProbeConfig(**kw)
    with pytest.raises(ValueError, match=re.escape(message)):  # and a changed copy is checked again
        ProbeConfig().replace(**kw)
    ok = ProbeConfig(probe="bilstm", crf=True)
    assert (ok.probe, ok.crf, ok.replace(hidden=8).hidden) == ("bilstm", True, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.epochs = 2


# ---- the output directory: a probe replaces only its own files, and only with overwrite --------------------------
def _snapshot(folder):
    """Every file under ``folder`` (relative path -> bytes): what a refused run must leave exactly as it was."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _sentence_run(env, out, **kw):
    return run(env["tsv"], env["tsv"], config=cfg(task="sentence", layers_only=True, **kw.pop("config", {})),
               model=env["ex"], output=out, **QUIET, **kw)


@pytest.mark.parametrize("overwrite", [False, True])
def test_probe_refuses_files_it_did_not_write(env, tmp_path, overwrite):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.csv").write_text("my,own\n1,2\n")
    (out / "report.html").write_bytes(b"<html>my report</html>\n")
    (out / "notes.txt").write_text("keep me")
    before = _snapshot(out)
    with pytest.raises(LayerwiseError) as caught:
        _sentence_run(env, out, overwrite=overwrite)
    msg = str(caught.value)
    assert f"output {str(out)!r} holds results.csv, report.html, which layerwise probe did not write" in msg
    assert "layerwise never replaces files it did not write, even with --overwrite" in msg
    assert "choose another directory (-o), or move those files away yourself" in msg
    assert _snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["notes.txt", "report.html",
                                                                                   "results.csv"]


def test_probe_replaces_its_own_output_only_with_overwrite(env, tmp_path):
    out = tmp_path / "probe"
    first = _sentence_run(env, out)
    data = json.loads((out / "results.json").read_text())
    assert data["format"] == "layerwise-probe" and data["files"] == list(OUTPUT_FILES)
    assert read_probe_dir(out)["rows"] == data["rows"]  # the explorer reads it
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    inodes = {name: (out / name).stat().st_ino for name in OUTPUT_FILES}
    with pytest.raises(LayerwiseError, match=re.escape(
        f"output {str(out)!r} holds an earlier layerwise probe output (results.md, results.csv, results.json, "
        f"layers.png, similarity.png, report.html); pass --overwrite (overwrite=True) to replace it, or choose "
        f"another directory (-o)"
    )):
        _sentence_run(env, out, config={"epochs": 2})
    assert _snapshot(out) == before
    again = _sentence_run(env, out, config={"epochs": 2}, overwrite=True)
    data = json.loads((out / "results.json").read_text())
    assert data["options"]["epochs"] == 2 and first.options["epochs"] == 1 and again.options["epochs"] == 2
    assert data["format"] == "layerwise-probe" and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUT_FILES, "features", "notes.txt"])  # no temp left
    assert all((out / name).stat().st_ino != inodes[name] for name in OUTPUT_FILES)  # every result file replaced


def test_probe_output_marker_is_required(env, tmp_path):
    out = tmp_path / "probe"
    _sentence_run(env, out)
    data = json.loads((out / "results.json").read_text())
    # results.json of a probe run before the marker: the explorer still reads it, --overwrite does not replace it
    legacy = {k: v for k, v in data.items() if k not in ("format", "files", "unseen_labels")}
    (out / "results.json").write_text(json.dumps(legacy))
    assert read_probe_dir(out)["title"] == data["task_title"]
    before = _snapshot(out)
    with pytest.raises(LayerwiseError, match=re.escape(
        'which layerwise probe did not write (it has no results.json with "format": "layerwise-probe"'
    )) as caught:
        _sentence_run(env, out, overwrite=True)
    assert "holds results.md, results.csv, results.json, layers.png, similarity.png, report.html" in str(caught.value)
    assert _snapshot(out) == before
    # a marker that does not list a file: that file is not the probe's
    (out / "results.json").write_text(json.dumps({**data, "files": [n for n in OUTPUT_FILES if n != "report.html"]}))
    before = _snapshot(out)
    with pytest.raises(LayerwiseError, match=re.escape(
        "holds report.html, which layerwise probe did not write (its results.json does not list them)"
    )):
        _sentence_run(env, out, overwrite=True)
    assert _snapshot(out) == before
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(LayerwiseError, match="is a file; give a directory for the layerwise probe output"):
        _sentence_run(env, tmp_path / "a-file", overwrite=True)


def test_overwrite_reuses_same_features_and_extracts_other_options_again(env, tmp_path, monkeypatch):
    out = tmp_path / "probe"
    _sentence_run(env, out)
    statuses = []
    real = probe_data.extract

    def spy(*args, **kwargs):
        summary = real(*args, **kwargs)
        statuses.append((summary.status, kwargs["options"].overwrite))
        return summary

    monkeypatch.setattr(probe_data, "extract", spy)
    _sentence_run(env, out, overwrite=True)
    assert statuses == [("already_complete", False)] * 2
    statuses.clear()
    res = _sentence_run(env, out, config={"pool": "max"}, overwrite=True)  # another pooling: features extracted again
    assert statuses == [("complete", True)] * 2 and res.options["pool"] == "max"
    assert open_store(out / "features" / "train").manifest["spec"]["pool"] == "max"


# ---- dev/test labels the training data lacks: counted, named, scored as the metric defines ----------------------
def _split(rows, labels, offsets=None):
    """A probe split from hand-made one-layer features (``rows``: one feature vector per label)."""
    x = torch.tensor(rows, dtype=torch.float16).unsqueeze(1)  # [n, K=1, W]
    return ProbeSplit(x, list(labels), None if offsets is None else np.asarray(offsets), store=None)


def _fit(task, train, dev, labels, scheme="none"):
    opts = ProbeOptions(probe="linear", epochs=60, lr=0.1, patience=60, batch_size=4)
    return fit_probe(ProbeSpec("layer 0", "layer", (0,), "concat"), train, dev, None, task=task, labels=labels,
                     scheme=scheme, opts=opts, seed=0)


def test_unseen_sentence_label_scored_by_hand():
    a, b = [3.0, 0.0], [0.0, 3.0]
    train = _split([a] * 4 + [b] * 4, ["A"] * 4 + ["B"] * 4)
    # dev: 3 A, 2 B and 2 C (a class train lacks) whose features are A's: the probe answers A for them
    dev = _split([a] * 3 + [b] * 2 + [a] * 2, ["A"] * 3 + ["B"] * 2 + ["C"] * 2)
    run_ = _fit("sentence", train, dev, ["A", "B"])
    assert run_.dev["accuracy"] == pytest.approx(5 / 7)
    # macro-F1 over A, B and C: A has P 3/5, R 1 (F1 3/4); B F1 1; C F1 0 (never predicted) -> 7/12
    assert run_.dev["macro_f1"] == pytest.approx((0.75 + 1 + 0) / 3)


def test_sentence_scores_macro_f1_counts_a_class_train_lacks():
    s = sentence_scores(["A", "A", "B", "C"], ["A", "B", "B", "A"], ["A", "B"])
    # A: P 1/2 R 1/2 (F1 1/2); B: P 1/2 R 1 (F1 2/3); C: F1 0 -> (1/2 + 2/3 + 0) / 3
    assert s["accuracy"] == pytest.approx(2 / 4) and s["macro_f1"] == pytest.approx((1 / 2 + 2 / 3) / 3)


def test_unseen_entity_type_scored_by_seqeval():
    o, b, i = [3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0]
    train = _split([b, i, o, o, b, o], ["B-PER", "I-PER", "O", "O", "B-PER", "O"], [0, 3, 6])
    # dev: PER | EVENT (a type train lacks, with O's features: tagged O) | PER -> 3 gold entities, 2 found
    dev = _split([b, i, o, o, o, o, o, b, o],
                 ["B-PER", "I-PER", "O", "O", "B-EVENT", "I-EVENT", "O", "B-PER", "O"], [0, 3, 7, 9])
    run_ = _fit("tagging", train, dev, ["B-PER", "I-PER", "O"], scheme="IOB2")
    assert (run_.dev["precision"], run_.dev["recall"]) == pytest.approx((1.0, 2 / 3))
    assert run_.dev["f1"] == pytest.approx(0.8) and run_.dev["accuracy"] == pytest.approx(7 / 9)


UNSEEN_TSV = TSV + "a film about the lamb\tneutral\nthe fox\tneutral\nParis\tneutral\nthe call\tmixed\n"
ONLY_UNSEEN_TSV = "sentence\tlabel\nthe lazy fox\tneutral\nI love lamb\tneutral\n"


def test_unseen_sentence_labels_are_counted_and_named(env, tmp_path):
    (tmp_path / "dev.tsv").write_text(UNSEEN_TSV)
    (tmp_path / "test.tsv").write_text(ONLY_UNSEEN_TSV)
    lines: list[str] = []
    out = tmp_path / "out"
    res = run(env["tsv"], tmp_path / "dev.tsv", tmp_path / "test.tsv", cfg(task="sentence", layers_only=True),
              model=env["ex"], output=out, log=lines.append, progress=False)
    want = {"dev": {"neutral": 3, "mixed": 1}, "test": {"neutral": 2}}
    assert res.unseen_labels == want and list(res.unseen_labels["dev"]) == ["neutral", "mixed"]
    data = json.loads((out / "results.json").read_text())
    assert data["unseen_labels"] == want and data["provenance"]["test_rows"] == 2
    dev_note = ("dev: 4 of 12 records have labels the training data lacks: neutral (3), mixed (1); a probe cannot "
                "predict a label it never saw, so accuracy counts them as errors")
    test_note = "test: 2 of 2 records have labels the training data lacks: neutral (2)"
    assert f"warning: {dev_note}" in lines and any(line.startswith(f"warning: {test_note}") for line in lines)
    for name in ("report.html", "results.md"):
        text = unescape((out / name).read_text())
        assert dev_note in text and test_note in text, name
    for r in res.rows:  # the 4 unseen dev records are errors; every test record is
        assert r["dev_mean"] <= 8 / 12 and round(r["dev_mean"] * 12, 6).is_integer(), r
        assert r["test_mean"] == 0.0, r
    # a clean dev set: nothing to say
    clean = _sentence_run(env, tmp_path / "clean")
    assert clean.unseen_labels == {"dev": {}} and clean.unseen_notes() == []
    assert "Labels unseen in training" not in (tmp_path / "clean" / "report.html").read_text()


def test_unseen_tags_are_counted_and_named(env, tmp_path):
    event = [[("Olympic", "NNP", "B-NP", "I-EVENT"), ("Games", "NNP", "I-NP", "I-EVENT"), ("open", "VB", "B-VP", "O")]]
    (tmp_path / "dev.conll").write_text(conll_text([*DOCS, event]))
    (tmp_path / "test.conll").write_text(conll_text([event]))
    lines: list[str] = []
    res = run(env["iob1"], tmp_path / "dev.conll", tmp_path / "test.conll", cfg(layers_only=True), model=env["ex"],
              output=tmp_path / "out", log=lines.append, progress=False)
    assert res.metric_name == "entity F1" and res.unseen_labels == {"dev": {"I-EVENT": 2}, "test": {"I-EVENT": 2}}
    note = ("dev: 2 of 36 words have labels the training data lacks: I-EVENT (2); entity F1 follows seqeval's rule: "
            "a gold entity counts as found only with its exact span and type")
    assert any(line.startswith(f"warning: {note}") for line in lines)
    assert note in unescape((tmp_path / "out" / "report.html").read_text())
    assert all(r["test_mean"] == 0.0 for r in res.rows)  # the test set's only entity is of a type train lacks


def test_unseen_notes_wording():
    one = unseen_notes({"dev": {"": 1}, "test": {}}, task="sentence", metric="accuracy", rows={"dev": 3, "test": 2})
    assert one == ['dev: 1 of 3 records has a label the training data lacks: "" (1); a probe cannot predict a label '
                   'it never saw, so accuracy counts it as an error']  # an empty label is shown quoted
    many = unseen_notes({"test": {f"T{i}": 20 - i for i in range(12)}}, task="tagging", metric="accuracy", rows={})
    assert many == ["test: 174 words have labels the training data lacks: T0 (20), T1 (19), T2 (18), T3 (17), "
                    "T4 (16), T5 (15), T6 (14), T7 (13), T8 (12), T9 (11), and 2 more; a probe cannot predict a "
                    "label it never saw, so token accuracy counts them as errors"]
    assert unseen_notes({"dev": {}}, task="tagging", metric="entity F1", rows={"dev": 5}) == []


def test_results_show_as_html_in_a_notebook(runs):
    """The table and the per-layer curve (inline SVG); a task title or label holding ``<script>`` stays text."""
    import dataclasses

    page = runs["ner"]._repr_html_()
    assert page.count("<tr>") >= len(runs["ner"].rows) and "<svg" in page and "<script" not in page
    hostile = dataclasses.replace(runs["sentence"], task_title="<script>alert(1)</script>")
    page = hostile._repr_html_()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page


def test_control_task_and_intervals_in_every_output(env, tmp_path):
    """--control: each layer's row has its control accuracy and selectivity (word types from the store), shown in
    the table; every row has its bootstrap interval, the split reported and whether it is within the noise."""
    res = run(env["ud"], env["ud"], config=cfg(task="tagging", column="upos", control=True, layers_only=True),
              model=env["ex"], output=tmp_path / "ctrl", **QUIET)
    for r in res.rows:
        assert 0.0 <= r["control_accuracy"] <= 1.0
        assert r["selectivity"] == pytest.approx(r["dev_accuracy"] - r["control_accuracy"], abs=1e-4)
        lo, hi = r["dev_ci"]
        assert lo <= r["dev_mean"] <= hi and r["reported"] == "dev" and isinstance(r["within_noise_of_best"], bool)
        assert r["fits"][0]["converged"] and r["fits"][0]["solver"] == "scikit-learn lbfgs"
    md = (tmp_path / "ctrl" / "results.md").read_text()
    assert "selectivity" in md and "dev accuracy [95% CI]" in md
    assert "within the noise" in md or "ahead of every other probe" in md
    data = json.loads((tmp_path / "ctrl" / "results.json").read_text())
    assert data["options"]["control"] is True and "training split only" in data["options"]["selection"]


def test_the_feature_cache_is_float16_unless_float32_is_asked(env):
    """The probe's cached features are float16 by default (documented), float32 on request; both score alike."""
    from layerwise.store import open_store

    scores = {}
    for dtype in ("float16", "float32"):
        out = env["root"] / f"dtype-{dtype}"
        res = run(env["tsv"], env["tsv"], config=cfg(task="sentence", feature_dtype=dtype, layers_only=True),
                  model=env["ex"], output=out, **QUIET)
        assert open_store(out / "features" / "train").dtype == np.dtype(dtype)
        scores[dtype] = [r["dev_mean"] for r in res.rows]
    np.testing.assert_allclose(scores["float16"], scores["float32"], atol=0.05)
    from layerwise.errors import SpecError

    with pytest.raises(SpecError, match=r"unknown feature_dtype 'int8'. Valid values are: float16, float32"):
        cfg(feature_dtype="int8")
