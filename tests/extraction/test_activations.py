"""Token activations for SAE trainers (layerwise.extraction.activations): the stored values are the model's own
hidden states of each packed context, several layers and sites in one pass, every dtype within its bound, the bytes
on disk what the layout says, the store resumable to the same bytes, and the readers (the loader, a DataLoader with
two workers, SAELens) take it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import layerwise as lw
import sae_env
from layerwise.errors import ExtractError, SpecError, StoreError
from layerwise.store.activations import ActivationStore

from tiny import CORPUS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("acts") / "corpus.txt"
    lines = [CORPUS[i % len(CORPUS)] + f" number {i}" for i in range(120)]
    lines[7] = "   "  # a blank line: a bad record, logged and skipped
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def reference(ex, ids: np.ndarray, layers, site="block") -> list[np.ndarray]:
    """What plain transformers gives for the stored contexts: hidden_states (site block), else the Extractor's own
    capture of the site, each layer [contexts * N, W]."""
    t = torch.from_numpy(ids.astype(np.int64))
    if site == "block":
        with torch.no_grad():
            hs = ex.model(input_ids=t, attention_mask=torch.ones_like(t), output_hidden_states=True).hidden_states
        return [hs[k].reshape(-1, hs[k].shape[-1]).float().numpy() for k in layers]
    states = lw.capture(ex.loaded, t, torch.ones_like(t), layers, site)
    return [s.reshape(-1, s.shape[-1]).float().numpy() for s in states]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_float32_values_equal_output_hidden_states(name, arch_dirs, corpus, tmp_path):
    ex = lw.Extractor(str(arch_dirs[name]), device="cpu", backend="torch")
    out = tmp_path / "acts"
    summary = lw.extract_activations(corpus, out, layers=[0, 1, 2], context_size=16, model=ex, shard_bytes=8_000)
    acts = ActivationStore(out)
    assert summary.status == "complete" and summary.shards_written > 1 and summary.skipped == 1
    assert acts.num_contexts == summary.contexts and acts.layers == (0, 1, 2)
    ids = acts.token_ids()
    bos = ex.tokenizer.bos_token_id if ex.tokenizer.bos_token_id is not None else ex.tokenizer.cls_token_id
    assert (ids[:, 0] == bos).all()
    for k, ref in zip((0, 1, 2), reference(ex, ids, (0, 1, 2))):
        assert np.abs(acts.to_numpy(k) - ref).max() <= 1e-5
    errors = (out / "errors.jsonl").read_text().splitlines()
    assert len(errors) == 1 and json.loads(errors[0])["line"] == 8


@pytest.mark.parametrize("site", ["attention", "intermediate"])
def test_other_sites_are_the_extractors_capture(site, arch_dirs, corpus, tmp_path):
    ex = lw.Extractor(str(arch_dirs["gpt2"]), device="cpu", backend="torch")
    lw.extract_activations(corpus, tmp_path / "a", layers=[1, 2], site=site, context_size=8, model=ex)
    acts = ActivationStore(tmp_path / "a")
    assert acts.width == ex.site_width(site)
    for k, ref in zip((1, 2), reference(ex, acts.token_ids(), (1, 2), site)):
        assert np.abs(acts.to_numpy(k) - ref).max() <= 1e-5


def test_reduced_dtypes_stay_within_their_bounds_and_say_float8s(arch_dirs, corpus, tmp_path):
    ex = lw.Extractor(str(arch_dirs["gpt2"]), device="cpu", backend="torch")
    refs = None
    for dtype, bound in (("float16", 0.99999), ("bfloat16", 0.9999), ("float8", 0.99)):
        out = tmp_path / dtype
        summary = lw.extract_activations(corpus, out, layers=[1, 2], context_size=16, dtype=dtype, model=ex)
        acts = ActivationStore(out)
        refs = refs or reference(ex, acts.token_ids(), (1, 2))
        for k, ref in zip((1, 2), refs):
            assert cosines(acts.to_numpy(k), ref).min() >= bound, (dtype, k)
        if dtype == "float8":
            fid = acts.manifest["fidelity"]
            assert set(fid) == {"1", "2"} and all(f["tokens"] == acts.num_tokens for f in fid.values())
            got = cosines(acts.to_numpy(1), refs[0])
            assert fid["1"]["cosine_mean"] == pytest.approx(float(got.mean()), abs=1e-4)
            assert fid["1"]["cosine_min"] == pytest.approx(float(got.min()), abs=1e-4)
            assert summary.fidelity == fid
        # any safetensors reader gives the stored dtype
        shard = load_file(str(out / acts.entries[0]["file"]))
        want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}[dtype]
        assert shard["layer.1"].dtype == want and shard["token_ids"].shape == (acts.entries[0]["contexts"], 16)


def test_bytes_on_disk_are_tokens_times_layers_times_width_plus_ids_and_headers(arch_dirs, corpus, tmp_path):
    ex = lw.Extractor(str(arch_dirs["gpt2"]), device="cpu", backend="torch")
    out = tmp_path / "a"
    lw.extract_activations(corpus, out, layers=[0, 1, 2], context_size=16, dtype="bfloat16", model=ex)
    acts = ActivationStore(out)
    data = acts.num_tokens * 3 * acts.width * 2 + acts.num_tokens * 4
    shards = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
    assert shards == acts.nbytes
    assert 0 < shards - data < 2_000 * len(acts.entries)  # each shard's safetensors header


def test_an_interrupted_run_resumes_to_the_same_bytes(arch_dirs, corpus, tmp_path):
    ex = lw.Extractor(str(arch_dirs["llama"]), device="cpu", backend="torch")
    kw = dict(layers=[1, 2], context_size=8, dtype="bfloat16", model=ex, shard_bytes=4_000, batch_tokens=64)
    whole = tmp_path / "whole"
    lw.extract_activations(corpus, whole, **kw)
    part = tmp_path / "part"
    first = lw.extract_activations(corpus, part, max_contexts=40, **kw)
    assert first.status == "partial"
    # the last shard damaged: the resume checks every sha256 and recomputes from it
    last = part / ActivationStore(part).entries[-1]["file"]
    raw = bytearray(last.read_bytes())
    raw[-3] ^= 0xFF
    last.write_bytes(bytes(raw))
    again = lw.extract_activations(corpus, part, **kw)
    assert again.status == "complete" and again.resumed_from > 0 and any("sha256" in r for r in again.repairs)
    a, b = ActivationStore(whole), ActivationStore(part)
    assert a.num_contexts == b.num_contexts
    assert np.array_equal(a.token_ids(), b.token_ids())
    for k in (1, 2):
        assert np.array_equal(a.to_numpy(k), b.to_numpy(k))
    assert lw.extract_activations(corpus, part, **kw).status == "already_complete"
    assert b.verify() == []


def test_other_options_on_a_store_are_refused_and_bad_ones_named(arch_dirs, corpus, tmp_path):
    ex = lw.Extractor(str(arch_dirs["gpt2"]), device="cpu", backend="torch")
    out = tmp_path / "a"
    lw.extract_activations(corpus, out, layers=[1], context_size=8, model=ex)
    with pytest.raises(StoreError, match="context_size"):
        lw.extract_activations(corpus, out, layers=[1], context_size=16, model=ex)
    with pytest.raises(SpecError, match="float8"):
        lw.extract_activations(corpus, tmp_path / "b", layers=[1], dtype="int8", model=ex)
    with pytest.raises(ExtractError, match="window"):
        lw.extract_activations(corpus, tmp_path / "c", layers=[1], context_size=10_000, model=ex)
    with pytest.raises(StoreError, match="open_activations"):
        lw.open_store(out)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a layerwise token-activation store"):
        lw.extract_activations(corpus, tmp_path / "d", layers=[1], context_size=8, model=ex)


def test_a_model_larger_than_memory_runs_block_by_block_to_the_same_values(arch_dirs, corpus, tmp_path):
    whole = lw.Extractor(str(arch_dirs["llama"]), device="cpu", backend="torch")
    budget = f"{whole.describe()['weights']['weights_bytes']}B"  # the trunk and block 0: deeper blocks are streamed
    streamed = lw.Extractor(str(arch_dirs["llama"]), device="cpu", backend="torch", max_memory=budget)
    assert streamed.loaded.streams(2)
    lw.extract_activations(corpus, tmp_path / "a", layers=[1, 2], context_size=8, model=whole)
    lw.extract_activations(corpus, tmp_path / "b", layers=[1, 2], context_size=8, model=streamed)
    for k in (1, 2):
        assert np.abs(ActivationStore(tmp_path / "a").to_numpy(k) - ActivationStore(tmp_path / "b").to_numpy(k)
                      ).max() <= 1e-5
    assert streamed.loaded.blocks.resident == 1, "streaming loaded blocks for good"


DATALOADER = """
import sys
import numpy as np, torch
import layerwise as lw

