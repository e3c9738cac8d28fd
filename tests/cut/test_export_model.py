"""``lw.export_model`` / ``layerwise export-model``: a chosen layer written as a model other tools load.

Each exported directory is checked here independently of the export's own check: it is loaded with plain transformers
and sentence-transformers, and compared with the *source* model run by plain transformers
(``output_hidden_states=True``; the final norm found here by its module name), not with layerwise's layer map.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.cut.plan import ModelFacts, plan_export

SentenceTransformer = pytest.importorskip("sentence_transformers", reason="in the test extra").SentenceTransformer

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "I love Paris in the springtime.",
         "The quick brown fox jumps over the lazy dog, again and again!"]
# the architectures: the seven BERT families, MPNet, ModernBERT, T5 (encoder), GPT-2 and Llama
ARCHS = ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "xlm-roberta", "mpnet", "modernbert",
         "t5", "gpt2", "llama")
FINAL_NORMS = {"modernbert": "final_norm", "t5": "encoder.final_layer_norm", "gpt2": "ln_f", "llama": "norm"}
DECODERS = ("gpt2", "llama")


def plain(directory):
    """The model of ``directory`` as a plain transformers user loads it (T5: its encoder-only class)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    cls = transformers.T5EncoderModel if config.model_type == "t5" else transformers.AutoModel
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def states(directory, texts):
    """``(hidden_states, last_hidden_state, attention_mask)`` of plain transformers on ``texts`` (right padding)."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = plain(directory)(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                               output_hidden_states=True)
    return out.hidden_states, out.last_hidden_state, enc["attention_mask"]


def mean_pool(x, mask):
    m = mask.unsqueeze(-1).to(x.dtype)
    return ((x * m).sum(1) / m.sum(1)).numpy()


def last_pool(x, mask):
    return x[torch.arange(x.shape[0]), mask.sum(1) - 1].numpy()


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_exports_layer_1_that_transformers_and_st_load(arch, arch_dirs, tmp_path):
    src = arch_dirs[arch]
    pool = "last" if arch in DECODERS else "mean"
    result = lw.export_model(tmp_path / "out", str(src), layers=1, pool=pool)
    out = result.directory
    report = json.loads((out / "layerwise-export.json").read_text())
    assert report["passed"] and report["checks"]["transformers"]["max_abs_diff"] <= 1e-5
    assert report["checks"]["sentence_transformers"]["min_cosine"] >= 0.99999
    config = json.loads((out / "config.json").read_text())
    assert transformers.AutoConfig.from_pretrained(out).num_hidden_layers == 1
    assert config["layerwise"]["layers"] == 1 and config["layerwise"]["source_num_layers"] >= 2
    assert (config["layerwise"]["final_norm"] is not None) == (arch in FINAL_NORMS)
    # the source by plain transformers: layer 1, with the final norm after it where the architecture has one
    src_hidden, _, _ = states(src, TEXTS)
    want = src_hidden[1]
    if arch in FINAL_NORMS:
        module = plain(src).get_submodule(FINAL_NORMS[arch])
        with torch.inference_mode():
            want = module(want)
    _, got, mask = states(out, TEXTS)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() <= 1e-5
    # sentence-transformers gives the pooled vectors of that layer
    vectors = SentenceTransformer(str(out), device="cpu").encode(TEXTS)
    expected = (last_pool if pool == "last" else mean_pool)(want, mask)
    assert cosines(vectors, expected).min() >= 0.99999
    # the weights are exactly what the cut model needs: nothing missing, nothing left over from deeper layers
    cls = transformers.T5EncoderModel if arch == "t5" else transformers.AutoModel
    _, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_default_model_layer_3_in_sentence_transformers(tmp_path, default_extractor):
    result = lw.export_model(tmp_path / "l3", layers=3, normalize=True)
    model = SentenceTransformer(str(result.directory), device="cpu")
    got = model.encode(TEXTS)
    want = default_extractor.encode(TEXTS, layers=3, pool="mean", normalize=True, truncate=True)
    assert np.abs(got - want).max() < 1e-5
    with safe_open(str(result.directory / "model.safetensors"), "pt") as f:
        layers = {int(n.split(".")[2]) for n in f.keys() if n.startswith("encoder.layer.")}
    assert layers == {0, 1, 2}  # layers 1..3 are modules 0..2; nothing of 4..6
    assert json.loads((result.directory / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
    report = result.report
    assert report["source"]["fingerprint"] == default_extractor.fingerprint() and report["export"]["layers"] == 3
    assert report["export"]["bytes"] < 0.8 * 90_000_000 and report["export"]["weights_dtype"] == "float32"
    assert "min cosine 1.0000000" in result.summary()


@pytest.mark.parametrize("arch", ("bert", "deberta-v2", "t5", "gpt2"))
def test_a_weighted_mix_is_weighted_layer_pooling(arch, arch_dirs, tmp_path):
    src = arch_dirs[arch]
    result = lw.export_model(tmp_path / "mix", str(src), layers=[0, 2], combine="weighted", weights=[1.0, 3.0],
                             pool="max", normalize=True)
    modules = json.loads((result.directory / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "WeightedLayerPooling", "Pooling",
                                                             "Normalize"]
    read = json.loads((result.directory / "config.json").read_text())["layerwise"]["read"]
    assert read == "hidden_states[0..2] mixed by WeightedLayerPooling"
    hidden, _, mask = states(src, TEXTS)  # layer 2 is the last: the final norm is the model's own
    mix = (hidden[0] + 3 * hidden[2]) / 4
    mix = mix.masked_fill(~mask.bool().unsqueeze(-1), -torch.inf).amax(1).numpy()
    got = SentenceTransformer(str(result.directory), device="cpu").encode(TEXTS)
    assert cosines(got, mix).min() >= 0.99999
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_refusals_name_what_can_be_exported(arch_dirs, tmp_path):
    with pytest.raises(lw.SpecError, match=r"combine='concat'.*--combine mean.*layerwise serve"):
        lw.export_model(tmp_path / "a", str(arch_dirs["bert"]), layers="-2:", combine="concat")
    with pytest.raises(lw.SpecError, match=r"site 'raw' of the last layer.*'ln_f'.*--site block.*--layers 1 --site "
                       r"raw.*layers=2;site=raw"):
        lw.export_model(tmp_path / "b", str(arch_dirs["gpt2"]), layers=-1, site="raw")
    with pytest.raises(lw.SpecError, match=r"pool='pooler' needs a model with a pooler"):
        lw.export_model(tmp_path / "c", str(arch_dirs["electra"]), layers=1, pool="pooler")
    with pytest.raises(lw.SpecError, match=r"pool 'mean_max'.*mean, cls, max, last, pooler.*pool=mean_max"):
        lw.export_model(tmp_path / "c", str(arch_dirs["bert"]), layers=1, pool="mean_max")
    with pytest.raises(lw.SpecError, match=r"sum to 0.0.*positive"):
        lw.export_model(tmp_path / "d", str(arch_dirs["bert"]), layers="1:", combine="weighted", weights=[1, -1])
    with pytest.raises(lw.ExportError, match="backend='onnx'"):
        lw.export_model(tmp_path / "e", str(arch_dirs["bert"]), layers=1, backend="onnx")
    assert not any(tmp_path.iterdir())  # a refusal writes nothing
    # raw is exported where it is what the cut computes (no final norm)
    assert lw.export_model(tmp_path / "f", str(arch_dirs["bert"]), layers=1, site="raw").passed


@pytest.mark.parametrize("arch", tuple(FINAL_NORMS))
def test_raw_before_a_final_norm_keeps_one_more_layer_and_reads_the_state_before_it(arch, arch_dirs, tmp_path):
    src = arch_dirs[arch]
    pool = "last" if arch in DECODERS else "mean"
    result = lw.export_model(tmp_path / "raw", str(src), layers=1, site="raw", pool=pool)
    out = result.directory
    config = json.loads((out / "config.json").read_text())["layerwise"]
    assert transformers.AutoConfig.from_pretrained(out).num_hidden_layers == 2
    assert (config["layers"], config["layers_kept"], config["read"], config["site"]) == (1, 2, "hidden_states[1]",
                                                                                         "raw")
    assert not config["vectors_see_final_norm"] and "hidden_states[1], before the final norm" in result.summary()
    # the source's layer 1 as plain transformers gives it (no norm), and the directory's hidden_states[1]
    src_hidden, _, _ = states(src, TEXTS)
    got_hidden, _, mask = states(out, TEXTS)
    real = mask.bool()
    assert (got_hidden[1][real] - src_hidden[1][real]).abs().max() <= 1e-5
    with torch.inference_mode():  # not the cut's block: the final norm changes the layer
        normed = plain(src).get_submodule(FINAL_NORMS[arch])(src_hidden[1])
    assert (normed[real] - src_hidden[1][real]).abs().max() > 1e-3
    # sentence-transformers reads it through WeightedLayerPooling (weights [1, 0]): layerwise's raw layer 1
    modules = [m["type"].rsplit(".", 1)[1] for m in json.loads((out / "modules.json").read_text())]
    assert modules == ["Transformer", "WeightedLayerPooling", "Pooling"]
    vectors = SentenceTransformer(str(out), device="cpu").encode(TEXTS)
    expected = (last_pool if pool == "last" else mean_pool)(src_hidden[1], mask)
    assert cosines(vectors, expected).min() >= 0.99999
    assert np.allclose(np.linalg.norm(vectors, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)
    ours = lw.Extractor(str(src), device="cpu").encode(TEXTS, layers=1, site="raw", pool=pool, truncate=True)
    assert np.abs(vectors - ours).max() < 1e-4


FACTS = dict(architecture="bert", model_type="bert", num_layers=6, final_norm=None, conv_after_first=False,
             layer_path="encoder.layer", encoder_decoder=False, encoder_class=None, albert_groups=(1, 1), window=128)


def test_plan_refusals_from_facts():
    spec = lw.EncodeSpec(layers=3, truncate=True)
    with pytest.raises(lw.SpecError, match="encoder-decoder.*T5EncoderModel"):
        plan_export(spec, ModelFacts(**{**FACTS, "model_type": "bart", "encoder_decoder": True}))
    with pytest.raises(lw.SpecError, match="2 layer groups"):
        plan_export(spec, ModelFacts(**{**FACTS, "architecture": "albert", "albert_groups": (2, 1)}))
    raw = plan_export(lw.EncodeSpec(layers=[2, 4], combine="sum", site="raw"),
                      ModelFacts(**{**FACTS, "final_norm": "norm"}))
    assert (raw.depth, raw.kept, raw.mix_start, raw.mix_weights, raw.norm_added, raw.vectors_normed) == (
        4, 5, 2, (1.0, 0.0, 1.0, 0.0), True, False)
    with pytest.raises(lw.SpecError, match=r"site 'raw' of the last layer.*below 6 \(--layers 5 --site raw\)"):
        plan_export(lw.EncodeSpec(layers=6, site="raw"), ModelFacts(**{**FACTS, "final_norm": "norm"}))
    with pytest.raises(lw.SpecError, match=r"raw of layers below 6 \(the directory"):  # a mix: no one-layer advice
        plan_export(lw.EncodeSpec(layers=[2, 6], site="raw"), ModelFacts(**{**FACTS, "final_norm": "norm"}))
    with pytest.raises(lw.SpecError, match="layer 1 cannot be written as a deberta-v2"):
        plan_export(lw.EncodeSpec(layers="1:3", site="raw"), ModelFacts(**{**FACTS, "conv_after_first": True}))
    with pytest.raises(lw.SpecError, match="skip_special_tokens"):
        plan_export(lw.EncodeSpec(layers=3, skip_special_tokens=True), ModelFacts(**FACTS))
    with pytest.raises(lw.SpecError, match="level='token'"):
        plan_export(lw.EncodeSpec(layers=3, level="token"), ModelFacts(**FACTS))
    plan = plan_export(lw.EncodeSpec(layers=[2, 4], combine="sum"), ModelFacts(**{**FACTS, "final_norm": "norm"}))
    assert (plan.depth, plan.kept, plan.mix_start, plan.mix_weights, plan.scale, plan.norm_added) == (
        4, 4, 2, (1.0, 0.0, 1.0), 0.5, True)
    mean = plan_export(lw.EncodeSpec(layers=[2, 4], combine="mean"), ModelFacts(**FACTS))
    assert (mean.mix_scale, mean.scale, mean.norm_added) == (1.0, 1.0, False)  # WeightedLayerPooling is a mean
    weighted = plan_export(lw.EncodeSpec(layers=[2, 3], combine="weighted", weights=[1, 3], pool="pooler"),
                           ModelFacts(**{**FACTS, "pooler": "pooler.dense"}))
    assert (weighted.mix_scale, weighted.scale) == (0.25, 1.0)  # the pooler's dense weights make up for the 1/4


def test_the_output_is_never_a_directory_the_user_wrote(arch_dirs, tmp_path):
    src = str(arch_dirs["bert"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(lw.ExportError, match="did not write"):
        lw.export_model(mine, src, layers=1)
    assert (mine / "notes.txt").read_text() == "mine" and len(list(mine.iterdir())) == 1
    (tmp_path / "file").write_text("x")
    with pytest.raises(lw.ExportError, match="is a file"):
        lw.export_model(tmp_path / "file", src, layers=1)
    first = lw.export_model(tmp_path / "out", src, layers=1)
    with pytest.raises(lw.ExportError, match="overwrite"):
        lw.export_model(tmp_path / "out", src, layers=2)
    second = lw.export_model(tmp_path / "out", src, layers=2, overwrite=True)
    assert (first.report["export"]["layers"], second.report["export"]["layers"]) == (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "out"]  # no partial or replaced copies
    (tmp_path / "out" / "README.md").write_text("my model card")  # the user's own file in an export: kept
    with pytest.raises(lw.ExportError, match=r"files it did not write \(README.md\)"):
        lw.export_model(tmp_path / "out", src, layers=1, overwrite=True)
    assert (tmp_path / "out" / "README.md").read_text() == "my model card"


def test_a_failed_check_leaves_nothing_and_says_the_numbers(arch_dirs, tmp_path, monkeypatch):
    # real damage: weights rounded to float16 on the way out, as a careless export would
    import layerwise.cut.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "exact_dtype", lambda model: torch.float16)
    with pytest.raises(lw.ExportError, match=r"transformers BertModel: max \|diff\| [0-9.e+-]+ \(bound 1e-05"):
        lw.export_model(tmp_path / "out", str(arch_dirs["bert"]), layers=1)
    assert list(tmp_path.iterdir()) == []


def test_a_bfloat16_checkpoint_stays_bfloat16(arch_dirs, tmp_path):
    model = transformers.AutoModel.from_pretrained(arch_dirs["bert"], dtype=torch.bfloat16)
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    transformers.AutoTokenizer.from_pretrained(arch_dirs["bert"]).save_pretrained(src)
    result = lw.export_model(tmp_path / "out", str(src), layers=1)
    assert result.report["export"]["weights_dtype"] == "bfloat16"
    with safe_open(str(result.directory / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys() if "LayerNorm" in n} == {torch.bfloat16}


def test_without_sentence_transformers_the_transformers_check_still_runs(arch_dirs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    result = lw.export_model(tmp_path / "out", str(arch_dirs["bert"]), layers=1)
    assert result.report["checks"]["sentence_transformers"] == {
        "checked": False, "why": "sentence-transformers is not installed (pip install sentence-transformers)"}
    assert result.passed and (result.directory / "modules.json").is_file()
    assert "not checked" in result.summary()


def test_cli_export_model(arch_dirs, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    res = runner.invoke(app, ["export-model", str(arch_dirs["llama"]), "-o", str(out), "--layers", "1", "--pool",
                              "last", "--normalize"])
    assert res.exit_code == 0, res.output
    assert "LlamaModel: max |diff|" in res.output and "SentenceTransformer(" in res.output
    assert "--alias export='layers=1;pool=last;normalize=true'" in res.output
    assert json.loads((out / "layerwise-export.json").read_text())["export"]["spec"]["pool"] == "last"
    assert "WeightedLayerPooling" not in res.output  # a one-layer block export is what any server reads
    raw = runner.invoke(app, ["export-model", str(arch_dirs["llama"]), "-o", str(tmp_path / "raw"), "--layers", "1",
                              "--site", "raw"])
    assert raw.exit_code == 0, raw.output
    assert "before the final norm" in raw.output and "not with a server that pools the last state" in raw.output
    twice = runner.invoke(app, ["export-model", str(arch_dirs["bert"]), "--model", str(arch_dirs["bert"]), "-o",
                                str(tmp_path / "x"), "--layers", "1"])
    assert twice.exit_code == 2 and "given twice" in twice.output
    refused = runner.invoke(app, ["export-model", "-m", str(arch_dirs["bert"]), "-o", str(tmp_path / "y"), "--layers",
                                  "0:", "--combine", "concat"])
    assert refused.exit_code == 2 and "Valid mixes for export are: mean, sum, weighted" in refused.output


def test_layerwise_serve_gives_the_exported_layer_to_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
    from tiny import serving

    result = lw.export_model(tmp_path / "minilm-l3", layers=3, normalize=True)
    want = SentenceTransformer(str(result.directory), device="cpu").encode(TEXTS)
    with serving(result.directory, tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        got = client.embeddings.create(model="minilm-l3", input=TEXTS, encoding_format="float")
    assert np.abs(np.array([d.embedding for d in got.data]) - want).max() < 1e-5


def test_what_an_interrupted_export_left_is_cleaned_and_memory_is_checked_first(arch_dirs, tmp_path, monkeypatch):
    import subprocess

    import layerwise.cut.checkpoint as checkpoint

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.partial-{gone.stdout.strip()}"  # a killed export's half-written directory
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    mine = tmp_path / ".out.partial-notes"  # not a pid: not layerwise's, kept
    mine.mkdir()
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 1000)
    with pytest.raises(lw.LayerwiseError, match=r"loads it again .* MiB of memory is available"):
        lw.export_model(tmp_path / "out", str(arch_dirs["bert"]), layers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial-notes"]


def test_the_result_shows_in_a_notebook_escaped(arch_dirs, tmp_path):
    result = lw.export_model(tmp_path / "<b>out", str(arch_dirs["bert"]), layers=1)
    html = result._repr_html_()
    assert "&lt;b&gt;out" in html and "<b>out" not in html and "max |diff|" in html and "<script" not in html


@pytest.mark.parametrize("arch", ("bert", "albert", "mpnet"))
def test_the_pooler_is_cls_and_a_dense_module(arch, arch_dirs, tmp_path):
    src = arch_dirs[arch]
    result = lw.export_model(tmp_path / "out", str(src), layers=1, pool="pooler")
    modules = json.loads((result.directory / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Dense"]
    got = SentenceTransformer(str(result.directory), device="cpu").encode(TEXTS)
    # plain transformers on the cut: its own pooler_output, which is tanh(dense(layer 1's first token))
    tok = transformers.AutoTokenizer.from_pretrained(result.directory)
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = plain(result.directory)(**{k: enc[k] for k in ("input_ids", "attention_mask")}).pooler_output
    assert cosines(got, want.numpy()).min() >= 0.99999
    hidden, _, _ = states(src, TEXTS)
    source = plain(src)
    with torch.inference_mode():
        dense = source.pooler if arch == "albert" else source.pooler.dense
        by_hand = torch.tanh(dense(hidden[1][:, 0]))
    assert cosines(got, by_hand.numpy()).min() >= 0.99999


def deeper(src, out, layers: int = 4):
    """A tiny random model like ``src`` with ``layers`` layers (the tiny ones have 2: a cut needs more)."""
    config = transformers.AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    torch.manual_seed(1)
    model = transformers.AutoModel.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def test_a_weighted_mix_of_a_cut_decoder_keeps_its_scale_and_the_final_norm(arch_dirs, tmp_path):
    src = deeper(arch_dirs["gpt2"], tmp_path / "gpt2-4")
    result = lw.export_model(tmp_path / "out", str(src), layers=[1, 2], combine="weighted", weights=[1.0, 3.0])
    assert result.report["export"]["scale"] == 0.25 and result.report["export"]["final_norm_added"]
    assert json.loads((result.directory / "config.json").read_text())["n_layer"] == 2
    hidden, _, mask = states(src, TEXTS)  # the 4-layer source: hidden_states[2] has no norm; the cut runs ln_f
    with torch.inference_mode():
        mix = (hidden[1] + 3 * plain(src).ln_f(hidden[2])) / 4
    got = SentenceTransformer(str(result.directory), device="cpu").encode(TEXTS)
    assert np.abs(got - mean_pool(mix, mask)).max() < 1e-4 * np.abs(got).max()


def test_a_prompt_is_the_default_prompt(arch_dirs, tmp_path):
    src = arch_dirs["bert"]
    result = lw.export_model(tmp_path / "out", str(src), layers=1, prompt="query: ")
    hidden, _, mask = states(src, ["query: " + t for t in TEXTS])
    got = SentenceTransformer(str(result.directory), device="cpu").encode(TEXTS)
    assert cosines(got, mean_pool(hidden[1], mask)).min() >= 0.99999
    assert result.serve_alias == 'layers=1;pool=mean;normalize=false;prompt="query: "'


def test_the_pooler_after_a_weighted_mix_is_layerwise_s(arch_dirs, tmp_path):
    src = arch_dirs["bert"]
    result = lw.export_model(tmp_path / "out", str(src), layers=[1, 2], combine="weighted", weights=[1.0, 3.0],
                             pool="pooler")
    hidden, _, _ = states(src, TEXTS)
    with torch.inference_mode():
        want = torch.tanh(plain(src).pooler.dense((hidden[1] + 3 * hidden[2])[:, 0]))  # no division by 4
    got = SentenceTransformer(str(result.directory), device="cpu").encode(TEXTS)
    assert np.abs(got - want.numpy()).max() < 1e-5


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_cli_says_when_the_vectors_have_the_final_norm_added(arch, arch_dirs, tmp_path):
    """``export-model --layers 1`` of a decoder printed "max |diff| 0" while SentenceTransformer(out) differed from
    ``Extractor.encode(layers=1)``: the cut runs the final norm after layer 1. The terminal says so, and how to get
    the raw state; a model without a final norm gets no such note."""
    out = tmp_path / "cut"
    res = CliRunner().invoke(app, ["export-model", str(arch_dirs[arch]), "-o", str(out), "--layers", "1", "--pool",
                                   "last" if arch == "gpt2" else "mean"])
    assert res.exit_code == 0, res.output
    said = " ".join(res.stderr.split())
    if arch == "bert":
        assert "final norm" not in said
        return
    assert "note: these vectors are layer 1 followed by the final norm 'ln_f'" in said, said
    assert "layerwise encode --layers 1 and Extractor.encode(layers=1) give layer 1 without the norm" in said
    assert "export --site raw" in said
    # what the note says is true: the directory's vectors are not layerwise's layer 1, and --site raw's are
    ex = lw.Extractor(str(arch_dirs[arch]), device="cpu")
    mine = ex.encode(TEXTS, layers=1, pool="last")
    st = SentenceTransformer(str(out), device="cpu").encode(TEXTS)
    assert cosines(st, mine).min() < 0.999
    raw = tmp_path / "raw"
    res = CliRunner().invoke(app, ["export-model", str(arch_dirs[arch]), "-o", str(raw), "--layers", "1", "--pool",
                                   "last", "--site", "raw"])
    assert res.exit_code == 0, res.output
    assert "note: these vectors" not in res.stderr
    assert cosines(SentenceTransformer(str(raw), device="cpu").encode(TEXTS), mine).min() >= 0.99999
