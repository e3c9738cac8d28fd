"""Extractor features beyond the core invariants: pooler, ScalarMix layers, sites via encode, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import layerwise as lw


@pytest.mark.parametrize("fam", ["bert", "roberta", "albert", "xlm-roberta"])
def test_pooler_equals_model_pooler_output(tiny_extractors, fam):
    ex = tiny_extractors[fam]
    texts = ["EU rejects German call", "Peter", "."]
    got = ex.encode(texts, layers=-1, pool="pooler")
    enc = ex.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        ref = ex.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).pooler_output
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-5)


def test_pooler_refused_without_pooler(tiny_extractors):
    with pytest.raises(ValueError, match="needs a model with a pooler"):
        tiny_extractors["distilbert"].encode(["x"], pool="pooler")


def test_default_model_pooler_matches(default_extractor):
    ex = default_extractor
    enc = ex.tokenizer(["I love Paris"], return_tensors="pt")
    with torch.inference_mode():
        ref = ex.model(**{k: enc[k] for k in ("input_ids", "attention_mask")}).pooler_output
    np.testing.assert_allclose(ex.encode(["I love Paris"], pool="pooler"), ref.numpy(), atol=1e-5)


def test_scalar_mix_layers_and_weighted_sum(default_extractor):
    ex = default_extractor
    texts = ["I love Paris", "EU rejects German call to boycott British lamb ."]
    mix = lw.ScalarMix.over(ex.num_layers, include_embeddings=False)
    got = ex.encode(texts, combine=mix, pool="mean")  # layers taken from the mix: "1:"
    want = ex.encode(texts, layers="1:", combine="mean", pool="mean")  # softmax of zeros = uniform
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="ScalarMix was built for 6 layers but 4 are selected"):
        ex.encode(texts, layers="-4:", combine=mix)


def test_sites_through_encode(default_extractor):
    ex = default_extractor
    inter = ex.encode(["I love Paris"], layers=[1, 2], combine="concat", site="intermediate")
    assert inter.shape == (1, 2 * 1536)
    stack = ex.hidden_states(["I love Paris"], layers=[2], site="pre_ln")
    assert stack.sites == ("pre_ln",) and stack.tensor.shape == (1, 1, 5, 384)
    with pytest.raises(ValueError, match="exists only in encoder layers 1..L"):
        ex.encode(["x"], layers="all", site="attention")


def test_return_tensors_and_stack(default_extractor):
    ex = default_extractor
    pt = ex.encode(["I love Paris"], layers="-3:", combine="stack", pool="mean", return_tensors="pt")
    assert isinstance(pt, torch.Tensor) and pt.shape == (1, 3, 384)
    words = ex.encode_words(
        [["I", "love", "Paris"]], layers=[3, 6], combine="mean", subword="first_last", return_tensors="pt"
    )
    assert words[0].shape == (3, 768)


def test_word_vectors_match_first_subtoken(default_extractor):
    ex = default_extractor
    words = ["Unbelievably", "naïve", "EU", "x"]
    stack = ex.hidden_states([" ".join(words)], layers=-1)
    vecs = ex.encode_words([words], layers=-1, subword="first")[0]
    first = {}
    for pos, w in enumerate(stack.word_ids[0]):
        if w is not None and w not in first:
            first[w] = pos
    for w in range(len(words)):
        np.testing.assert_allclose(vecs[w], stack.tensor[0, 0, first[w]].numpy(), atol=1e-5)


def test_progress_bar_does_not_change_results(default_extractor, capsys):
    ex = default_extractor
    a = ex.encode(["one", "two"], show_progress=True)
    b = ex.encode(["one", "two"])
    np.testing.assert_array_equal(a, b)


def test_cpu_defaults_to_float32(default_extractor):
    assert default_extractor.loaded.dtype == torch.float32
    from layerwise.model.loading import resolve_dtype

    assert resolve_dtype(None, torch.device("cpu")) == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_matches_cpu(default_extractor, dtype):  # pragma: no cover - runs only where a GPU is lent
    gpu = lw.Extractor(device="cuda", compute_dtype=dtype)
    texts = ["I love Paris", "EU rejects German call to boycott British lamb ."]
    a = gpu.encode(texts, layers="-4:", combine="mean", pool="mean")
    b = default_extractor.encode(texts, layers="-4:", combine="mean", pool="mean")
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > (0.99999 if dtype == "float32" else 0.999)


def test_reduced_precision_on_cpu_is_warned_about_where_the_cpu_lacks_it():
    from layerwise.model.hardware import PrecisionWarning, check_cpu_dtype, native_on_cpu

    cpu = torch.device("cpu")
    assert native_on_cpu(torch.float32, frozenset())
    assert native_on_cpu(torch.bfloat16, frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert native_on_cpu(torch.bfloat16, frozenset({"amx_bf16"}))
    assert not native_on_cpu(torch.bfloat16, frozenset({"avx2", "avx512f"}))
    message = r"compute_dtype='bfloat16' on this CPU: it has none of avx512_bf16, amx_bf16"
    with pytest.warns(PrecisionWarning, match=message):
        check_cpu_dtype(torch.bfloat16, cpu, flags=frozenset({"avx2"}))
    with pytest.warns(PrecisionWarning, match="avx512_fp16, amx_fp16"):
        check_cpu_dtype(torch.float16, cpu, flags=frozenset({"avx512f", "avx512_bf16"}))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_cpu_dtype(torch.bfloat16, cpu, flags=frozenset({"avx512_bf16"}))  # native: silent
        check_cpu_dtype(torch.bfloat16, torch.device("meta"), flags=frozenset())  # not a CPU: not this check's job
        check_cpu_dtype(torch.float32, cpu, flags=frozenset())


def test_stream_tokenises_the_next_chunk_in_a_thread(tiny_extractors, monkeypatch):
    import threading

    import layerwise.extractor as lx

    ex = tiny_extractors["bert"]
    texts = [f"sentence {i} " + "word " * (i % 7) for i in range(11)]
    want = ex.encode(texts, layers=-1)
    monkeypatch.setattr(lx, "CHUNK_RECORDS", 3)
    seen = []
    real = lx.TextTokenizer.__call__
    monkeypatch.setattr(lx.TextTokenizer, "__call__",
                        lambda self, *a, **k: seen.append(threading.current_thread().name) or real(self, *a, **k))
    spec = lw.EncodeSpec(layers=-1)
    got = [r for r in ex.stream(iter(texts), spec)]
    assert [r.index for r in got] == list(range(11))
    # chunks of 3 pad to other lengths than one batch of 11: float32 rounding differs, nothing else
    np.testing.assert_allclose(np.stack([r.features.numpy() for r in got]), want, rtol=1e-5, atol=1e-5)
    assert seen[0] == threading.current_thread().name  # the first chunk: nothing to overlap with yet
    assert len(seen) == 4 and all(name.startswith("layerwise-tokenize") for name in seen[1:])
    stream = ex.stream(iter(texts), spec)
    next(stream)
    stream.close()  # abandoning the stream stops the thread
    with pytest.raises(TypeError, match="text 7 must be a string, got NoneType"):
        list(ex.stream(iter(texts[:7] + [None] + texts[8:]), spec))


def test_hidden_states_return_tensors(default_extractor):
    """hidden_states takes return_tensors as encode does; its default stays torch (issue 41, item 8)."""
    pt = default_extractor.hidden_states(["I love Paris", "Hi"], layers=[0, 3, 5])
    np_stack = default_extractor.hidden_states(["I love Paris", "Hi"], layers=[0, 3, 5], return_tensors="np")
    assert isinstance(pt.tensor, torch.Tensor)  # the default stays torch, as before
    assert isinstance(np_stack.tensor, np.ndarray) and np_stack.tensor.dtype == np.float32
    assert isinstance(np_stack.attention_mask, np.ndarray)
    assert np_stack.attention_mask.tolist() == pt.attention_mask.tolist()
    assert np.abs(np_stack.tensor - pt.numpy()).max() <= 1e-6 and np_stack.shape == tuple(pt.shape)
    assert isinstance(np_stack[-1], np.ndarray) and np.array_equal(np_stack.layer(3), pt.layer(3).numpy())
    assert [h.shape for h in np_stack] == [(2, 5, 384)] * 3 and np_stack.norms() == pytest.approx(pt.norms())
    assert "LayerStack" in np_stack._repr_html_()
    with pytest.raises(ValueError, match=r"unknown return_tensors 'tf'. Valid values are: np, pt"):
        default_extractor.hidden_states(["x"], return_tensors="tf")