store = sys.argv[1]
acts = lw.open_activations(store)
# each row tagged by its own values: the set of rows read is the set stored
stored = acts.to_numpy(2)
stored = stored[~np.isin(acts.token_ids().reshape(-1), acts.special_ids)]
ds = acts.token_dataset(layer=2, batch_size=32, seed=5)
loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
rows = torch.cat(list(loader)).numpy()
assert rows.shape == stored.shape, (rows.shape, stored.shape)
key = lambda a: np.lexsort(a.T[::-1])
assert np.array_equal(rows[key(rows)], stored[key(stored)])
again = torch.cat(list(loader)).numpy()
assert np.array_equal(rows, again)
single = torch.cat(list(acts.token_loader(layer=2, batch_size=32, seed=5))).numpy()
assert np.array_equal(rows, single)
print("ROWS", len(rows))
"""


def test_a_dataloader_with_two_workers_gives_every_row_once(arch_dirs, corpus, tmp_path):
    """Two workers started by spawn (each unpickles the dataset and opens the store itself), every row once; the
    same rows, in the same order, as the single loader. In a process of its own: a DataLoader with workers installs
    torch's SIGCHLD handler for good, and in this session's process that handler made every later child's exit a
    signal delivered on the main thread (the suite died of a segmentation fault at such an exit, in CI runs of
    2026-11-28/29, until this test ran elsewhere)."""
    ex = lw.Extractor(str(arch_dirs["gpt2"]), device="cpu", backend="torch")
    lw.extract_activations(corpus, tmp_path / "a", layers=[2], context_size=8, model=ex)
    run = subprocess.run([sys.executable, "-c", DATALOADER, str(tmp_path / "a")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split("ROWS ", 1)[1]) > 0


def test_the_command_line_writes_inspects_verifies_and_exports(arch_dirs, corpus, tmp_path):
    from typer.testing import CliRunner

    from layerwise.cli.main import app

    run = CliRunner().invoke
    out = str(tmp_path / "acts")
    model = ["--model", str(arch_dirs["gpt2"]), "--backend", "torch"]
    done = run(app, ["extract", str(corpus), "-o", out, "--level", "token", "--context-size", "16", "--layers",
                     "1,2", "--output-dtype", "bfloat16", "-q", *model])
    assert done.exit_code == 0, done.output
    assert ActivationStore(out).layers == (1, 2)
    refused = run(app, ["extract", str(corpus), "-o", out, "--level", "token", "--context-size", "16", "--pool",
                        "mean", *model])
    assert refused.exit_code == 2 and "--pool" in refused.output
    no_level = run(app, ["extract", str(corpus), "-o", out, "--context-size", "16", *model])
    assert no_level.exit_code == 2 and "--level token" in no_level.output
    shown = run(app, ["inspect", out])
    assert shown.exit_code == 0 and "bfloat16" in shown.output
    assert run(app, ["verify", out]).exit_code == 0
    shard = Path(out) / ActivationStore(out).entries[0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    damaged = run(app, ["verify", out])
    assert damaged.exit_code == 1 and "sha256" in damaged.output


SAE_LENS_TRAINING = """
import json, sys
import datasets, numpy as np
from sae_lens import (LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig,
                      StandardTrainingSAEConfig)
