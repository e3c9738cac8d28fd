"""Bad input at the Extractor level: every error is raised early, with a message that says what to do."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import layerwise as lw

from tiny import pickle_only_copy

CALLS = {
    "encode": lambda ex, **kw: ex.encode(["I love Paris"], **kw),
    "hidden_states": lambda ex, **kw: ex.hidden_states(["I love Paris"], **kw),
    "encode_words": lambda ex, **kw: ex.encode_words([["I", "love", "Paris"]], **kw),
}


@pytest.fixture
def forward_count(default_extractor):
    """Counts forward passes of the default model's embeddings (0 = nothing was computed)."""
    calls = []
    handle = default_extractor.model.embeddings.register_forward_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize("call", CALLS)
def test_out_of_range_layer_before_any_compute(default_extractor, forward_count, call):
    with pytest.raises(
        ValueError, match=r"layer 7 in layer spec 7 is out of range: this model has layers 0\.\.6"
    ) as info:
        CALLS[call](default_extractor, layers=7)
    assert 'layers="-4:"' in str(info.value) and "-7..-1" in str(info.value)
    with pytest.raises(ValueError, match=r"layer -8 in layer spec \[0, -8\] is out of range"):
        CALLS[call](default_extractor, layers=[0, -8])
    with pytest.raises(ValueError, match=r"malformed layer spec 'top4'"):
        CALLS[call](default_extractor, layers="top4")
    assert forward_count == []


@pytest.mark.parametrize("call", CALLS)
def test_unknown_site_lists_valid_sites(default_extractor, call):
    with pytest.raises(
        ValueError, match=r"unknown site 'ffn'\. Valid sites are: block, raw, attention, intermediate, pre_ln"
    ):
        CALLS[call](default_extractor, site="ffn")
    with pytest.raises(ValueError, match=r"exists only in encoder layers 1\.\.L"):
        CALLS[call](default_extractor, layers="all", site="pre_ln")


@pytest.mark.parametrize("call", ["encode", "encode_words"])
def test_unknown_combine_and_return_tensors(default_extractor, forward_count, call):
    with pytest.raises(
        ValueError,
        match=r"unknown combine mode 'avg'\. Valid combine modes are: concat, sum, mean, "
        r"weighted, stack",
    ):
        CALLS[call](default_extractor, combine="avg")
    with pytest.raises(ValueError, match=r"unknown return_tensors 'tf'\. Valid values are: np, pt"):
        CALLS[call](default_extractor, return_tensors="tf")
    assert forward_count == []


def test_unknown_pool_and_subword(default_extractor, forward_count):
    ex = default_extractor
    with pytest.raises(
        ValueError,
        match=r"unknown pool mode 'avg'\. Valid pool modes are: cls, pooler, mean, max, "
        r"mean_max, last",
    ):
        ex.encode(["x"], pool="avg")
    with pytest.raises(ValueError, match=r"pool='attention' needs learned weights: pass a module"):
        ex.encode(["x"], pool="attention")
    with pytest.raises(ValueError, match=r"pool='cls' reads the first special token"):
        ex.encode(["x"], pool="cls", skip_special_tokens=True)
    with pytest.raises(ValueError, match=r"pool='pooler' applies the model's pooler"):
        ex.encode(["x"], layers="-2:", combine="concat", pool="pooler")
    with pytest.raises(
        ValueError,
        match=r"unknown subword pooling 'avg'\. Valid subword modes are: first, last, mean, "
        r"max, first_last",
    ):
        ex.encode_words([["x"]], subword="avg")
    with pytest.raises(ValueError, match=r"subword='first_last' concatenates features"):
        ex.encode_words([["x"]], layers="-2:", combine="stack", subword="first_last")
    assert forward_count == []


def test_weights_errors(default_extractor):
    ex = default_extractor
    with pytest.raises(ValueError, match=r"weights are only used with combine='weighted', not 'mean'"):
        ex.encode(["x"], layers="-2:", combine="mean", weights=[0.5, 0.5])
    with pytest.raises(ValueError, match=r"combine='weighted' needs weights=\[w_1, \.\.\., w_K\], one per selected"):
        ex.encode(["x"], layers="-2:", combine="weighted")
    with pytest.raises(ValueError, match=r"combine='weighted' got 2 weights for 4 selected layers"):
        ex.encode_words([["x"]], layers="-4:", combine="weighted", weights=[0.5, 0.5])


