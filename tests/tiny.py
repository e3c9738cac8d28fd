"""Tiny random models (hidden 32, 2 layers) of every supported family, with tokenizers trained in-process.

Each is saved to a directory (safetensors) and loaded back through layerwise's real loading path.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AlbertConfig,
    AutoModel,
    BertConfig,
    DebertaV2Config,
    DistilBertConfig,
    ElectraConfig,
    PreTrainedTokenizerFast,
    RobertaConfig,
    XLMRobertaConfig,
)

CORPUS = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn went to Brussels on Monday.",
    "The quick brown fox jumps over the lazy dog!",
    "I love Paris in the springtime, said the tourist.",
    "Layer-wise probing shows which layer knows what about syntax and meaning.",
    "Numbers like 1996 and 2,000 tokens appear too; so do émigrés and naïve cafés.",
] * 20

FAMILIES = ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "xlm-roberta")
HIDDEN, LAYERS, HEADS, INTER, MAXPOS = 32, 2, 2, 37, 64


def wordpiece(cls: str = "[CLS]", sep: str = "[SEP]") -> tuple[Tokenizer, dict]:
    """A lower-casing WordPiece tokenizer trained on :data:`CORPUS` with ``cls $A sep`` around each text."""
    specials = ["[PAD]", "[UNK]", cls, sep, "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    return tok, dict(pad_token="[PAD]", unk_token="[UNK]", cls_token=cls, sep_token=sep, mask_token="[MASK]")


def _bytelevel_bpe() -> tuple[Tokenizer, dict]:
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", 2), ("<s>", 0), trim_offsets=True, add_prefix_space=False
    )
    return tok, dict(
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def _unigram(cls: str, sep: str, pad: str, unk: str, first: list[str]) -> tuple[Tokenizer, dict]:
    specials = first
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=200, special_tokens=specials, unk_token=unk))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    return tok, dict(
        cls_token=cls, sep_token=sep, pad_token=pad, unk_token=unk, mask_token="[MASK]" if cls == "[CLS]" else "<mask>"
    )


def build(family: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny random ``family`` model with a matching tokenizer into ``directory``."""
    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=INTER)
    if family in ("bert", "electra", "distilbert"):
        tok, special = wordpiece()
    elif family == "roberta":
        tok, special = _bytelevel_bpe()
    elif family == "xlm-roberta":
        tok, special = _unigram("<s>", "</s>", "<pad>", "<unk>", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    else:  # albert, deberta-v2
        tok, special = _unigram("[CLS]", "[SEP]", "<pad>", "<unk>", ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"])
    vocab = tok.get_vocab_size()
    pad_id = tok.token_to_id(special["pad_token"])
    if family == "bert":
        config = BertConfig(vocab_size=vocab, max_position_embeddings=MAXPOS, pad_token_id=pad_id, **common)
    elif family == "electra":
        config = ElectraConfig(
            vocab_size=vocab, embedding_size=16, max_position_embeddings=MAXPOS, pad_token_id=pad_id, **common
        )
    elif family == "distilbert":
        config = DistilBertConfig(
            vocab_size=vocab,
            dim=HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            hidden_dim=INTER,
            max_position_embeddings=MAXPOS,
            pad_token_id=pad_id,
        )
    elif family == "roberta":
        config = RobertaConfig(
            vocab_size=vocab,
            max_position_embeddings=MAXPOS + 2,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            type_vocab_size=1,
            **common,
        )
    elif family == "xlm-roberta":
        config = XLMRobertaConfig(
            vocab_size=vocab,
            max_position_embeddings=MAXPOS + 2,
            pad_token_id=pad_id,
            bos_token_id=0,
            eos_token_id=2,
            type_vocab_size=1,
            **common,
        )
    elif family == "albert":
        config = AlbertConfig(
            vocab_size=vocab,
            embedding_size=16,
            max_position_embeddings=MAXPOS,
            pad_token_id=pad_id,
            num_hidden_groups=1,
            inner_group_num=1,
            hidden_act="gelu_new",
            **common,
        )
    elif family == "deberta-v2":
        config = DebertaV2Config(
            vocab_size=vocab,
            max_position_embeddings=MAXPOS,
            pad_token_id=pad_id,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=16,
            max_relative_positions=-1,
            position_biased_input=False,
            type_vocab_size=0,
            norm_rel_ebd="layer_norm",
            conv_kernel_size=3,
            hidden_act="gelu",
            **common,
        )
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    with torch.no_grad():  # larger than the default init so layers differ visibly and errors cannot hide
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAXPOS, **special)
    hf_tok.save_pretrained(directory)
    return directory


# ---- shared test data builders ---------------------------------------------------------------------------------
TOY_KEYS = {"pos": "paris", "neg": "lamb", "mid": "blackburn"}
TOY_FILLER = "the quick brown fox jumps over lazy dog went to brussels on monday said tourist".split()


def toy(path: Path, n: int, seed: int, classes=("pos", "neg")) -> list[tuple[str, str]]:
    """``n`` separable records (class word three times + 3 filler words), written as tsv / csv / jsonl by suffix."""
    import json
    import random

    rng, rows = random.Random(seed), []
    for i in range(n):
        words = [TOY_KEYS[classes[i % len(classes)]]] * 3 + rng.sample(TOY_FILLER, 3)
        rng.shuffle(words)
        rows.append((" ".join(words), classes[i % len(classes)]))
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    else:
        sep = "\t" if path.suffix == ".tsv" else ","
        path.write_text(f"text{sep}label\n" + "".join(f"{t}{sep}{y}\n" for t, y in rows))
    return rows


def pickle_only_copy(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` whose weights are only a pickle checkpoint (``pytorch_model.bin``)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(model_dir, dest)
    state = {}
    for f in dest.glob("*.safetensors"):
        state.update(load_file(f))
        f.unlink()
    assert state, f"{model_dir} has no safetensors weights"
    torch.save(state, dest / "pytorch_model.bin")
    return dest


def extract(input, output, *, model=None, device=None, stdin=None, on_shard=None, **kw):
    """``layerwise.extract`` called with flat keyword arguments, split into EncodeSpec / ReadOptions / ExtractOptions.

    Tests read better with one flat call; the library takes the three config objects.
    """
    from dataclasses import fields

    import layerwise as lw

    groups = {cls: {f.name for f in fields(cls)} for cls in (lw.EncodeSpec, lw.ReadOptions, lw.ExtractOptions)}
    parts = {cls: {k: kw.pop(k) for k in list(kw) if k in names} for cls, names in groups.items()}
    if kw:
        raise TypeError(f"unknown extract arguments {sorted(kw)}")
    if "keep" in parts[lw.ReadOptions]:
        parts[lw.ReadOptions]["keep"] = tuple(parts[lw.ReadOptions]["keep"])
    if device is not None and not isinstance(model, lw.Extractor):
        model = lw.Extractor(model, device=device)
    return lw.extract(
        input,
        output,
        lw.EncodeSpec(**parts[lw.EncodeSpec]),
        model=model,
        reading=lw.ReadOptions(**parts[lw.ReadOptions]),
        options=lw.ExtractOptions(**parts[lw.ExtractOptions]),
        stdin=stdin,
        on_shard=on_shard,
    )


def module_hook_count(model) -> int:
    """Total forward (pre-)hooks registered on ``model``'s modules (torch keeps them in private dicts)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Call ``predicate()`` until it returns a truthy value, and return that value.

    The tests' one way to wait for something that happens on its own (a process, a thread, a server): instead of a
    fixed sleep, poll for the observable condition every ``interval`` seconds, and fail at a deadline.
    ``predicate`` is called at least once, and once more at the deadline (the condition may have come true during
    the last interval); an exception it raises is not caught (a predicate may assert that waiting still makes sense).

    Raises:
        AssertionError: ``"{what}: not within {timeout} s"`` when ``timeout`` seconds (``time.monotonic``) passed
            without a truthy value.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(min(interval, left))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The tests that start a real server process (:func:`cli_server`, :func:`serving`, or the command itself), each with
# why the process is the point; every other test serves in a thread (:func:`serve_in_thread`). A test checks the list.
SERVER_PROCESSES = {
    "tests/serve/test_serve.py::test_ready_says_when_the_warmed_depths_are_prepared":
        "--warm at start and /ready as the command sets them up; a bad --warm ends the command",
    "tests/serve/test_serve_ceilings.py::server": "the memory ceiling is the process's resident memory",
    "tests/serve/test_kill_during_build.py::test_a_server_killed_during_a_build_leaves_nothing_unaccounted":
        "kill -9 of the server process and its build child",
    "tests/serve/test_serve_traffic.py::test_a_bad_cors_origin_stops_serve_naming_the_flag":
        "the command's exit status and message for a bad flag",
    "tests/serve/test_serve_hostile.py::test_serve_warns_when_bound_beyond_loopback_without_a_key":
        "the command's warning on binding beyond loopback",
    "tests/cut/test_export_model.py::test_layerwise_serve_gives_the_exported_layer_to_the_openai_client":
        "`layerwise serve --model EXPORTED` as a user types it",
    "tests/model/test_tensorflow.py::test_the_service_serves_a_saved_model":
        "the command detects a SavedModel directory; TensorFlow stays out of the test process's server",
    "tests/docs/test_doc_examples.py::test_openai_and_tei_client_examples_run_as_written": "the README, as written",
    "tests/docs/test_doc_examples.py::test_readme_export_block_runs_and_its_serve_line_serves_the_export":
        "the README, as written",
    "tests/explore/test_explore_page.py::exploring": "`layerwise explore` as a user runs it, for a real browser",
}


@contextlib.contextmanager
def serve_in_thread(app, connections=None, timeout: float = 60):
    """The service ``app`` (:func:`layerwise.serve.create_app`'s) served by uvicorn in a thread of this process, as
    ``layerwise serve`` serves it (:func:`layerwise.serve.server`: its connection limits ``connections``, its
    counters), on a free port: yields the base URL once started; told to exit and joined after (httpx's
    ``tests/conftest.py`` pattern). For the tests whose point is not the process; :func:`cli_server` runs the real
    command."""
    import threading

    from layerwise.serve import server

    srv = server(app, port=0, log_level="warning", connections=connections)
    thread = threading.Thread(target=srv.run, name="test-server", daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started or not thread.is_alive(), timeout, "the in-thread server starting",
                   interval=0.01)
        assert srv.started, "the in-thread server did not start (its error is in the log above)"
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def cli_server(args: list[str], log_path: Path, ready: str, timeout: float = 180):
    """``layerwise ARGS --port P`` in a subprocess on a free local port; yields its base URL once ``GET ready``
    answers.

    The server is stopped on exit; if it does not come up the test fails with its log.
    """
    import os
    import subprocess
    import sys
    import urllib.request

    import pytest

    port = free_port()
    cmd = [sys.executable, "-m", "layerwise.cli.main", *args, "--port", str(port)]
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{base}{ready}", timeout=5).read()
            return True
        except OSError:
            return False

    with open(log_path, "w+") as log, subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    ) as proc:
        try:
            try:
                wait_until(lambda: proc.poll() is not None or answers(), timeout, f"GET {ready} answering",
                           interval=0.2)
                assert proc.poll() is None, f"the server exited with status {proc.returncode}"
            except AssertionError as exc:
                log.seek(0)
                pytest.fail(f"server did not start ({exc}):\n{log.read()}")
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def serving(model, log_path: Path, *extra: str, timeout: float = 180):
    """``layerwise serve --model MODEL`` in a subprocess (see :func:`cli_server`); yields its base URL once healthy."""
    return cli_server(["serve", "--model", str(model), "--log-level", "warning", *extra], log_path, "/health", timeout)
