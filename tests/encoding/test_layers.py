"""Layer specs and sites (layerwise.encoding.layers), and the LayerStack label helpers, without a model."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from layerwise import LayerStack, resolve_layers
from layerwise.encoding.layers import layer_label, validate_site

ALL6, ALL12 = tuple(range(7)), tuple(range(13))
EXAMPLE6 = 'e.g. layers=-1, layers=[0, 3], layers="-4:", layers="all"'


@pytest.mark.parametrize(
    "spec, n, want",
    [
        (0, 6, (0,)),
        (6, 6, (6,)),
        (-1, 6, (6,)),
        (-2, 6, (5,)),
        (-7, 6, (0,)),
        (0, 12, (0,)),
        (12, 12, (12,)),
        (-1, 12, (12,)),
        (-13, 12, (0,)),
        (np.int64(3), 6, (3,)),
        ([0, 2, 4, 6], 6, (0, 2, 4, 6)),
        ([6, 0], 6, (6, 0)),
        ([-1, 0], 12, (12, 0)),
        ((1, -1), 6, (1, 6)),
        (["last", 0], 6, (6, 0)),
        (["-2:", 0], 6, (5, 6, 0)),
        (["3", 1], 12, (3, 1)),
        ("-4:", 6, (3, 4, 5, 6)),
        ("-4:", 12, (9, 10, 11, 12)),
        ("1:5", 6, (1, 2, 3, 4)),
        ("1:5", 12, (1, 2, 3, 4)),
        ("::2", 6, (0, 2, 4, 6)),
        ("::2", 12, (0, 2, 4, 6, 8, 10, 12)),
        ("::-1", 6, (6, 5, 4, 3, 2, 1, 0)),
        (" -4 : ", 6, (3, 4, 5, 6)),
        (":2", 12, (0, 1)),
        ("0:7", 6, ALL6),
        ("all", 6, ALL6),
        ("all", 12, ALL12),
        ("ALL", 6, ALL6),
        ("embeddings", 6, (0,)),
        ("embeddings", 12, (0,)),
        ("last", 6, (6,)),
        ("last", 12, (12,)),
        ("second_to_last", 6, (5,)),
        ("second_to_last", 12, (11,)),
        ("second-to-last", 6, (5,)),
        ("3", 6, (3,)),
        ("-1", 12, (12,)),
        (" 2 ", 6, (2,)),
    ],
)
def test_resolve_valid_specs(spec, n, want):
    got = resolve_layers(spec, num_layers=n)
    assert got == want
    assert isinstance(got, tuple) and all(type(i) is int for i in got)


@pytest.mark.parametrize("n", [6, 12])
def test_out_of_range_int_names_value_range_and_example(n):
    for bad in (n + 1, -(n + 2), 100):
        with pytest.raises(ValueError, match=rf"layer {bad} in layer spec {bad} is out of range") as info:
            resolve_layers(bad, num_layers=n)
        msg = str(info.value)
        assert f"this model has layers 0..{n} (0 = embeddings, {n} = last)" in msg
        assert f"-{n + 1}..-1 counting from the end" in msg
        assert 'layers="-4:"' in msg and "layers=-1" in msg


def test_out_of_range_exact_readme_message():
    with pytest.raises(ValueError) as info:
        resolve_layers(7, num_layers=6)
    assert str(info.value) == (
        "layer 7 in layer spec 7 is out of range: this model has layers 0..6 (0 = embeddings, 6 = last) "
        "or -7..-1 counting from the end; " + EXAMPLE6
    )


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("7", r"layer 7 in layer spec '7' is out of range: this model has layers 0\.\.6"),
        ([0, 9], r"layer 9 in layer spec \[0, 9\] is out of range: this model has layers 0\.\.6"),
        (["last", -8], r"layer -8 in layer spec \['last', -8\] is out of range"),
        ("0:9", r"layer slice '0:9' has bound 9 out of range: this model has layers 0\.\.6"),
        ("-8:", r"layer slice '-8:' has bound -8 out of range"),
    ],
)
def test_out_of_range_in_strings_lists_and_slices(spec, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        resolve_layers(spec, num_layers=6)
    assert 'layers="-4:"' in str(info.value)


@pytest.mark.parametrize("spec", ["first", "1-3", "1:2:3:4", "", "layer_3", "4 5", "1.5", "-4 :: 2 :",
                                  "\u0663", "\uff13", "-\u0662:", "1:\u0663"])  # digits: ASCII only (\u0663 is 3)
def test_malformed_string(spec):
    with pytest.raises(ValueError, match=rf"malformed layer spec {re.escape(repr(spec))}: expected an int") as info:
        resolve_layers(spec, num_layers=6)
    msg = str(info.value)
    assert "'embeddings', 'last', 'second_to_last', 'all'" in msg
    assert "layers 0..6" in msg and 'layers="-4:"' in msg


@pytest.mark.parametrize("spec", [[], ()])
def test_empty_list(spec):
    with pytest.raises(ValueError, match=r"layer spec is an empty list; e\.g\. layers=-1"):
        resolve_layers(spec, num_layers=6)


@pytest.mark.parametrize(
    "spec, dup",
    [
        ([1, 1], r"\[1\]"),
        ([6, -1], r"\[6\]"),
        (["last", 6], r"\[6\]"),
        (["all", 0, 2], r"\[0, 2\]"),
        (["-2:", "5"], r"\[5\]"),
        (["embeddings", "0"], r"\[0\]"),
    ],
)
def test_duplicates_refused(spec, dup):
    with pytest.raises(ValueError, match=rf"names layer\(s\) {dup} more than once"):
        resolve_layers(spec, num_layers=6)


@pytest.mark.parametrize("spec", [True, False, [True], [0, False]])
def test_bool_refused(spec):
    with pytest.raises(TypeError, match=r"holds a bool \((True|False)\); use ints or strings"):
        resolve_layers(spec, num_layers=6)


@pytest.mark.parametrize("spec", [[[1, 2]], [0, (1, 2)]])
def test_nested_list_refused(spec):
    with pytest.raises(TypeError, match=r"is nested; give a flat list"):
        resolve_layers(spec, num_layers=6)


def test_none_and_other_types_refused():
    with pytest.raises(TypeError, match=r"layer spec is None; e\.g\. layers=-1"):
        resolve_layers(None, num_layers=6)
    with pytest.raises(TypeError, match=r"layer spec item 1\.5 has type float; expected int, str or a list"):
        resolve_layers(1.5, num_layers=6)
    with pytest.raises(TypeError, match=r"layer spec item \{1\} has type set"):
        resolve_layers({1}, num_layers=6)


def test_range_is_a_list_of_indices():
    """``range(3)`` works wherever a list does (issue 41, item 2): resolving, a spec (and its JSON), a stack."""
    from layerwise import EncodeSpec

    assert resolve_layers(range(3), num_layers=6) == (0, 1, 2)
    assert resolve_layers(range(-1, -4, -1), num_layers=6) == (6, 5, 4)
    spec = EncodeSpec(layers=range(1, 4))
    assert spec.layers == (1, 2, 3) and EncodeSpec.from_json(spec.to_json()) == spec
    assert _stack().select(range(0, 7, 2)).layers == (0, 2, 4, 6)
    with pytest.raises(ValueError, match=r"layer spec is an empty list"):
        resolve_layers(range(0), num_layers=6)
    with pytest.raises(ValueError, match=r"layer 7 in layer spec \[5, 6, 7\] is out of range"):
        resolve_layers(range(5, 8), num_layers=6)
    with pytest.raises(ValueError, match=r"has 1,000,000 items; the limit is 1,000 items"):
        EncodeSpec(layers=range(10**6)).resolve(_Facts())


class _Facts:
    num_layers, sites, has_pooler = 6, ("block",), False

    def site_width(self, site):
        return 4


@pytest.mark.parametrize("spec", ["::0", "1:5:0", "-4::0"])
def test_step_zero_slice(spec):
    with pytest.raises(ValueError, match=rf"layer slice {re.escape(repr(spec))} has step 0"):
        resolve_layers(spec, num_layers=6)


@pytest.mark.parametrize("spec", ["5:2", "3:3", "-1:-3", "7:"])
def test_slice_selecting_nothing(spec):
    with pytest.raises(ValueError, match=rf"layer slice {re.escape(repr(spec))} selects no layer: .*layers 0\.\.6"):
        resolve_layers(spec, num_layers=6)


def test_second_to_last_needs_a_layer():
    with pytest.raises(ValueError, match="'second_to_last' needs a model with at least 1 encoder layer"):
        resolve_layers("second_to_last", num_layers=0)
    assert resolve_layers("all", num_layers=0) == (0,)


def test_validate_site():
    for site in ("block", "attention", "intermediate", "pre_ln"):
        assert validate_site(site) == site
        assert validate_site(site, [1, 6]) == site
    assert validate_site("block", [0, 3]) == "block"
    for bad in ("ffn", "Block", "", None, 3):
        with pytest.raises(ValueError, match=r"Valid sites are: block, raw, attention, intermediate, pre_ln") as info:
            validate_site(bad)
        assert f"unknown site {bad!r}" in str(info.value)


@pytest.mark.parametrize("site", ["attention", "intermediate", "pre_ln"])
def test_sub_layer_site_refused_on_embeddings(site):
    with pytest.raises(ValueError, match=rf"site '{site}' exists only in encoder layers 1\.\.L") as info:
        validate_site(site, resolve_layers("all", 6))
    assert "layers='1:'" in str(info.value) and "site='block'" in str(info.value)


def test_layer_label():
    assert [layer_label(i) for i in (0, 1, 12)] == ["embeddings", "layer_1", "layer_12"]


def _stack(layers=(0, 2, 4, 6), num_layers=6) -> LayerStack:
    g = torch.Generator().manual_seed(0)
    tensor = torch.randn(len(layers), 2, 3, 4, generator=g)
    ones = torch.ones(2, 3, dtype=torch.long)
    return LayerStack(
        tensor=tensor,
        layers=tuple(layers),
        sites=("block",) * len(layers),
        attention_mask=ones,
        input_ids=ones,
        special_tokens_mask=ones,
        word_ids=[[None, 0, None]] * 2,
        offsets=[[(0, 0), (0, 1), (0, 0)]] * 2,
        num_layers=num_layers,
    )


def test_layer_stack_len_shape_numpy_repr():
    stack = _stack()
    assert len(stack) == 4 and stack.shape == (4, 2, 3, 4)
    assert stack.labels == ("embeddings", "layer_2", "layer_4", "layer_6")
    arr = stack.numpy()
    assert arr.dtype == np.float32 and np.array_equal(arr, stack.tensor.numpy())
    text = repr(stack)
    assert "['embeddings', 'layer_2', 'layer_4', 'layer_6']" in text and "(4, 2, 3, 4)" in text
    assert "site='block'" in text


def test_layer_stack_ints_are_positions_names_and_layer_are_model_layers():
    stack = _stack()  # model layers 0, 2, 4, 6 at positions 0..3
    assert torch.equal(stack["layer_4"], stack.tensor[2]) and torch.equal(stack.layer(4), stack.tensor[2])
    assert torch.equal(stack[2], stack.tensor[2]) and torch.equal(stack[-2], stack.tensor[2])  # positions
    assert torch.equal(stack.layer(-3), stack.tensor[2])  # model layer -3 of 6 is layer 4
    assert torch.equal(stack["last"], stack.tensor[3]) and torch.equal(stack["embeddings"], stack.tensor[0])
    assert torch.equal(stack[-1], stack.layer(6)) and len(list(stack)) == len(stack) == 4
    with pytest.raises(KeyError, match=r"layer 'second_to_last' \(index 5\) was not captured; this stack holds"):
        stack["second_to_last"]
    with pytest.raises(KeyError, match=r"layer 'layer_9' \(index 9\) was not captured"):
        stack["layer_9"]
    with pytest.raises(IndexError, match=r"stack position 4 is out of range: this stack holds 4 layer\(s\) "
                                         r"\['embeddings', 'layer_2', 'layer_4', 'layer_6'\], positions 0\.\.3"):
        stack[4]
    with pytest.raises(ValueError, match=r"layer 9 in layer spec 9 is out of range"):
        stack.layer(9)
    with pytest.raises(KeyError, match=r"model layer 3 \(index 3\) was not captured"):
        stack.layer(3)


def test_layer_stack_select_keeps_spec_order():
    stack = _stack()
    sub = stack.select([6, 0])
    assert sub.layers == (6, 0) and sub.labels == ("layer_6", "embeddings")
    assert torch.equal(sub.tensor[0], stack.tensor[3]) and torch.equal(sub.tensor[1], stack.tensor[0])
    assert sub.num_layers == 6 and sub.sites == ("block", "block")
    with pytest.raises(KeyError, match="was not captured"):
        stack.select("-2:")  # layer 5 is not in the stack


# ---- hostile specs: size limits and linear resolution (issue 25) -------------------------------------------------
def _timed(fn):
    import time

    t0 = time.perf_counter()
    try:
        fn()
    except ValueError as exc:
        return time.perf_counter() - t0, exc
    return time.perf_counter() - t0, None


@pytest.mark.parametrize(
    "spec, size",
    [
        (",".join(["all"] * 5000), "19,999 characters"),  # 20 KB: 7.8 s with the quadratic duplicate check
        ("0," * 1_400_000, "2,800,000 characters"),  # 2.8 MB: minutes before
        (["all"] * 5000, "5,000 items"),
        ([0] * 1_000_000, "1,000,000 items"),
        (["0:" + "1" * 3000], "3,002 characters"),  # one huge item inside a list
    ],
)
def test_hostile_specs_refused_fast_naming_length_and_limit(spec, size):
    from layerwise import SpecError
    from layerwise.encoding.layers import MAX_SPEC_CHARS, MAX_SPEC_ITEMS

    seconds, exc = _timed(lambda: resolve_layers(spec, num_layers=12))
    assert seconds < 1.0, f"took {seconds:.2f} s"
    assert isinstance(exc, SpecError)
    msg = str(exc)
    assert size in msg
    assert f"the limit is {MAX_SPEC_CHARS:,} characters" in msg or f"the limit is {MAX_SPEC_ITEMS:,} items" in msg
    assert len(msg) < 400 and 'layers="all"' in msg and "..." in msg  # the spec is shown cut, not in full


def test_longest_honest_specs_resolve():
    every = list(range(301))  # a 300-layer model, every layer listed by hand
    assert resolve_layers(", ".join(map(str, every)), num_layers=300) == tuple(every)
    assert resolve_layers(every, num_layers=300) == tuple(every)
    assert resolve_layers([str(i) for i in every], num_layers=300) == tuple(every)


def test_duplicates_in_long_specs_found_in_linear_time():
    from layerwise.encoding.layers import MAX_SPEC_CHARS, MAX_SPEC_ITEMS

    # just under both limits: every item a duplicate of every other; the old check counted each of 301,000 indices
    spec = ["all"] * MAX_SPEC_ITEMS
    seconds, exc = _timed(lambda: resolve_layers(spec, num_layers=300))
    assert seconds < 1.0, f"took {seconds:.2f} s"
    assert f"names layer(s) {list(range(301))} more than once" in str(exc)
    text = ",".join(["all"] * (MAX_SPEC_CHARS // 4))
    seconds, exc = _timed(lambda: resolve_layers(text, num_layers=300))
    assert seconds < 1.0, f"took {seconds:.2f} s"
    assert f"names layer(s) {list(range(301))} more than once" in str(exc)
    assert len(str(exc)) < 2000  # the spec is shown cut to its start


def test_duplicate_message_unchanged_for_short_specs():
    with pytest.raises(ValueError) as info:
        resolve_layers(["all", 0, 2], num_layers=6)
    assert str(info.value) == "layer spec ['all', 0, 2] names layer(s) [0, 2] more than once; " + EXAMPLE6
