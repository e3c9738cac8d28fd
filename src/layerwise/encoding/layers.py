"""Layer specs and site names: parse, resolve, validate.

Layer addressing (one rule, said everywhere)
-------------------------------------------
Index 0 is the embeddings output (the input of the first encoder layer); index ``i`` in ``1..L`` is
the output of encoder layer ``i``; negative indices count from the end (``-1`` is the last layer).
This is the Hugging Face ``hidden_states`` convention: ``hidden_states[i]`` is layer ``i`` here.

A layer spec is one of:

=====================  ==========================================================
``4``, ``-1``          one index
``[0, 2, 4, 6]``       a list (or tuple, or ``range``) of indices (order kept, duplicates refused)
``"-4:"``, ``"1:5"``   a Python slice written as a string (``"::2"`` works too)
``"all"``              every layer, embeddings included: ``0..L``
``"embeddings"``       ``0``
``"last"``             ``L``
``"second_to_last"``   ``L - 1``
``"3"``                a string holding one integer
``"0,2,4,6"``          comma-separated items of the above (``"0,-4:"``), as on the command line
=====================  ==========================================================

``-0`` (a string ``"-0"`` or a slice bound ``"-0:"``) is refused as ambiguous: write ``0`` for the embeddings or
``-1`` for the last layer. A spec string is at most :data:`MAX_SPEC_CHARS` characters and a list (or a
comma-separated string) at most :data:`MAX_SPEC_ITEMS` items: far more than any model's layers need.

Sites (what is recorded inside layer ``i``)
-------------------------------------------
==================  ===========================================================  ===================
site                meaning                                                      layers
==================  ===========================================================  ===================
``block``           the layer's output, identical to ``hidden_states[i]``        ``0..L`` (default)
``raw``             the layer module's own output: ``block`` except where the    ``0..L``
                    model transforms it before ``hidden_states`` (a decoder's,
                    T5's or ModernBERT's final norm at ``L``; DeBERTa-v2's conv
                    at 1): the last layer's output before the final norm
``attention``       output of the attention sub-block (after its residual and    ``1..L``
                    LayerNorm, i.e. the input of the feed-forward sub-block)
``intermediate``    feed-forward intermediate activations, after the activation  ``1..L``
                    function; width ``intermediate_size`` (e.g. 4 x hidden)
``pre_ln``          the residual sum just before the layer's output LayerNorm    ``1..L``
                    (``ffn_out + attention_out``: "before the final LayerNorm")
==================  ===========================================================  ===================

Which module of each BERT family realises each site is listed in :mod:`layerwise.model.families`; for every other
architecture the sub-layer sites are found by module name and kept only where they hold (see
:mod:`layerwise.model.discovery`: for pre-LN decoders ``attention`` is the attention module's output before the
residual,
and ``pre_ln`` does not exist). ``Extractor.sites`` lists what a model has.

Example::

    >>> from layerwise.encoding.layers import resolve_layers
    >>> resolve_layers("-4:", num_layers=12)
    (9, 10, 11, 12)
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence, Union

from ..errors import SpecError
from .vocab import SITES

LayerSpec = Union[int, str, range, Sequence[Union[int, str]]]

LAYER_NAMES = ("embeddings", "last", "second_to_last", "all")
_SLICE_RE = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*(?::\s*(-?\d+)?\s*)?$", re.ASCII)  # ASCII digits only
_INT_RE = re.compile(r"^\s*-?\d+\s*$", re.ASCII)
# a model has at most a few hundred layers: "0, 1, ..., 300" is ~1,400 characters. Longer specs are refused before any
# parsing, so a hostile spec (a service request, a JSON file) costs nothing and no message repeats megabytes of it
MAX_SPEC_CHARS = 2_000
MAX_SPEC_ITEMS = 1_000


def _example(num_layers: int) -> str:
    return f'e.g. layers=-1, layers=[0, {num_layers // 2}], layers="-{min(4, max(num_layers, 1))}:", layers="all"'


def _flag_example(num_layers: int) -> str:
    """:func:`_example` as the command line writes it (``--layers 0,3``)."""
    return f"e.g. --layers -1, --layers 0,{num_layers // 2}, --layers -{min(4, max(num_layers, 1))}:, --layers all"


def _error(problem: str, num_layers: int) -> SpecError:
    """A :class:`SpecError` saying ``problem`` and an example of a valid spec, in Python's words and (its
    ``flag_message``) in the command line's."""
    return SpecError(f"{problem}; {_example(num_layers)}", flag_message=f"{problem}; {_flag_example(num_layers)}")


