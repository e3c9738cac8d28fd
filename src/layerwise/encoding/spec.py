"""``EncodeSpec``: what to compute, said once. The store manifest, the service request and a head's config hold one.

An :class:`EncodeSpec` names the layers, the site inside each layer, how the layers are combined, the level of
the result (one vector per sentence, per token or per word) and how tokens are pooled. It is a frozen dataclass
that validates itself when built (modes, weights, options that do not apply to the level), resolves and
validates its layers against a model with :meth:`EncodeSpec.resolve`, and round-trips through JSON.

==========================  ================================================================================
field                       valid values
==========================  ================================================================================
``layers``                  a layer spec: ``-1``, ``[0, 6]``, ``range(3)``, ``"-4:"``, ``"all"``, ``"second_to_last"``
                            (0 = embeddings; see :mod:`layerwise.encoding.layers`)
``site``                    ``block | raw | attention | intermediate | pre_ln``
``combine``                 ``concat | sum | mean | weighted | stack | scalar_mix | attention`` (the last two are
                            learned: heads and probes train them; see :mod:`layerwise.encoding.combine`)
``weights``                 one finite number per layer, for ``combine="weighted"`` only
``level``                   ``sentence`` (``[D]`` a record) ``| token`` (``[n_tokens, D]``) ``| word``
                            (``[n_words, D]``)
``pool``                    level ``sentence``: ``cls | pooler | mean | max | mean_max | last | attention``
                            (default ``mean``; ``attention`` is learned)
``subword``                 level ``word``: ``first | last | mean | max | first_last`` (default ``first``)
``skip_special_tokens``     level ``sentence``: leave ``[CLS]``/``[SEP]``-like tokens out of the pool
``normalize``               level ``sentence``: L2-normalise each vector over its last axis (sentence-transformers'
                            ``Normalize`` module; a ``stack`` is normalised layer by layer)
``truncate``                cut long texts at the model maximum instead of windowing them
``prompt``                  levels ``sentence``/``token``: text put before every record (an instruction such as
                            ``"query: "`` or ``"Instruct: ...\nQuery: "``, sentence-transformers' ``prompt``); its
                            tokens are part of the record (pooled, and listed at level ``token``)
``add_eos``                 append the tokenizer's end-of-sequence token to every record when the tokenizer does
                            not add it itself (decoder embedding models read the last token: ``pool="last"``)
``output_dtype``            of the features returned and stored: ``float32 | float16 | int8 | uint8 | binary |
                            ubinary`` (the model computes in its own ``compute_dtype``, a
                            :class:`~layerwise.ModelOptions` field; see :mod:`layerwise.encoding.precision`);
                            ``dtype`` in JSON written by layerwise 0.x is read as ``output_dtype``
``dimensions``              keep the leading ``dimensions`` values of the last axis (Matryoshka models), before
                            ``normalize`` and ``output_dtype``; ``None`` keeps all
``calibration``             ``int8``/``uint8`` only, and required there (when resolved): per-value
                            ``(min, max)`` ranges of a calibration set (:meth:`EncodeSpec.calibrated`,
                            ``Extractor.calibrate``)
==========================  ================================================================================

Example::

    >>> import layerwise as lw
    >>> spec = lw.EncodeSpec(layers="-4:", combine="concat", pool="max")
    >>> spec.resolve(lw.Extractor()).layers                        # the default model has 6 layers
    (3, 4, 5, 6)
    >>> lw.EncodeSpec.from_json(spec.to_json()) == spec
    True
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence, TypeGuard

if TYPE_CHECKING:
    from torch import nn

from ..config_json import dump_json, fields_from, read_json_arg
from ..errors import SpecError
from .layers import MAX_SPEC_ITEMS, LayerSpec, resolve_layers, validate_site
from .precision import Ranges, calibration_ranges, check_calibration, packed_width, require_calibration
from .vocab import (
    CALIBRATED_DTYPES,
    COMBINE_MODES,
    LEARNED_POOLS,
    LEVELS,
    OUTPUT_DTYPES,
    POOL_MODES,
    check_weights,
    combined_shape,
    is_module,
    validate_combine,
    validate_pool,
    validate_word_pool,
)

# field names of earlier versions, read from manifests, head configs and requests they wrote
LEGACY_FIELDS = {"dtype": "output_dtype"}


class ModelFacts(Protocol):
    """What :meth:`EncodeSpec.resolve` needs to know about a model (an :class:`~layerwise.Extractor` has it)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def sites(self) -> tuple[str, ...]: ...

    @property
    def has_pooler(self) -> bool: ...

    def site_width(self, site: str) -> int: ...