def test_no_text_gives_no_row(default_extractor):
    """An empty input is an empty answer of the right shape (issue 41, item 2), and the spec is still checked."""
    ex = default_extractor
    got = ex.encode([], layers="-4:", combine="concat")
    assert isinstance(got, np.ndarray) and got.shape == (0, 4 * 384) and got.dtype == np.float32
    assert ex.encode([], layers=range(3), combine="stack").shape == (0, 3, 384)
    assert ex.encode((t for t in []), output_dtype="ubinary").shape == (0, 48)
    assert ex.encode([], output_dtype="binary").dtype == np.int8
    pt = ex.encode([], return_tensors="pt")
    assert isinstance(pt, torch.Tensor) and tuple(pt.shape) == (0, 384) and pt.dtype == torch.float32
    assert ex.encode([], pool=None) == [] and ex.encode_words([]) == []
    stack = ex.hidden_states([], layers=[0, 3])
    assert stack.tensor.shape == (2, 0, 0, 384) and len(stack) == 2 and list(stack) != []
    with pytest.raises(ValueError, match=r"layer 7 in layer spec 7 is out of range"):
        ex.encode([], layers=7)  # nothing to encode, but a bad spec is still refused


def test_any_iterable_of_strings_is_taken(default_extractor):
    """A tuple, a pandas Series, a numpy array of strings and a generator give what a list gives (issue 41, item 2)."""
    pd = pytest.importorskip("pandas")
    ex = default_extractor
    texts = ["I love Paris", "EU rejects German call"]
    want = ex.encode(texts, layers=-2)
    for given in (tuple(texts), pd.Series(texts, index=[7, 3]), pd.DataFrame({"s": texts}).s, np.array(texts),
                  (t for t in texts), iter(texts)):
        got = ex.encode(given, layers=-2)
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-6, type(given).__name__
    stack = ex.hidden_states(np.array(texts), layers=[0, 3])
    assert torch.equal(stack.tensor, ex.hidden_states(texts, layers=[0, 3]).tensor)
    words = ex.encode_words((np.array(w.split()) for w in texts), layers=-1)
    assert [w.shape for w in words] == [(3, 384), (4, 384)]
    assert np.abs(words[1] - ex.encode_words([texts[1].split()], layers=-1)[0]).max() <= 1e-6


def test_iterables_that_are_not_texts_are_refused(default_extractor):
    pd = pytest.importorskip("pandas")
    ex = default_extractor
    with pytest.raises(TypeError, match=r"got DataFrame \(iterating it gives its column names\); pass one column of "
                                        r"it, e.g. df\['text'\]"):
        ex.encode(pd.DataFrame({"sentence": ["a", "b"]}))
    with pytest.raises(TypeError, match=r"got set; a set has no order.*list\(\.\.\.\) or sorted\(\.\.\.\)"):
        ex.encode({"a", "b"})
    with pytest.raises(TypeError, match=r"got dict; iterating a mapping gives its keys"):
        ex.encode({"a": 1})
    with pytest.raises(TypeError, match=r"texts must be a list of strings, got int; pass a list \(or any iterable\)"):
        ex.encode(3)
    with pytest.raises(TypeError, match=r"text 1 must be a string, got float: nan"):
        ex.encode(pd.Series(["a", float("nan")]))


