"""``ModelOptions``: the one way every entry point takes a model. For each entry point (Python and CLI) and each
option, the option reaches the model loader; the options that show in a loaded model change it; JSON round trips,
and the names of layerwise 0.x (configs, manifests, requests) still load."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import layerwise as lw
import layerwise.extractor as lx
from layerwise.cli.main import app
from layerwise.heads import HeadConfig
from layerwise.model.options import LEGACY_FIELDS
from layerwise.serve import create_app

from tiny import pickle_only_copy

# every field away from its default
FULL = lw.ModelOptions(
    model="some/model-dir", device="cpu", compute_dtype="bfloat16", backend="torch", quantize="int8-full",
    quantize_calibration="calibration.txt", padding_side="left", layer_modules="encoder.layer", max_length=64,
    stride=8, allow_pickle=True, trust_remote_code=True, revision="main", tokenizer="tok-dir", onnx_cache="onnx-cache",
    max_layer=3, max_memory="4GB",
)
FLAGS = ["--model", "some/model-dir", "--device", "cpu", "--compute-dtype", "bfloat16", "--backend", "torch",
         "--quantize", "int8-full", "--quantize-calibration", "calibration.txt", "--padding-side", "left",
         "--layer-modules", "encoder.layer", "--max-length", "64", "--stride", "8", "--allow-pickle",
         "--trust-remote-code", "--revision", "main", "--tokenizer", "tok-dir", "--onnx-cache", "onnx-cache",
         "--max-layer", "3", "--max-memory", "4GB"]


class Loaded(Exception):
    """Raised by the recording loader: the entry point got as far as loading."""


@pytest.fixture
def seen(monkeypatch):
    """The options every load receives (the loader records them and stops)."""
    got: list[lw.ModelOptions] = []

    def record(options):
        got.append(options)
        raise Loaded

    monkeypatch.setattr(lx, "load_backend", record)
    return got


@pytest.fixture
def head(tmp_path):
    """A saved head's directory (config and an empty weights file: enough to reach the encoder's load)."""
    out = tmp_path / "head"
    out.mkdir()
    HeadConfig(labels=["x", "y"]).to_json(out / "config.json")
    (out / "head.safetensors").write_bytes(b"")
    return out


def test_every_field_is_a_flag_and_round_trips_json():
    fields = [f.name for f in dataclasses.fields(lw.ModelOptions)]
    flags = {FLAGS[i].removeprefix("--").replace("-", "_") for i in range(len(FLAGS)) if FLAGS[i].startswith("--")}
    assert set(fields) == flags  # the test's own lists cover every option
    assert lw.ModelOptions.from_json(FULL.to_json()) == FULL and FULL.replace() == FULL
    assert all(getattr(FULL, f) != getattr(lw.ModelOptions(), f) for f in fields)


def test_options_are_validated_with_the_valid_values():
    with pytest.raises(lw.ModelLoadError, match=r"unknown backend 'jax'. Valid backends are: auto, torch, onnx"):
        lw.ModelOptions(backend="jax")
    with pytest.raises(lw.ModelLoadError, match=r"unknown padding_side 'up'. Valid values are: right, left"):
        lw.ModelOptions(padding_side="up")
    with pytest.raises(lw.ModelLoadError, match=r"unknown model option\(s\) \['layers'\] \('layers' is now "
                                                r"'layer_modules'\)"):
        lw.Extractor(layers="h")
    with pytest.raises(lw.ModelLoadError, match=r"unknown ModelOptions field\(s\) \['colour'\]"):
        lw.ModelOptions.from_dict({"colour": "red"})
    assert lw.ModelOptions(quantize="none").quantize is None
    assert lw.ModelOptions(compute_dtype=torch.bfloat16).compute_dtype == "bfloat16"  # a torch dtype is its name


def test_names_of_layerwise_0x_still_load():
    assert LEGACY_FIELDS == {"dtype": "compute_dtype", "layers": "layer_modules"}
    old = lw.ModelOptions.from_dict({"model": "m", "dtype": "float16", "layers": "h"})
    assert (old.compute_dtype, old.layer_modules) == ("float16", "h")
    assert lw.EncodeSpec.from_dict({"layers": [1], "dtype": "float16"}).output_dtype == "float16"


def test_every_python_entry_point_passes_every_option(seen, tmp_path, head):
    src = tmp_path / "c.txt"
    src.write_text("one\ntwo\n")
    tsv = tmp_path / "t.tsv"
    tsv.write_text("text\tlabel\na\tx\nb\ty\n")
    calls = {
        "Extractor.from_options": lambda: lw.Extractor.from_options(FULL),
        "Extractor(**fields)": lambda: lw.Extractor(**FULL.to_dict()),
        "extract": lambda: lw.extract(src, tmp_path / "s", model=FULL),
        "heads.train (config)": lambda: lw.heads.train(HeadConfig(model=FULL), tsv, tsv),
        "heads.train (model=)": lambda: lw.heads.train(HeadConfig(), tsv, tsv, model=FULL),
        "heads.load": lambda: lw.heads.load(head, model=FULL),
        "probe.run": lambda: lw.probe.run(tsv, tsv, None, lw.probe.ProbeConfig(task="sentence"), model=FULL,
                                          output=tmp_path / "p"),
        "ray.extract (the driver, on its CPU)": lambda: lw.ray.extract(src, tmp_path / "r", model=FULL),
        "serve.create_app": lambda: create_app(FULL),
    }
    for name, call in calls.items():
        seen.clear()
        with pytest.raises(Loaded):
            call()
        want = FULL.replace(device="cpu") if name.startswith("ray") else FULL
        assert seen == [want], name


@pytest.mark.parametrize("command", ["demo", "encode", "extract", "serve", "explore", "train", "probe", "predict",
                                     "evaluate"])
def test_every_cli_command_that_loads_a_model_passes_every_flag(seen, tmp_path, head, command):
    src = tmp_path / "c.tsv"
    src.write_text("text\tlabel\na\tx\nb\ty\n")
    args = {
        "demo": [], "encode": ["hello"], "extract": [str(src), "-o", str(tmp_path / "s")], "serve": [],
        "explore": [], "train": ["--train", str(src), "--dev", str(src), "-o", str(tmp_path / "m")],
        "probe": ["--train", str(src), "--dev", str(src), "--task", "sentence", "-o", str(tmp_path / "p")],
        "predict": [str(head), str(src)], "evaluate": [str(head), str(src)],
    }[command]
    CliRunner().invoke(app, [command, *args, *FLAGS])
    assert seen == [FULL], command


def test_options_that_show_in_a_loaded_model(tiny_dirs, tiny_extractors, tmp_path):
    path = str(tiny_dirs["bert"])
    base = tiny_extractors["bert"]
    texts = ["EU rejects German call", "a b"]
    ex = lw.Extractor.from_options(lw.ModelOptions(path, device="cpu", backend="torch", compute_dtype="bfloat16",
                                                   layer_modules="encoder.layer", max_length=32, stride=4))
    d = ex.describe()
    assert (d["backend"], d["compute_dtype"], d["layer_map"], d["window"], d["stride"]) == (
        "torch", "bfloat16", "encoder.layer (given)", 32, 4)
    left = lw.Extractor(str(tiny_dirs["roberta"]), device="cpu", padding_side="left")  # positions follow the mask
    assert left.describe()["padding_side"] == "left"
    assert ex.options.compute_dtype == "bfloat16" and ex.options.backend == "torch"
    q = lw.Extractor(path, device="cpu", quantize="int8", onnx_cache=str(tmp_path / "graphs"))
    assert q.backend.precision in ("int8", "int8-weights") and q.options.quantize == "int8"
    assert not np.allclose(q.encode(texts), base.encode(texts), atol=1e-5)  # int8 changes the features
    assert list((tmp_path / "graphs").rglob("*.onnx"))  # the graphs went to the cache given
    with pytest.raises(lw.ModelLoadError, match="revision='main' selects a version of a hub repository"):
        lw.Extractor(path, revision="main")
    pickled = pickle_only_copy(tiny_dirs["bert"], tmp_path / "pickled")
    with pytest.raises(lw.ModelLoadError, match="allow_pickle=True"):
        lw.Extractor(str(pickled), device="cpu")
    assert lw.Extractor(str(pickled), device="cpu", allow_pickle=True).num_layers == base.num_layers


def test_a_backend_refuses_an_option_it_does_not_honour(tiny_extractors):
    loaded = tiny_extractors["bert"].loaded
    with pytest.raises(lw.ModelLoadError, match=r"quantize='int8' runs through OpenVINO or ONNX Runtime: use "
                                                r"backend='auto'"):
        lw.Extractor(loaded, backend="torch", quantize="int8")
    with pytest.raises(lw.ModelLoadError, match=r"tokenizer= goes with backend='tf'"):
        lw.Extractor(loaded, tokenizer="somewhere")
    with pytest.raises(lw.ModelLoadError, match=r"onnx_cache='x' is where backend='auto'/'onnx' keep"):
        lw.Extractor(loaded, backend="torch", onnx_cache="x")


def test_a_store_records_its_model_options(tiny_extractors, tmp_path):
    from tiny import extract

    src = tmp_path / "c.txt"
    src.write_text("one\ntwo\n")
    extract(src, tmp_path / "s", model=tiny_extractors["bert"], layers=-1)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert lw.ModelOptions.from_dict(manifest["model_options"]) == tiny_extractors["bert"].options
    assert manifest["model_options"]["backend"] == "auto" and manifest["model"]["precision"] == "float32"


def test_dtype_is_taken_as_transformers_names_the_compute_dtype(tiny_dirs):
    import torch

    ex = lw.Extractor(str(tiny_dirs["bert"]), device="cpu", backend="torch", dtype="bfloat16")
    assert ex.options.compute_dtype == "bfloat16" and ex.loaded.dtype == torch.bfloat16
    assert lw.ModelOptions.of(None, torch_dtype=torch.float16).compute_dtype == "float16"
    with pytest.raises(lw.ModelLoadError, match=r"dtype='bfloat16' and compute_dtype='float32' name the same option"):
        lw.Extractor(dtype="bfloat16", compute_dtype="float32")