def _plain_layers(layers: object) -> object:
    """Lists and ranges become tuples (hashable, frozen, JSON as a list); everything else is checked by
    :func:`resolve_layers` later."""
    if isinstance(layers, list) or (isinstance(layers, range) and len(layers) <= MAX_SPEC_ITEMS):
        return tuple(layers)
    return layers


def _are_indices(layers: LayerSpec) -> TypeGuard[tuple[int, ...]]:
    """Whether ``layers`` is a tuple of non-negative int indices (what :meth:`EncodeSpec.resolve` leaves)."""
    return isinstance(layers, tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
    )


@dataclass(frozen=True)
class EncodeSpec:
    """What to compute from a model's hidden layers (see the module docstring for every field's valid values).

    Shapes of one record's result, ``D`` from :meth:`feature_shape`: ``[*D]`` at level ``sentence``,
    ``[n_tokens, *D]`` at level ``token`` (special tokens included), ``[n_words, *D]`` at level ``word``.
    """

    layers: LayerSpec = -1
    site: str = "block"
    combine: str | nn.Module = "concat"
    weights: Sequence[float] | None = None  # stored as a tuple of floats (see check_weights)
    level: str = "sentence"
    pool: str | nn.Module | None = None
    subword: str | None = None
    skip_special_tokens: bool = False
    truncate: bool = False
    output_dtype: str = "float32"
    normalize: bool = False
    prompt: str = ""
    add_eos: bool = False
    dimensions: int | None = None
    calibration: Ranges | None = None  # stored as (min, max) tuples of floats (see check_calibration)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        set_("layers", _plain_layers(self.layers))
        set_("weights", check_weights(self.weights))
        if self.level not in LEVELS:
            raise SpecError(f"unknown level {self.level!r}. Valid levels are: {', '.join(LEVELS)}")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise SpecError(f"unknown output_dtype {self.output_dtype!r}. Valid output dtypes are: "
                            f"{', '.join(OUTPUT_DTYPES)} (the model's own compute dtype is a model option: "
                            f"compute_dtype)")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise SpecError(f"dimensions must be a positive int (the leading values kept) or None, got "
                            f"{self.dimensions!r}")
        set_("calibration", check_calibration(self.calibration, self.output_dtype))
        validate_site(self.site)
        if not is_module(self.combine) and self.combine not in COMBINE_MODES:
            validate_combine(self.combine, 1)  # raises, listing the valid modes
        if not isinstance(self.prompt, str):
            raise SpecError(f"prompt must be a string (put before every text), got {type(self.prompt).__name__}")
        for name in ("skip_special_tokens", "truncate", "normalize", "add_eos"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._check_level_options()

    def _check_level_options(self) -> None:
        """Defaults per level; options that do not apply to the level are refused, naming the level."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.level == "sentence":
            if self.pool is None:
                set_("pool", "mean")
            if not is_module(self.pool) and self.pool not in POOL_MODES:
                validate_pool(self.pool)  # raises, listing the valid modes
        elif self.pool is not None:
            raise SpecError(
                f"pool={self.pool!r} applies to level 'sentence' only; level {self.level!r} gives "
                f"{'one vector per token' if self.level == 'token' else 'one vector per word (see subword=)'}"
            )
        if self.level == "word":
            if self.subword is None:
                set_("subword", "first")
            validate_word_pool(self.subword)
            if self.combine == "stack" and self.subword == "first_last":
                raise SpecError(
                    "subword='first_last' concatenates features; use it with a combine mode other than 'stack'"
                )
        elif self.subword is not None:
            raise SpecError(f"subword={self.subword!r} applies to level 'word' only, not level {self.level!r}")
        if self.prompt and self.level == "word":
            raise SpecError(
                "prompt applies to levels 'sentence' and 'token'; at level 'word' add the prompt's words to each "
                "word list yourself"
            )
        if self.normalize and self.level != "sentence":
            raise SpecError(f"normalize applies to level 'sentence' only, not level {self.level!r}")
        if self.skip_special_tokens and self.level != "sentence":
            raise SpecError(f"skip_special_tokens applies to level 'sentence' only, not level {self.level!r}")
        if self.skip_special_tokens and self.pool in ("cls", "pooler"):
            raise SpecError(
                f"pool={self.pool!r} reads the first special token; it cannot be used with skip_special_tokens=True"
            )

    # ---- against a model ---------------------------------------------------------------------------------
    @property
    def is_resolved(self) -> bool:
        """Whether ``layers`` is a tuple of non-negative indices (as :meth:`resolve` leaves it)."""
        return _are_indices(self.layers)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """``layers`` of a resolved spec: the tuple of indices in ``0..L`` that :meth:`resolve` leaves.

        Raises:
            ValueError: the spec is not resolved (call ``spec.resolve(extractor)`` first).
        """
        layers = self.layers
        if not _are_indices(layers):
            raise SpecError(f"layers {layers!r} are not resolved indices: call spec.resolve(extractor) first")
        return layers

    @property
    def learned(self) -> list[str]:
        """The learned parts named in this spec (``combine``/``pool`` names that need trained weights)."""
        out = []
        if isinstance(self.combine, str) and self.combine in ("scalar_mix", "attention"):
            out.append(f"combine={self.combine!r}")
        if isinstance(self.pool, str) and self.pool in LEARNED_POOLS:
            out.append(f"pool={self.pool!r}")
        return out

    def resolve(self, model: ModelFacts, *, learned: bool = False) -> "EncodeSpec":
        """This spec with ``layers`` resolved to indices ``0..L`` and every option checked against ``model``.

        Args:
            model: an :class:`~layerwise.Extractor` (anything with ``num_layers``, ``sites``, ``has_pooler``,
                ``site_width``).
            learned: the caller trains the learned modes (heads, probes); otherwise their names are refused.

        Raises:
            ValueError: an out-of-range or malformed layer spec (naming the model's range), a site the model or
                backend lacks, weights of the wrong length, a learned mode where nothing is trained, a pool that
                does not fit (``pooler`` on widened features or a model without a pooler, ``cls`` on a decoder:
                ``model.causal``, where the message names ``last``).
        """
        given = list(self.layers) if isinstance(self.layers, tuple) else self.layers  # messages show the user's list
        layers = resolve_layers(given, model.num_layers)
        if 0 in layers and getattr(model, "first_layer", 0) > 0:
            raise SpecError(
                f"layer 0 (the embeddings) is not an output of this model's backend (its layers are "
                f"1..{model.num_layers}: a TF Hub BERT SavedModel returns encoder_outputs only); drop layer 0, e.g. "
                f"layers='1:' or layers=-1"
            )
        site = validate_site(self.site, layers)
        if site not in model.sites:
            raise SpecError(
                f"site {site!r} is not available for this model with this backend; it offers "
                f"{', '.join(model.sites)} (backend='torch' records every site a model has; Extractor.describe() "
                f"lists them)"
            )
        validate_combine(self.combine, len(layers), self.weights, learned=learned)
        if self.level == "sentence" and not (learned and self.pool in LEARNED_POOLS):
            validate_pool(self.pool, skip_special_tokens=self.skip_special_tokens, has_pooler=model.has_pooler,
                          causal=bool(getattr(model, "causal", False)))
            if self.pool == "pooler":
                widens = self.combine == "stack" or (self.combine == "concat" and len(layers) > 1)
                if widens or site == "intermediate":
                    raise SpecError(
                        "pool='pooler' applies the model's pooler, which takes hidden_size features; use one layer, "
                        "or combine='sum'|'mean'|'weighted' or a ScalarMix, at site 'block'/'attention'/'pre_ln'"
                    )
        out = dataclasses.replace(self, layers=layers, site=site)
        if self.output_dtype in CALIBRATED_DTYPES and self.calibration is None:
            raise require_calibration(self.output_dtype)
        if self.dimensions is not None or self.calibration is not None:
            full = list(out.pooled_shape(model.site_width(site)))
            if self.dimensions is not None and self.dimensions > full[-1]:
                raise SpecError(f"dimensions={self.dimensions} is more than the {full[-1]} values this spec gives "
                                f"(shape {full}); give 1..{full[-1]}")
            n = math.prod(out.float_shape(model.site_width(site)))
            if self.calibration is not None and len(self.calibration[0]) != n:
                raise SpecError(f"the calibration holds {len(self.calibration[0])} ranges but this spec gives {n} "
                                f"values a row; calibrate again with this spec (layers, combine, pool, dimensions)")
        return out

    def feature_shape(self, width: int) -> tuple[int, ...]:
        """``D`` of one row (a sentence, token or word) as returned and stored, for layers of ``width`` features;
        needs resolved layers.

        ``concat``: ``(K * width,)``; ``stack``: ``(K, width)``; other modes ``(width,)``; ``mean_max`` pools and
        ``first_last`` sub-word pools double the last axis; ``dimensions`` cuts it; ``binary``/``ubinary`` pack it
        to ``ceil(d / 8)`` bytes.
        """
        shape = list(self.float_shape(width))
        shape[-1] = packed_width(shape[-1], self.output_dtype)
        return tuple(shape)

    def float_shape(self, width: int) -> tuple[int, ...]:
        """``D`` before ``output_dtype`` packs it: :meth:`feature_shape` of a float spec (the calibration's size)."""
        shape = list(self.pooled_shape(width))
        if self.dimensions is not None:
            shape[-1] = min(shape[-1], self.dimensions)
        return tuple(shape)

    def calibrated(self, features: Any, width: int | None = None) -> "EncodeSpec":
        """This ``int8``/``uint8`` spec with ``calibration`` ranges from float32 ``features`` of the same spec
        (``[n, *D]``, or a list of arrays: see :func:`~layerwise.encoding.precision.calibration_ranges`, ``width`` =
        ``prod(D)``): per value, the minimum and maximum over the rows.

        Raises:
            SpecError: the spec's ``output_dtype`` takes no calibration, or the features hold no row or inf/NaN.
        """
        return dataclasses.replace(self, calibration=calibration_ranges(features, width))

    def pooled_shape(self, width: int) -> tuple[int, ...]:
        """``D`` after combining and pooling, before ``dimensions`` cuts it (needs resolved layers)."""
        layers = self.layers
        if not _are_indices(layers):
            raise SpecError("feature_shape needs resolved layers: call spec.resolve(extractor) first")
        shape = list(combined_shape(self.combine, len(layers), width))
        if (self.level == "sentence" and self.pool == "mean_max") or (
            self.level == "word" and self.subword == "first_last"
        ):
            shape[-1] *= 2
        return tuple(shape)

    # ---- JSON ----------------------------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        """The spec as a table for notebooks (every field, escaped)."""
        from ..display import card

        return card("EncodeSpec", [(k, "-" if v is None else v) for k, v in self.to_dict().items()
                                   if k != "calibration"] + ([("calibration", f"{len(self.calibration)} ranges")]
                                                             if self.calibration is not None else []))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``ValueError`` if ``combine`` or ``pool`` is a module: modules are not data)."""
        for name in ("combine", "pool"):
            if is_module(getattr(self, name)):
                raise SpecError(
                    f"{name} is a module ({type(getattr(self, name)).__name__}); only named modes can be written as "
                    f"JSON (save a trained module with a head: lw.heads)"
                )
        out = dataclasses.asdict(self)
        out["layers"] = list(self.layers) if isinstance(self.layers, tuple) else self.layers
        out["weights"] = None if self.weights is None else list(self.weights)
        out["calibration"] = None if self.calibration is None else [list(row) for row in self.calibration]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EncodeSpec":
        """Build from :meth:`to_dict` output; unknown keys are refused, naming them and the valid ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        return cls(**fields_from(data, known, LEGACY_FIELDS, "EncodeSpec", SpecError))

    def to_json(self, path: str | Path | None = None) -> str:
        """The spec as JSON text; also written to ``path`` when given."""
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "EncodeSpec":
        """Read a spec from JSON text or a ``.json`` file."""
        return cls.from_dict(read_json_arg(text_or_path, "EncodeSpec", SpecError))

    def replace(self, **changes: Any) -> "EncodeSpec":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


__all__ = ["EncodeSpec", "LEGACY_FIELDS", "ModelFacts"]