from sae_lens.training import sae_trainer
from transformer_lens import HookedTransformer, HookedTransformerConfig

export, d_in, vocab, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), np.load(sys.argv[4])
hook = json.load(open(export + "/layerwise-export.json"))["hook_name"]
# a TransformerLens model with the hook: SAELens loads one even when it reads cached activations
model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=d_in, d_head=8, n_heads=4, d_mlp=64, n_ctx=16,
                                                  d_vocab=vocab, act_fn="gelu", device="cpu"))
cfg = LanguageModelSAERunnerConfig(
    sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=64, l1_coefficient=1e-3), model_name="tiny", hook_name=hook,
    context_size=16, use_cached_activations=True, cached_activations_path=export, is_dataset_tokenized=True,
    training_tokens=128 * 300, train_batch_size_tokens=128, store_batch_size_prompts=8, n_batches_in_buffer=16,
    device="cpu", lr=3e-3, logger=LoggingConfig(log_to_wandb=False), n_checkpoints=0, save_final_checkpoint=False,
    output_path=None, checkpoint_path=None, verbose=False, n_eval_batches=0)
losses = []
step = sae_trainer.SAETrainer._train_step

def watched(self, sae, sae_in):
    out = step(self, sae, sae_in)
    losses.append(float(out.loss.detach()))
    return out

sae_trainer.SAETrainer._train_step = watched
tokens = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
LanguageModelSAETrainingRunner(cfg, override_model=model, override_dataset=tokens).run()
print("LOSSES " + json.dumps(losses))
"""


def test_sae_lens_trains_from_an_exported_store_with_falling_loss(arch_dirs, corpus, tmp_path):
    """SAELens's own trainer, unchanged, reads an export (in a process of its own: importing SAELens sets the
    transformers logger's level for the whole process)."""
    trainer = sae_env.python()  # (SAELens is not imported here: see the docstring)
    import datasets

    ex = lw.Extractor(str(arch_dirs["gpt2"]), device="cpu", backend="torch")
    lw.extract_activations(corpus, tmp_path / "acts", layers=[2], context_size=16, dtype="bfloat16", model=ex)
    out = lw.export_sae_lens(tmp_path / "acts", tmp_path / "sl", layer=2)
    said = json.loads((out / "layerwise-export.json").read_text())
    assert said["hook_name"] == "blocks.1.hook_resid_post" and said["d_in"] == ex.hidden_size
    acts = ActivationStore(tmp_path / "acts")
    ds = datasets.load_from_disk(str(out))
    assert np.allclose(np.asarray(ds[0]["blocks.1.hook_resid_post"]), acts.to_numpy(2)[:16])
    np.save(tmp_path / "ids.npy", acts.token_ids())
    run = subprocess.run([trainer, "-c", SAE_LENS_TRAINING, str(out), str(ex.hidden_size),
                          str(len(ex.tokenizer)), str(tmp_path / "ids.npy")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})
    assert run.returncode == 0, run.stderr[-3000:]
    losses = json.loads(run.stdout.split("LOSSES ", 1)[1])
    assert len(losses) == 300
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])
    shutil.rmtree(tmp_path / "sl")
