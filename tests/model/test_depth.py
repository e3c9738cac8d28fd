"""Loading by depth (issue 36): only the blocks a question needs are read, deeper questions load the rest, a bf16
checkpoint stays bf16 in memory while the states stay float32-exact, a model larger than ``max_memory`` runs block by
block, and the memory check refuses what cannot fit, with its numbers.

Models: the tiny random configs of ``tests/archs.py`` rebuilt with 4 layers and saved in several safetensors shards
with an index (as large checkpoints are), checked against plain transformers with ``output_hidden_states=True``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel

import layerwise as lw
from archs import ALL, ARCHS
from layerwise.errors import ModelLoadError

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "layers all the way down, one at a time"]
DEPTH = 4
TOL = 1e-5


def _model_class(name: str):
    cls_name = ARCHS[name][4] if name in ARCHS else "AutoModel"
    return AutoModel if cls_name == "AutoModel" else getattr(transformers, cls_name)


def deeper(source: Path, target: Path, name: str, layers: int = DEPTH, dtype: torch.dtype = torch.float32,
           seed: int = 1) -> Path:
    """``source``'s architecture rebuilt with ``layers`` layers (random weights), saved in shards with an index."""
    data = AutoConfig.from_pretrained(source).to_dict()
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in data:
            data[key] = layers
    if isinstance(data.get("layer_types"), list):  # the same pattern of attention kinds, repeated
        kinds = data["layer_types"]
        data["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    config = type(AutoConfig.from_pretrained(source)).from_dict(data)
    torch.manual_seed(seed)
    cls = _model_class(name)
    model = cls.from_config(config) if cls is AutoModel else cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    target.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(target, max_shard_size="60KB")
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "spiece", "merges")):
            (target / f.name).write_bytes(f.read_bytes())
    return target


def reference(directory: Path, name: str, texts: list[str], ex: lw.Extractor) -> torch.Tensor:
    """``[L + 1, batch, tokens, hidden]`` from plain transformers in float32 on the batch layerwise pads."""
    model = _model_class(name).from_pretrained(directory, dtype=torch.float32).eval()
    enc = ex.tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True)
    return torch.stack(out.hidden_states), enc["attention_mask"].bool()


def _close(got: torch.Tensor, want: torch.Tensor, keep: torch.Tensor) -> float:
    scale = max(1.0, float(want[:, keep].abs().max()))
    return float((got[:, keep] - want[:, keep]).abs().max()) / scale