def _range_text(num_layers: int) -> str:
    return (
        f"this model has layers 0..{num_layers} (0 = embeddings, {num_layers} = last) "
        f"or -{num_layers + 1}..-1 counting from the end"
    )


def _index(value: int, num_layers: int, spec: object) -> int:
    n = num_layers + 1
    if not -n <= value < n:
        raise _error(f"layer {value} in layer spec {spec!r} is out of range: {_range_text(num_layers)}", num_layers)
    return value % n


def _one(item: object, num_layers: int, spec: object) -> list[int]:
    if isinstance(item, bool):
        raise TypeError(f"layer spec {spec!r} holds a bool ({item!r}); use ints or strings, {_example(num_layers)}")
    if isinstance(item, int) or (hasattr(item, "__index__") and not isinstance(item, str)):
        return [_index(int(item), num_layers, spec)]
    if not isinstance(item, str):
        raise TypeError(
            f"layer spec item {item!r} has type {type(item).__name__}; expected int, str or a list of them; "
            f"{_example(num_layers)}"
        )
    text = item.strip().lower()
    if re.search(r"(^|[:\s])-0+(?=$|[:\s])", text):
        raise _error(f"layer spec {item!r} holds -0, which is ambiguous: use 0 for the embeddings or -1 for the last "
                     f"layer", num_layers)
    if text == "all":
        return list(range(num_layers + 1))
    if text == "embeddings":
        return [0]
    if text == "last":
        return [num_layers]
    if text in ("second_to_last", "second-to-last"):
        if num_layers < 1:
            raise SpecError(f"'second_to_last' needs a model with at least 1 encoder layer; {_range_text(num_layers)}")
        return [num_layers - 1]
    if _INT_RE.match(text):
        return [_index(int(text), num_layers, spec)]
    m = _SLICE_RE.match(text)
    if m:
        start, stop, step = (int(g) if g is not None else None for g in m.groups())
        if step == 0:
            raise _error(f"layer slice {item!r} has step 0", num_layers)
        for bound in (start, stop):
            if bound is not None and not -(num_layers + 1) <= bound <= num_layers + 1:
                raise _error(f"layer slice {item!r} has bound {bound} out of range: {_range_text(num_layers)}",
                             num_layers)
        picked = list(range(num_layers + 1))[slice(start, stop, step)]
        if not picked:
            raise _error(f"layer slice {item!r} selects no layer: {_range_text(num_layers)}", num_layers)
        return picked
    raise _error(f"malformed layer spec {item!r}: expected an int, a slice string like '-4:' or '1:5', or one of "
                 f"{', '.join(repr(n) for n in LAYER_NAMES)}; {_range_text(num_layers)}", num_layers)


