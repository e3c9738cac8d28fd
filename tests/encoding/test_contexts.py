"""Packing a token stream into fixed-length contexts (layerwise.encoding.contexts): every stream token once, in order,
a BOS first in every context, separators between records, and a resume that skips the stored tokens gives the same
contexts after them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerwise.encoding.contexts import ContextPacker, ContextSpec, special_ids
from layerwise.errors import SpecError

records = st.lists(st.lists(st.integers(10, 99), max_size=12), max_size=20)


def pack(recs, size, bos, sep, skip=0):
    packer = ContextPacker(size, bos, sep, skip=skip)
    out = []
    for line, ids in enumerate(recs, start=1):
        out += packer.feed(ids, line)
    return out, packer


@settings(max_examples=200, deadline=None)
@given(recs=records, size=st.integers(2, 9), bos=st.sampled_from([None, 1]), sep=st.sampled_from([None, 2]))
def test_contexts_hold_the_stream_in_order_once(recs, size, bos, sep):
    contexts, packer = pack(recs, size, bos, sep)
    stream: list[int] = []
    for ids in recs:
        if ids:
            if stream and sep is not None:
                stream.append(sep)
            stream += ids
    body = [c[1:] if bos is not None else c for c, _ in contexts]
    flat = [int(t) for b in body for t in b]
    assert flat == stream[: len(flat)]
    assert len(stream) - len(flat) == packer.left_over < packer.take
    assert all(len(c) == size and c.dtype == np.int32 for c, _ in contexts)
    if bos is not None:
        assert all(c[0] == bos for c, _ in contexts)
    assert packer.consumed == len(flat) and packer.contexts == len(contexts)


@settings(max_examples=100, deadline=None)
@given(recs=records, size=st.integers(2, 9), cut=st.integers(0, 30))
def test_a_resume_skipping_the_stored_tokens_gives_the_same_contexts_after_them(recs, size, cut):
    whole, _ = pack(recs, size, 1, 2)
    cut = min(cut, len(whole))
    first, packer = pack(recs, size, 1, 2)
    consumed = cut * packer.take
    rest, _ = pack(recs, size, 1, 2, skip=consumed)
    assert [c.tolist() for c, _ in rest] == [c.tolist() for c, _ in whole[cut:]]
    assert [line for _, line in rest] == [line for _, line in whole[cut:]]


def test_a_context_names_the_line_of_its_first_stream_token():
    contexts, _ = pack([[5, 6, 7, 8], [9, 10], [11, 12, 13]], 4, 0, 2)
    assert [(c.tolist(), line) for c, line in contexts] == [([0, 5, 6, 7], 1), ([0, 8, 2, 9], 1),
                                                            ([0, 10, 2, 11], 2)]


def test_the_spec_refuses_bad_values_naming_them():
    with pytest.raises(SpecError, match="float8"):
        ContextSpec(layers=(1,), dtype="int8")
    with pytest.raises(SpecError, match="context_size 1"):
        ContextSpec(layers=(1,), context_size=1)
    with pytest.raises(SpecError, match="twice"):
        ContextSpec(layers=(1, 1))
    with pytest.raises(SpecError, match="site"):
        ContextSpec(layers=(1,), site="mlp")
    spec = ContextSpec(layers=(0, 2), context_size=16, dtype="float8")
    assert ContextSpec.from_dict(spec.to_dict()) == spec
    assert spec.row_bytes(32) == 2 * (32 + 4)


def test_special_ids_of_a_decoder_and_an_encoder(arch_dirs, tiny_dirs):
    from transformers import AutoTokenizer

    bert = AutoTokenizer.from_pretrained(tiny_dirs["bert"])
    assert special_ids(bert)[:2] == (bert.cls_token_id, bert.sep_token_id)
    llama = AutoTokenizer.from_pretrained(arch_dirs["llama"])
    bos, sep, every = special_ids(llama)
    assert bos == llama.bos_token_id and sep == llama.eos_token_id and bos in every