@pytest.fixture(scope="module")
def deep_dirs(arch_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deep")
    return {name: deeper(arch_dirs[name], root / name, name) for name in ALL if name != "albert"}


@pytest.mark.parametrize("name", [n for n in ALL if n != "albert"])
def test_layer_by_depth_equals_transformers_and_grows(deep_dirs, name):
    directory = deep_dirs[name]
    assert len(list(directory.glob("*.safetensors"))) > 1 and (directory / "model.safetensors.index.json").is_file()
    ex = lw.Extractor(directory, backend="torch")
    blocks = ex.loaded.blocks
    assert blocks is not None, f"{name} was loaded whole"
    assert blocks.resident == 1 and ex.num_layers == DEPTH
    assert ex.describe()["weights"]["resident_blocks"] == 1
    want, keep = reference(directory, name, TEXTS, ex)
    got = ex.hidden_states(TEXTS, layers=1).tensor
    assert blocks.resident == 1, "layer 1 loaded more than block 0"
    assert _close(got, want[1:2], keep) <= TOL
    got = ex.hidden_states(TEXTS, layers="all").tensor  # a deeper call loads the rest
    assert blocks.resident == DEPTH
    assert _close(got, want, keep) <= TOL


@pytest.mark.parametrize("name", [n for n in ALL if n != "albert"])
def test_bf16_checkpoint_is_held_in_bf16_and_computes_exactly(arch_dirs, tmp_path, name):
    directory = deeper(arch_dirs[name], tmp_path / name, name, dtype=torch.bfloat16)
    ex = lw.Extractor(directory, backend="torch")
    assert ex.describe()["weights"]["held_dtype"] == "bfloat16"
    assert ex.loaded.dtype == torch.float32
    block = ex.loaded.layer_map.layers[0]  # its matrices (transformers keeps a few biases in float32 for some models)
    assert {p.dtype for p in block.parameters() if p.dim() >= 2} == {torch.bfloat16}
    want, keep = reference(directory, name, TEXTS, ex)
    got = ex.hidden_states(TEXTS, layers="all").tensor
    assert got.dtype == torch.float32
    assert _close(got, want, keep) <= TOL
    assert {p.dtype for p in ex.loaded.layer_map.layers[-1].parameters() if p.dim() >= 2} == {torch.bfloat16}


@pytest.mark.parametrize("name", [n for n in ALL if n != "albert"])
def test_streaming_equals_in_memory_at_every_layer(deep_dirs, name):
    directory = deep_dirs[name]
    whole = lw.Extractor(directory, backend="torch")
    budget = f"{whole.describe()['weights']['weights_bytes']}B"  # the trunk and block 0: deeper blocks are streamed
    streamed = lw.Extractor(directory, backend="torch", max_memory=budget)
    assert streamed.loaded.streams(DEPTH)
    want = whole.hidden_states(TEXTS, layers="all").tensor
    got = streamed.hidden_states(TEXTS, layers="all").tensor
    assert streamed.loaded.blocks.resident == 1, "streaming loaded blocks for good"
    assert float((got - want).abs().max()) <= TOL * max(1.0, float(want.abs().max()))
    a = whole.encode(TEXTS * 5, layers=[1, 3], combine="concat", pool="mean")
    b = streamed.encode(TEXTS * 5, layers=[1, 3], combine="concat", pool="mean")
    assert abs(a - b).max() <= TOL * max(1.0, abs(a).max())
    if "attention" in whole.sites:
        a = whole.hidden_states(TEXTS, layers=[2], site="attention").tensor
        b = streamed.hidden_states(TEXTS, layers=[2], site="attention").tensor
        assert float((a - b).abs().max()) <= TOL * max(1.0, float(a.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host", ["kept", "staged"])
@pytest.mark.parametrize("name", [n for n in ALL if n != "albert"])
def test_gpu_streaming_equals_in_memory(arch_dirs, tmp_path, monkeypatch, name, host, dtype):  # pragma: no cover
    """On a GPU, blocks past max_memory come through pinned host memory on a copy stream, the next block moving
    while the current one runs: equal to the model held on the GPU, chunk after chunk, from kept pinned copies or
    from the checkpoint through two staging buffers."""
    from layerwise.model import transfer

    if host == "staged":
        monkeypatch.setattr(transfer, "HOST_SHARE", 0.0)
    directory = deeper(arch_dirs[name], tmp_path / name, name, layers=6, dtype=dtype)
    whole = lw.Extractor(directory, backend="torch", device="cuda")
    budget = f"{whole.describe()['weights']['weights_bytes']}B"  # the trunk and block 0: blocks 1..5 stream
    streamed = lw.Extractor(directory, backend="torch", device="cuda", max_memory=budget)
    assert streamed.loaded.streams(6) and streamed.loaded.blocks.resident == 1
    want = whole.hidden_states(TEXTS, layers="all").tensor
    read = []
    for chunk in range(2):  # the second chunk streams from the kept pinned copies (or the staging buffers again)
        got = streamed.hidden_states(TEXTS, layers="all").tensor
        assert streamed.loaded.blocks.resident == 1
        assert float((got - want).abs().max()) <= TOL * max(1.0, float(want.abs().max())), chunk
        read.append(streamed.describe()["weights"]["transfer"]["bytes_read"])
    feed = streamed.describe()["weights"]["transfer"]
    # in every chunk, blocks 2..5 (4 of the 5 streamed) were moving while their predecessor ran
    assert feed["taken"] > 0 and feed["prefetched"] * 5 == feed["taken"] * 4
    assert feed["host"].startswith("pinned copies kept" if host == "kept" else "read from the checkpoint")
    assert read[0] > 0 and read[1] == (read[0] if host == "kept" else 2 * read[0])  # read once, or once per chunk
    assert feed["bytes_to_gpu"] >= 2 * read[0]
    a = whole.encode(TEXTS * 7, layers=[2, 5], combine="concat", pool="mean")
    b = streamed.encode(TEXTS * 7, layers=[2, 5], combine="concat", pool="mean")
    assert abs(a - b).max() <= TOL * max(1.0, abs(a).max())


def test_max_layer_bounds_the_model(deep_dirs):
    ex = lw.Extractor(deep_dirs["llama"], backend="torch", max_layer=2)
    assert ex.loaded.blocks.resident == 2
    ex.encode(TEXTS, layers=2)
    with pytest.raises(ModelLoadError, match=r"max_layer=2.*layers 0\.\.2"):
        ex.encode(TEXTS, layers=3)
    with pytest.raises(ModelLoadError, match=r"max_layer=9 is out of range.*0\.\.4"):
        lw.Extractor(deep_dirs["llama"], backend="torch", max_layer=9)
    with pytest.raises(ModelLoadError, match="units"):
        lw.ModelOptions(max_memory="four gigabytes")
    with pytest.raises(ModelLoadError, match=r"max_memory=4 is 4 bytes.*Did you mean '4GB'"):
        lw.ModelOptions(max_memory=4)
    budget = f"{lw.Extractor(deep_dirs['llama'], backend='torch').describe()['weights']['weights_bytes']}B"
    bounded = lw.Extractor(deep_dirs["llama"], backend="torch", max_layer=1, max_memory=budget)
    with pytest.raises(ModelLoadError, match=r"max_layer=1"):  # a bound holds under max_memory too
        bounded.encode(TEXTS, layers=3)


def test_options_that_cannot_apply_are_said(arch_dirs):
    with pytest.warns(UserWarning, match=r"max_layer=1 not applied: this model is loaded whole because ALBERT"):
        ex = lw.Extractor(arch_dirs["albert"], backend="torch", max_layer=1)
    assert ex.loaded.blocks is None and ex.describe()["weights"]["loaded"] == "whole"


def test_direct_call_of_the_module_loads_every_block(deep_dirs):
    ex = lw.Extractor(deep_dirs["gpt2"], backend="torch")
    enc = ex.tokenizer(TEXTS, return_tensors="pt", padding=True)
    out = ex.model(**enc, output_hidden_states=True)
    assert len(out.hidden_states) == DEPTH + 1 and ex.loaded.blocks.resident == DEPTH


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_is_the_whole_models(arch_dirs, tmp_path, dtype):
    from layerwise.provenance import tensors_fingerprint

    directory = deeper(arch_dirs["bert"], tmp_path / "bert", "bert", dtype=dtype)
    ex = lw.Extractor(directory, backend="torch")
    assert ex.loaded.blocks.resident == 1
    whole = AutoModel.from_pretrained(directory, dtype=torch.float32)
    assert ex.fingerprint() == tensors_fingerprint(whole.state_dict())
    ex.encode(TEXTS, layers=3)
    assert ex.loaded.fingerprint() == tensors_fingerprint(whole.state_dict())  # after growing, too
    assert ex.loaded.blocks.resident == 3, "the fingerprint loaded blocks"


# ---- memory, measured in fresh processes -----------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import json, resource, sys
    import layerwise as lw
    import torch, transformers, layerwise.extractor, layerwise.model.loading  # imported before the limit
    from layerwise.errors import ModelLoadError
    path, layer, limit, max_layer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if limit:  # the limit this test sets: the data segment this process may still grow by
        used = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData:")][0]
        resource.setrlimit(resource.RLIMIT_DATA, (used + limit, resource.RLIM_INFINITY))
    try:
        ex = lw.Extractor(None if path == "-" else path, backend="torch",
                          max_layer=None if max_layer == "-" else int(max_layer))
        ex.encode(["the quick brown fox", "hello world"], layers=layer, pool="mean")
        out = {"ok": True}
    except ModelLoadError as exc:
        out = {"ok": False, "error": str(exc)}
    out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))
""")


def _child(path: str, layer: int, limit: int = 0, max_layer: str = "-") -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", _CHILD, path, str(layer), str(limit), max_layer],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wide_bert(tmp_path_factory, arch_dirs) -> tuple[Path, int, int]:
    """A 24-layer BERT of hidden 512 (about 12.6 MB a block in float32), saved in shards; (dir, block, whole) bytes."""
    source = arch_dirs["bert"]
    target = tmp_path_factory.mktemp("wide")
    config = transformers.BertConfig(vocab_size=AutoConfig.from_pretrained(source).vocab_size, hidden_size=512,
                                     num_hidden_layers=24, num_attention_heads=8, intermediate_size=2048,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    model.save_pretrained(target, max_shard_size="50MB")
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab")):
            (target / f.name).write_bytes(f.read_bytes())
    block = sum(p.numel() * 4 for p in model.encoder.layer[0].parameters())
    whole = sum(p.numel() * 4 for p in model.parameters())
    return target, block, whole


OVERHEAD = 96 * 2**20  # what a second model's own tokenizer, activations and allocator slack may add, stated here


def test_peak_memory_follows_the_layer_asked_for(wide_bert):
    directory, block, whole = wide_bert
    baseline = _child("-", 1)["peak"]  # the default model's own process: python, torch, transformers, layer 1
    got = _child(str(directory), 1)
    assert got["ok"]
    embeddings = whole - 24 * block  # embeddings and pooler
    bound = baseline + embeddings + block + OVERHEAD
    assert bound < baseline + whole, "the bound cannot tell depth loading from a whole load"
    assert got["peak"] <= bound, (f"layer 1 of 24 peaked at {got['peak'] / 2**20:.0f} MiB; bound "
                                  f"{bound / 2**20:.0f} MiB (default model's process {baseline / 2**20:.0f} MiB)")


_REFUSE = textwrap.dedent("""
    import json, resource, sys
    import layerwise as lw
    from layerwise.errors import ModelLoadError
    ex = lw.Extractor(sys.argv[1], backend="torch")
    ex.encode(["the quick brown fox"], layers=1)  # block 0; the tokenizer's and torch's threads exist from here
    used = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData:")][0]
    resource.setrlimit(resource.RLIMIT_DATA, (used + int(sys.argv[2]), resource.RLIM_INFINITY))  # the test's limit
    try:
        ex.encode(["the quick brown fox"], layers=24)
        print(json.dumps({"ok": True}))
    except ModelLoadError as exc:
        print(json.dumps({"ok": False, "error": str(exc), "resident": ex.loaded.blocks.resident}))
""")


def test_memory_check_refuses_with_its_numbers(wide_bert):
    directory, block, whole = wide_bert
    done = subprocess.run([sys.executable, "-c", _REFUSE, str(directory), str(whole // 2)], capture_output=True,
                          text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = json.loads(done.stdout.strip().splitlines()[-1])
    assert not refused["ok"] and refused["resident"] == 1, refused
    assert "blocks 1..23" in refused["error"] and "RLIMIT_DATA" in refused["error"], refused["error"]
    assert " MB" in refused["error"] and "max_memory" in refused["error"] and "shallower" in refused["error"]


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import layerwise as lw
    path, corpus, store, budget = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    die = lambda n: os.kill(os.getpid(), signal.SIGKILL) if n == 2 else None  # after the second shard
    lw.extract(corpus, store, lw.EncodeSpec(layers=[1, 4], combine="concat", pool="mean"),
               model=lw.Extractor(path, backend="torch", max_memory=budget), on_shard=die,
               options=lw.ExtractOptions(shard_records=4, batch_tokens=64, progress=False))
""")