def resolve_layers(spec: LayerSpec, num_layers: int) -> tuple[int, ...]:
    """Resolve a layer spec to sorted-as-given, non-negative indices in ``0..num_layers``.

    Args:
        spec: see the module docstring (int, list, tuple or ``range``, slice string, ``"all"``, a name).
        num_layers: the model's number of encoder layers ``L`` (``hidden_states`` has ``L + 1`` entries).

    Returns:
        A tuple of distinct indices, in the order the spec gives them.

    Raises:
        SpecError: out-of-range index, malformed string, empty list, duplicates, a string over
            :data:`MAX_SPEC_CHARS` characters or a list over :data:`MAX_SPEC_ITEMS` items.
        TypeError: an item that is neither int nor str.
    """
    _check_size(spec)
    if isinstance(spec, range):  # range(3) is the list [0, 1, 2]
        spec = list(spec)
    given = spec  # messages name the spec as the user wrote it ('0,9', not [0, 9])
    if isinstance(spec, str) and "," in spec:  # "0,2,4,6" or "0,-4:": the CLI grammar, accepted everywhere
        parts = [p.strip() for p in spec.split(",")]
        if not all(parts):
            raise _error(f"layer spec {spec!r} has an empty item between commas", num_layers)
        _check_size(parts, spec)
        spec = [int(p) if _INT_RE.match(p) and p.strip() != "-0" else p for p in parts]
    if isinstance(spec, (list, tuple)):
        if len(spec) == 0:
            raise _error("layer spec is an empty list", num_layers)
        out: list[int] = []
        for item in spec:
            if isinstance(item, (list, tuple)):
                raise TypeError(f"layer spec {spec!r} is nested; give a flat list, {_example(num_layers)}")
            _check_size(item)
            out.extend(_one(item, num_layers, given))
    elif spec is None:
        raise TypeError(f"layer spec is None; {_example(num_layers)}")
    else:
        out = _one(spec, num_layers, spec)
    if len(set(out)) != len(out):
        dup = sorted(i for i, n in Counter(out).items() if n > 1)
        raise _error(f"layer spec {_short(given, 300)} names layer(s) {dup} more than once", num_layers)
    return tuple(out)


def _short(value: object, keep: int = 60) -> str:
    """``repr(value)``, cut to ``keep`` characters and ``...`` when longer (a refused spec may be megabytes long)."""
    head = value[:keep] if isinstance(value, (str, list, tuple)) else value
    text = repr(head)
    cut = len(text) > keep or (isinstance(value, (str, list, tuple)) and len(value) > keep)
    return text[:keep] + "..." if cut else text


def _check_size(spec: object, given: object = None) -> None:
    """:class:`SpecError` for a spec string over :data:`MAX_SPEC_CHARS` characters or a list (or comma-separated
    string, ``given``) over :data:`MAX_SPEC_ITEMS` items; such a spec is never parsed."""
    if isinstance(spec, str) and len(spec) > MAX_SPEC_CHARS:
        problem = (f"layer spec string {_short(spec)} is {len(spec):,} characters long; the limit is "
                   f"{MAX_SPEC_CHARS:,} characters. A layer spec names each layer at most once: use a slice or a name "
                   f"for many layers")
        raise SpecError(f'{problem}, e.g. layers="all", layers="-4:" or layers="::2"',
                        flag_message=f"{problem}, e.g. --layers all, --layers -4: or --layers ::2")
    if isinstance(spec, (list, tuple, range)) and len(spec) > MAX_SPEC_ITEMS:
        what = f"string {_short(given)}" if isinstance(given, str) else f"list {_short(spec)}"
        problem = (f"layer spec {what} has {len(spec):,} items; the limit is {MAX_SPEC_ITEMS:,} items. A layer spec "
                   f"names each layer at most once: use a slice or a name for many layers")
        raise SpecError(f'{problem}, e.g. layers="all", layers="-4:" or layers="::2"',
                        flag_message=f"{problem}, e.g. --layers all, --layers -4: or --layers ::2")


def validate_site(site: object, layers: Sequence[int] | None = None) -> str:
    """Check a site name (and that every layer has it); returns the canonical name.

    Raises:
        SpecError: unknown site, or a sub-layer site asked for layer 0 (the embeddings have no sub-blocks).
    """
    if not isinstance(site, str) or site not in SITES:
        raise SpecError(f"unknown site {site!r}. Valid sites are: {', '.join(SITES)} (default 'block')")
    if site not in ("block", "raw") and layers is not None and 0 in layers:
        problem = f"site {site!r} exists only in encoder layers 1..L, but the layer spec includes 0 (the embeddings)"
        raise SpecError(f"{problem}; drop layer 0 (e.g. layers='1:') or use site='block' or 'raw'",
                        flag_message=f"{problem}; drop layer 0 (e.g. --layers 1:) or use --site block or raw")
    return site


def layer_label(index: int) -> str:
    """Human label for a resolved index: ``"embeddings"`` for 0, ``"layer_i"`` otherwise."""
    return "embeddings" if index == 0 else f"layer_{index}"