def test_bad_text_types(default_extractor):
    ex = default_extractor
    with pytest.raises(TypeError, match=r"text 1 must be a string, got int: 3"):
        ex.encode(["fine", 3])
    with pytest.raises(TypeError, match=r"text 2 must be a string, got NoneType"):
        ex.hidden_states(["a", "b", None])
    for fn in (ex.encode, ex.hidden_states):
        with pytest.raises(TypeError, match=r"texts must be a list of strings, got str; wrap a single item in a list"):
            fn("I love Paris")
        with pytest.raises(TypeError, match=r"texts must be a list of strings, got bytes"):
            fn(b"I love Paris")
        with pytest.raises(TypeError, match=r"texts must be a list of strings, got NoneType"):
            fn(None)
    with pytest.raises(TypeError, match=r"word lists must be a list of lists of strings, got str"):
        ex.encode_words("EU rejects")
    with pytest.raises(TypeError, match=r"item 0 must be a list of word strings, got str"):
        ex.encode_words(["EU", "rejects"])
    with pytest.raises(TypeError, match=r"word 1 of item 1 must be a string, got int"):
        ex.encode_words([["a"], ["b", 2]])


def test_a_blank_text_word_or_word_list_is_refused_naming_its_index(tiny_extractors):
    """One rule of blank input everywhere: the library refuses it naming its index (the service answers 422, extract
    skips, counts and lists it; tested with them)."""
    ex = tiny_extractors["bert"]
    for call in (lambda t: ex.encode(t), lambda t: ex.encode(t, pool=None), lambda t: ex.hidden_states(t),
                 lambda t: list(ex.stream(t, lw.EncodeSpec()))):
        with pytest.raises(lw.InputError, match=r"text 1 is empty \(nothing left after stripping whitespace\); blank "
                                                r"input has no meaning to encode.*errors.jsonl"):
            call(["I love Paris", " \t"])
    with pytest.raises(lw.InputError, match=r"word 1 of item 0 is empty .* so it would have no vector"):
        ex.encode_words([["EU", ""]])
    with pytest.raises(lw.InputError, match=r"item 1 has no word"):
        ex.encode_words([["EU"], []])
    assert ex.encode([], layers=-1).shape[0] == 0  # no text at all is still an empty answer


def test_missing_path_and_file_path(tmp_path, tiny_dirs):
    with pytest.raises(
        lw.ModelLoadError,
        match=r"model path '.*nope' does not exist\. Pass an existing local model "
        r"directory",
    ):
        lw.Extractor(str(tmp_path / "nope"), device="cpu")
    assert issubclass(lw.ModelLoadError, ValueError)
    with pytest.raises(ValueError, match=r"is a file; pass the directory that holds config\.json"):
        lw.Extractor(tiny_dirs["bert"] / "config.json", device="cpu")
    with pytest.raises(lw.ModelLoadError, match=r"has no model weights \(no \*\.safetensors file\)"):
        lw.Extractor(str(tmp_path), device="cpu")
    with pytest.raises(TypeError, match=r"model must be a path or hub id string, got int"):
        lw.Extractor(123, device="cpu")


def test_pickle_only_checkpoint_needs_opt_in(tmp_path, tiny_dirs, tiny_extractors):
    path = pickle_only_copy(tiny_dirs["bert"], tmp_path / "pickled")
    with pytest.raises(lw.ModelLoadError, match=r"holds only a pickle checkpoint \(pytorch_model\.bin\)") as info:
        lw.Extractor(str(path), device="cpu")
    assert "allow_pickle=True" in str(info.value) and "--allow-pickle" in str(info.value)
    ex = lw.Extractor(str(path), device="cpu", allow_pickle=True)
    texts = ["EU rejects German call", "I love Paris"]
    got = ex.hidden_states(texts, layers="all").tensor
    want = tiny_extractors["bert"].hidden_states(texts, layers="all").tensor
    # the same weights in another Extractor (its backend may be another runtime): float32 rounding only
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5


def test_architecture_outside_the_table_loads_and_unknown_one_is_refused(tmp_path, tiny_dirs):
    from transformers import AutoModel, GPT2Config

    path = tmp_path / "gpt2"
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=200, bos_token_id=0, eos_token_id=0)
    AutoModel.from_config(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dirs["bert"] / name, path / name)
    ex = lw.Extractor(str(path), device="cpu")  # once "not a supported encoder family": now discovered and verified
    assert ex.describe()["layer_map"] == "h (discovered)" and ex.num_layers == 2
    assert {"bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "xlm-roberta"} <= set(
        lw.SUPPORTED_MODEL_TYPES
    )
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    with pytest.raises(lw.ModelLoadError, match=r"transformers does not know the architecture of .*"
                       r"trust_remote_code=True.*Extractor\.from_module"):
        lw.Extractor(str(path), device="cpu")