def test_streamed_extract_killed_and_resumed_equals_in_memory(deep_dirs, tmp_path):
    import numpy as np

    from tiny import extract

    directory = deep_dirs["llama"]
    texts = [" ".join(["layer", "by", "layer"] * (1 + i % 5)) + f" record {i}" for i in range(22)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    whole = lw.Extractor(directory, backend="torch")
    budget = f"{whole.describe()['weights']['weights_bytes']}B"
    clean = tmp_path / "clean"
    extract(corpus, clean, model=whole, layers=[1, 4], combine="concat", pool="mean", shard_records=4,
            batch_tokens=64, progress=False)
    store = tmp_path / "streamed"
    done = subprocess.run([sys.executable, "-c", _KILLED, str(directory), str(corpus), str(store), str(budget)],
                          capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    before = lw.open_store(store)
    assert not before.complete and len(before) == 8
    streamed = lw.Extractor(directory, backend="torch", max_memory=budget)
    assert streamed.loaded.streams(4)
    summary = extract(corpus, store, model=streamed, layers=[1, 4], combine="concat", pool="mean",
                      shard_records=4, batch_tokens=64, progress=False)
    assert summary.status == "complete" and summary.resumed_from == 8
    np.testing.assert_allclose(lw.open_store(store).to_numpy(), lw.open_store(clean).to_numpy(), atol=1e-5, rtol=0)


def test_cli_max_layer_and_max_memory(deep_dirs):
    import numpy as np
    from typer.testing import CliRunner

    from layerwise.cli.main import app

    runner = CliRunner()
    model = ["--model", str(deep_dirs["gpt2"]), "--device", "cpu", "--backend", "torch"]
    base = ["encode", *TEXTS, "--layers", "3", "--pool", "mean", "--format", "json"]
    want = json.loads(runner.invoke(app, [*base, *model]).stdout)["vectors"]
    budget = f"{lw.Extractor(deep_dirs['gpt2'], backend='torch').describe()['weights']['weights_bytes']}B"
    got = runner.invoke(app, [*base, *model, "--max-memory", budget])
    assert got.exit_code == 0, got.output
    np.testing.assert_allclose(json.loads(got.stdout)["vectors"], want, atol=1e-5, rtol=0)
    refused = runner.invoke(app, [*base, *model, "--max-layer", "2"])
    assert refused.exit_code == 2 and "max_layer=2" in " ".join(refused.stderr.split()), refused.output
    bad = runner.invoke(app, [*base, *model, "--max-memory", "lots"])
    assert bad.exit_code == 2 and "units" in " ".join(bad.stderr.split()), bad.output


def test_a_streamed_chunk_says_where_it_is(deep_dirs, monkeypatch, capsys):
    from layerwise.model import capture

    directory = deep_dirs["bert"]
    budget = f"{lw.Extractor(directory, backend='torch').describe()['weights']['weights_bytes']}B"
    streamed = lw.Extractor(directory, backend="torch", max_memory=budget)
    monkeypatch.setattr(capture, "PROGRESS_S", 0.0)  # every block says it (10 s apart in a real run)
    capsys.readouterr()
    streamed.hidden_states(TEXTS, layers="all")
    said = [line for line in capsys.readouterr().err.splitlines() if "block by block" in line]
    assert said and all(line.startswith("layerwise: streaming ") for line in said), said
    assert f"block 1 of {DEPTH}" in said[0] and f"block {DEPTH} of {DEPTH}" in said[-1], said
    assert "GB of weights read" in said[-1] and "s so far" in said[-1]
