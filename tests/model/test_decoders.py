"""Decoder models through everything above the pipeline, unchanged: extraction to a store, heads, the probe, the
service. The decoder is the tiny random Llama of ``tests/archs.py`` (rotary positions, final norm, BOS, no pad
token in its tokenizer)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

import layerwise as lw
from layerwise.heads import HeadConfig, TrainOptions, load, train
from layerwise.probe import ProbeConfig, run
from layerwise.store import open_store

from tiny import extract, toy

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naïve cafés in Paris", "a"]


@pytest.fixture(scope="module")
def llama(arch_dirs, arch_extractors):
    return arch_dirs["llama"], arch_extractors["llama"]


def test_extract_a_store_from_a_decoder(llama, tmp_path):
    path, ex = llama
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    extract(src, tmp_path / "store", model=ex, layers="-2:", combine="concat", pool="last")
    store = open_store(tmp_path / "store")
    want = ex.encode(TEXTS, layers="-2:", combine="concat", pool="last")
    assert np.abs(np.asarray(store[0 : len(TEXTS)]) - want).max() <= 1e-6
    assert store.manifest["model"]["family"] == "llama"


def test_a_frozen_head_on_a_decoder_trains_saves_and_predicts(llama, tmp_path):
    path, ex = llama
    tr, dv = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    toy(tr, 48, 0), toy(dv, 24, 1)
    cfg = HeadConfig(model=str(path), layers="-2:", combine="scalar_mix", pool="last")
    opts = TrainOptions(epochs=8, lr=1e-2, batch_size=16, cache_dir=tmp_path / "cache", progress=False)
    result = train(cfg, tr, dv, model=ex, options=opts, output=tmp_path / "head", log=lambda line: None)
    assert result.dev["accuracy"] >= 0.75, result.dev  # the toy set is separable by one keyword (chance: 0.5)
    clf = load(tmp_path / "head", model=ex)
    texts = [t for t, _ in toy(tmp_path / "again.tsv", 8, 5)]
    want = [y for _, y in toy(tmp_path / "again.tsv", 8, 5)]
    assert sum(a == b for a, b in zip(clf.predict(texts), want)) >= 6


def test_the_probe_runs_every_layer_of_a_decoder(llama, tmp_path):
    path, ex = llama
    data = tmp_path / "s.tsv"
    toy(data, 40, 3)
    res = run(data, data, config=ProbeConfig(task="sentence", epochs=2), model=ex, output=tmp_path / "probe",
              log=lambda line: None, progress=False)
    names = [row["name"] for row in res.rows]
    assert {"embeddings", "layer 1", "layer 2", "last"} <= set(names)
    assert (tmp_path / "probe" / "results.csv").exists()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_service_serves_a_decoder(llama, llama_service):
    path, ex = llama
    base = llama_service
    with urllib.request.urlopen(f"{base}/v1/model", timeout=30) as resp:
        info = json.loads(resp.read())
    assert info["architecture"] == "llama" and "rotary" in info["positions"]
    status, body = _post(f"{base}/v1/encode", {"texts": TEXTS, "layers": "-2:", "pool": "last"})
    assert status == 200, body
    got = np.asarray(body["vectors"], dtype=np.float32)
    assert np.abs(got - ex.encode(TEXTS, layers="-2:", pool="last")).max() <= 1e-5
    status, body = _post(f"{base}/v1/encode", {"texts": TEXTS, "layers": -1, "site": "pre_ln"})
    assert status == 422 and "site 'pre_ln' is not available for this model" in json.dumps(body)


def test_add_eos_appends_the_token_last_pooling_reads(llama, arch_extractors):
    path, ex = llama
    tok = ex.tokenizer
    texts = ["Peter Blackburn", "EU rejects German call"]
    got = ex.encode(texts, layers=-1, pool="last", add_eos=True)
    for text, vec in zip(texts, got):  # independently: the tokenizer's ids + eos, through transformers
        ids = torch.tensor([tok(text)["input_ids"] + [tok.eos_token_id]])
        with torch.inference_mode():
            ref = ex.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        assert np.abs(vec - ref.hidden_states[-1][0, -1].numpy()).max() <= 1e-5
    left = lw.Extractor(ex.loaded, padding_side="left")  # the Qwen3-Embedding convention: same vectors
    assert np.abs(left.encode(texts, layers=-1, pool="last", add_eos=True) - got).max() <= 1e-5
    (tokens,) = ex.encode(["Peter"], layers=-1, pool=None, add_eos=True)
    assert tokens.shape[0] == len(tok("Peter")["input_ids"]) + 1
    t5 = arch_extractors["t5"]  # its tokenizer ends every text with </s> already: nothing is added twice
    (t5_tokens,) = t5.encode(["Peter"], layers=-1, pool=None, add_eos=True)
    assert t5_tokens.shape[0] == len(t5.tokenizer("Peter")["input_ids"])


def test_prompt_is_put_before_every_text(llama):
    path, ex = llama
    texts = ["Peter Blackburn", "naïve cafés"]
    prompt = "Instruct: find the name\nQuery: "
    got = ex.encode(texts, layers=-1, pool="mean", prompt=prompt)
    assert np.abs(got - ex.encode([prompt + t for t in texts], layers=-1, pool="mean")).max() == 0
    spec = lw.EncodeSpec(layers=-1, pool="last", prompt=prompt, add_eos=True)
    assert lw.EncodeSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="prompt applies to levels 'sentence' and 'token'"):
        lw.EncodeSpec(level="word", prompt="query: ")
    with pytest.raises(ValueError, match="add_eos must be True or False, got 'yes'"):
        lw.EncodeSpec(add_eos="yes")


def test_cls_pool_on_a_decoder_is_refused_naming_last(arch_extractors):
    """A decoder's first token sees no other token: pool='cls' is refused with 'last' named (issue 41, item 8); an
    encoder still pools its [CLS]. Every architecture of tests/archs.py says which it is."""
    from archs import kind

    for name, ex in arch_extractors.items():
        assert ex.causal == (kind(name) == "decoder"), name
    for name in ("gpt2", "llama", "qwen2", "opt"):
        ex = arch_extractors[name]
        with pytest.raises(lw.SpecError, match=r"pool='cls' reads the first token, but this model is a decoder "
                                               r"\(causal attention\).*Use pool='last'"):
            ex.encode(TEXTS, pool="cls")
        with pytest.raises(lw.SpecError, match="Use pool='last'"):
            lw.EncodeSpec(pool="cls").resolve(ex)
        assert ex.encode(TEXTS, pool="last").shape == (len(TEXTS), ex.hidden_size)
    for name in ("bert", "t5", "modernbert"):
        assert arch_extractors[name].encode(TEXTS, pool="cls").shape[0] == len(TEXTS)


def test_loading_a_causal_lm_checkpoint_prints_no_load_report(arch_dirs, tmp_path):
    """A Llama saved with its language-model head: the head is left out by design, so transformers' LOAD REPORT
    ('lm_head.weight UNEXPECTED') is not printed (issue 41, item 8). Run as a user runs it, in a fresh process."""
    import shutil
    import subprocess
    import sys

    import transformers

    src = arch_dirs["llama"]
    config = transformers.AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = False
    config.num_hidden_layers = 1  # loaded whole (one layer: nothing to load by depth), as a hub id is
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama-lm")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / "llama-lm" / f.name)
    code = ("import layerwise as lw; ex = lw.Extractor({!r}, device='cpu', backend='torch'); "
            "print(ex.encode(['Peter Blackburn'], pool='last').shape)")
    plain = ("from transformers import AutoModel; AutoModel.from_pretrained({!r})")
    run = [subprocess.run([sys.executable, "-c", c.format(str(tmp_path / "llama-lm"))], capture_output=True, text=True,
                          timeout=300) for c in (code, plain)]
    assert run[0].returncode == 0 and run[0].stdout.strip() == f"(1, {config.hidden_size})", run[0].stderr
    assert "LOAD REPORT" not in run[0].stderr and "lm_head" not in run[0].stderr, run[0].stderr
    assert "LOAD REPORT" in run[1].stderr and "lm_head.weight" in run[1].stderr  # what plain transformers prints


def test_a_load_report_of_missing_weights_is_still_shown():
    """The filter is narrow: only a report of unexpected (unused) weights is dropped, and only during a load."""
    import logging

    from layerwise.model.loading import quiet_transformers

    report = logging.getLogger("transformers.modeling_utils")
    seen: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    report.addHandler(collect)
    try:
        with quiet_transformers():
            report.warning("LlamaModel LOAD REPORT from: x\nlm_head.weight | UNEXPECTED")
            report.warning("LlamaModel LOAD REPORT from: y\nlayers.0.mlp.up_proj.weight | MISSING")
            report.warning("an unrelated warning")
        report.warning("LlamaModel LOAD REPORT from: z\nlm_head.weight | UNEXPECTED")  # outside layerwise's load
    finally:
        report.removeHandler(collect)
    assert [m.split("\n")[0] for m in seen] == ["LlamaModel LOAD REPORT from: y", "an unrelated warning",
                                                 "LlamaModel LOAD REPORT from: z"]
    assert report.filters == []