def test_uncached_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        lw.ModelLoadError,
        match=r"could not load 'nobody-xyz/no-such-model-123' from the Hugging Face "
        r"hub",
    ) as info:
        lw.Extractor("nobody-xyz/no-such-model-123", device="cpu")
    msg = str(info.value)
    assert "not a local directory" in msg
    assert "--local-dir ./models/no-such-model-123" in msg
    assert "Extractor('./models/no-such-model-123')" in msg


def test_default_batch_tokens_by_device(tiny_extractors):
    assert lw.Extractor(tiny_extractors["bert"].loaded).batch_tokens == 1024  # CPU default (None = by device)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8192"])
def test_bad_batch_tokens_in_constructor(tiny_extractors, bad):
    with pytest.raises(ValueError, match=rf"batch_tokens must be a positive int \(tokens per batch\), got {bad!r}"):
        lw.Extractor(tiny_extractors["bert"].loaded, batch_tokens=bad)


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_bad_batch_tokens_per_call(tiny_extractors, bad):
    ex = tiny_extractors["bert"]
    for call in CALLS.values():
        with pytest.raises(ValueError, match=rf"batch_tokens must be a positive int .*got {bad!r}"):
            call(ex, batch_tokens=bad)


def test_zero_batch_tokens_per_call_refused(tiny_extractors):
    with pytest.raises(ValueError, match=r"batch_tokens must be a positive int"):
        tiny_extractors["bert"].encode(["x"], batch_tokens=0)


def test_bad_max_length_and_stride(tiny_extractors):
    loaded = tiny_extractors["bert"].loaded  # max 64 tokens, 2 special tokens
    for bad in (2, 0, 65, 10_000):
        with pytest.raises(ValueError, match=rf"max_length={bad} is outside 3\.\.64 \(this model's maximum"):
            lw.Extractor(loaded, max_length=bad)
    for bad in (-1, 62, 100):
        with pytest.raises(ValueError, match=rf"stride={bad} must be in 0\.\.61 \(window capacity 62 tokens\)"):
            lw.Extractor(loaded, stride=bad)
    with pytest.raises(ValueError, match=r"stride=8 must be in 0\.\.7 \(window capacity 8 tokens\)"):
        lw.Extractor(loaded, max_length=10, stride=8)
    ok = lw.Extractor(loaded, max_length=10, stride=7)
    assert (ok.max_length, ok.stride) == (10, 7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda(tiny_dirs):
    with pytest.raises(ValueError, match=r"device 'cuda' asked for, but CUDA is not available here; use device='cpu'"):
        lw.Extractor(str(tiny_dirs["bert"]), device="cuda")


def test_unknown_device_and_dtype(tiny_dirs):
    path = str(tiny_dirs["bert"])
    with pytest.raises(ValueError, match=r"unknown device 'gpu'; valid examples: 'cpu', 'cuda', 'cuda:0'"):
        lw.Extractor(path, device="gpu")
    for bad in ("float64", "fp16", "half"):
        with pytest.raises(ValueError, match=rf"unknown compute_dtype '{bad}'. Valid values are: float32, float16, "
                                             rf"bfloat16"):
            lw.Extractor(path, device="cpu", compute_dtype=bad)
    with pytest.raises(ValueError, match=r"unknown compute_dtype 'float64'. Valid values are: float32, float16"):
        lw.Extractor(path, device="cpu", compute_dtype=torch.float64)


def test_float_max_length_and_stride_refused(tiny_extractors):
    loaded = tiny_extractors["bert"].loaded
    with pytest.raises(ValueError, match=r"max_length must be an int \(tokens\), got 40\.7"):
        lw.Extractor(loaded, max_length=40.7)
    with pytest.raises(ValueError, match=r"stride must be an int \(tokens\), got 1\.5"):
        lw.Extractor(loaded, stride=1.5)
