"""The :class:`Backend` interface: what the pipeline needs from a model runtime, and nothing more."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

import torch

from ...errors import LayerwiseError, ModelLoadError
from ..loaded import LoadedModel
from ..loading import load_model
from ..options import ModelOptions

# The ModelOptions fields a backend may or may not honour (model, max_length and stride every backend honours).
# load_model reads these: every backend that loads through transformers honours them
LOADING_FIELDS = ("device", "compute_dtype", "revision", "allow_pickle", "trust_remote_code", "layer_modules",
                  "max_layer", "max_memory")
BACKEND_FIELDS = (*LOADING_FIELDS, "padding_side", "quantize", "quantize_calibration", "onnx_cache", "tokenizer")
# what each field means when it is not its default: the message for a backend that does not take it
_NEEDS = {
    "quantize": "{value} runs through OpenVINO or ONNX Runtime: use backend='auto' (the default), 'openvino' or "
                "'onnx', not backend={name!r}",
    "quantize_calibration": "{value} calibrates quantize='int8-full' on OpenVINO: use backend='auto' (the default) "
                            "or 'openvino', not backend={name!r}",
    "padding_side": "{value} needs backend='torch' or 'auto' (backend={name!r} pads right)",
    "tokenizer": "tokenizer= goes with backend='tf' (a SavedModel without its tokenizer); the {name} backend reads "
                 "the model directory's own tokenizer",
    "onnx_cache": "{value} is where backend='auto'/'onnx' keep their exported graphs; backend={name!r} exports none",
}


def _given(options: ModelOptions, field: str) -> bool:
    """Whether ``field`` asks for something other than its default (``cpu`` and ``float32`` are defaults too)."""
    value = getattr(options, field)
    if field == "device":
        return value not in (None, "cpu")
    if field == "compute_dtype":
        return value not in (None, "float32")
    if field == "padding_side":
        return value != "right"
    return value not in (None, False)


def refuse_options(backend: type[Backend], options: ModelOptions) -> None:
    """Refuse every option given in ``options`` that ``backend`` does not honour (none is dropped silently).

    Raises:
        ModelLoadError: naming the option, its value and the backend(s) that take it.
    """
    for field in BACKEND_FIELDS:
        if field in backend.accepts or not _given(options, field):
            continue
        value = f"{field}={getattr(options, field)!r}"
        if field in _NEEDS:
            raise ModelLoadError(_NEEDS[field].format(value=value, name=backend.name))
        raise ModelLoadError(f"backend={backend.name!r} {backend.runs}; {value} is not supported with it (use "
                             f"backend='torch')")



def covering(depth: int, served: Sequence[int]) -> int:
    """The graph depth that runs a request of ``depth``: ``depth`` itself, or where a server named the depths it serves
    (``served``, warmed before it said ready), the shallowest of them that covers it (its graph outputs every layer
    up to it); ``depth`` when none does."""
    return min((d for d in served if d >= depth), default=depth)

class Backend(ABC):
    """A model runtime behind the pipeline.

    Subclasses set :attr:`name` and :attr:`sites` and implement :meth:`forward`. The default implementation keeps
    the :class:`~layerwise.model.loaded.LoadedModel` (transformers model + fast tokenizer + facts) it was built from;
    a backend for another framework overrides the facts it cannot take from there.

    Attributes:
        name: the registry name (``"torch"``, ``"onnx"``).
        accepts: the :class:`~layerwise.ModelOptions` fields (of :data:`BACKEND_FIELDS`) it honours; any other one
            given is refused when it loads.
        sites: the sites this backend can record (see :mod:`layerwise.encoding.layers`).
        loaded: the loaded model and tokenizer.
    """

    name: ClassVar[str]
    sites: ClassVar[tuple[str, ...]]
    accepts: ClassVar[frozenset[str]] = frozenset()  # the BACKEND_FIELDS of ModelOptions this backend honours
    runs: ClassVar[str] = "runs PyTorch"  # how it runs, for messages about options it does not take

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self._fingerprint: str | None = None

    @classmethod
    def load(cls, options: ModelOptions) -> "Backend":
        """Load the model ``options`` name (``load_model``) and wrap it; an option this backend does not honour is
        refused (:func:`refuse_options`)."""
        refuse_options(cls, options)
        return cls.from_loaded(load_model(options), options)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "Backend":
        """Wrap an already loaded model, with the options of ``options`` this backend's constructor takes."""
        return cls(loaded)

    # ---- facts ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The model's fast tokenizer (offsets and word ids)."""
        return self.loaded.tokenizer

    @property
    def num_layers(self) -> int:
        """``L``: layer indices are ``0..L`` (0 = embeddings)."""
        return self.loaded.num_layers

    @property
    def device(self) -> torch.device:
        """Where the returned states live."""
        return self.loaded.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes (and returns states) in."""
        return self.loaded.dtype

    @property
    def precision(self) -> str:
        """What the features are computed in: the dtype name (``"float32"``), or ``"int8"`` for a quantised graph.
        Part of a store's identity (a resume never mixes precisions)."""
        return str(self.dtype).replace("torch.", "")

    @property
    def first_layer(self) -> int:
        """The lowest layer index this backend can give: 0 (the embeddings), or 1 for a model that hides them."""
        return 0

    @property
    def model_sites(self) -> tuple[str, ...]:
        """The sites this backend can record on this model: its :attr:`sites` that the model has."""
        return tuple(s for s in self.sites if s in self.loaded.site_widths)

    def site_width(self, site: str) -> int:
        """Feature width of ``site``."""
        return self.loaded.site_width(site)

    def pooler(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The model's pooler ``[batch, hidden] -> [batch, hidden]`` (BERT-style), or ``None``."""
        return self.loaded.pooler

    def fingerprint(self) -> str:
        """A sha256 over the weights' names, shapes and values (computed once per backend)."""
        if self._fingerprint is None:
            self._fingerprint = self.loaded.fingerprint()
        return self._fingerprint

    # ---- compute -------------------------------------------------------------------------------------------
    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """Run the model on one padded batch and return the requested states.

        Args:
            input_ids: ``[batch, tokens]`` token ids.
            attention_mask: ``[batch, tokens]``, 1 for real tokens.
            layers: resolved indices ``0..L``, in output order; nothing after ``max(layers)`` needs to run.
            site: one of :attr:`sites`.

        Returns:
            ``[len(layers), batch, tokens, width]`` on :attr:`device`.
        """

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> Callable[[], torch.Tensor]:
        """Start :meth:`forward` on one batch and return a callable that waits for its states ``[K, batch, tokens,
        width]``. Here it runs now; a runtime with asynchronous requests returns at once, so the caller can
        prepare and start the next batches (up to :meth:`ahead`) and reduce the finished ones meanwhile."""
        states = self.forward(input_ids, attention_mask, layers, site)
        return lambda: states

    def ragged_price(self, depth: int, site: str) -> float | None:
        """What a token through a layer costs under :meth:`start_ragged` (each row of a batch run only to its own
        depth, up to ``depth`` at ``site``), relative to :meth:`start` on the runtime serving ``depth``: ``1.0``
        where the same runtime runs both, the measured ratio where another one would (``auto``: PyTorch against a
        compiled graph), ``None`` where rows cannot leave a batch early (here)."""
        return None

    def ragged_prices(self, depth: int, site: str) -> dict[str, float]:
        """Every runtime that can run a call's rows to their own depths (up to ``depth`` at ``site``) with its
        :meth:`ragged_price`, ``{runtime: price}`` (:meth:`Plan.ragged_prices` of :meth:`plan`); empty where rows cannot
        leave a batch early."""
        return self.plan((depth,), site).ragged_prices(depth, site)

    def start_ragged(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str,
        depths: Sequence[int],
    ) -> Callable[[], torch.Tensor]:
        """:meth:`start` for a batch whose rows need different depths: ``depths`` per row, non-increasing, the first
        ``max(layers)``. Returns a callable that waits for ``[K, batch, tokens, width]``, where a row holds the
        layers up to its depth (the others are zeros where :meth:`ragged_price` is not ``None``). Here every row runs to
        ``max(layers)``."""
        return self.start(input_ids, attention_mask, layers, site)

    def batch_tokens_cap(self, layers: Sequence[int], site: str) -> int | None:
        """The most tokens one batch for ``layers`` at ``site`` may hold, or ``None`` (the pipeline's budget
        applies). A model streamed under ``max_memory`` bounds it, so that one batch's states fit the budget."""
        return None

    def ahead(self, layers: Sequence[int], site: str) -> int:
        """How many batches for ``layers`` at ``site`` may be started before the oldest is waited for (1: one at a
        time)."""
        return 1

    def warm(self, layers: Sequence[int], site: str = "block") -> None:
        """Make ``layers`` at ``site`` ready to serve before the first request asks: the blocks they need loaded
        (a runtime with graphs builds and compiles its graph; ``auto`` starts its background preparation, see
        :meth:`pending`). A server calls it for the depths it warms before it reports ready."""
        if not self.loaded.streams(max(layers)):
            self.loaded.ensure_depth(max(layers))

    def pending(self) -> list[int]:
        """The depths still being prepared off the caller's path (``auto``'s background work); none here."""
        return []

    def plan(self, layers: Sequence[int], site: str) -> "Plan":
        """What runs every batch of one call for ``layers`` at ``site``: decided once, before its first batch, so a
        call never changes runtime in its middle. Here: this backend, named :attr:`name`."""
        return Plan(self.name, self)

    def runtime_name(self, layers: Sequence[int], site: str) -> str:
        """The runtime a call for ``layers`` at ``site`` would run on now (what a store and a response record):
        :attr:`name` here; ``auto`` says ``"torch"``, ``"onnx"`` or ``"openvino"``."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.loaded.name!r}, device={self.device}, dtype={self.dtype})"


class Plan:
    """One call's runtime: :attr:`backend` runs every batch the call starts (:meth:`start`, :meth:`ahead`,
    :meth:`batch_tokens_cap`); :attr:`ragged` runs its rows to their own depths when the caller takes
    :meth:`ragged_price`'s offer (:meth:`start_ragged`). :attr:`runtime` names the runtime (``"torch"``, ``"onnx"``,
    ``"openvino"``, or a backend's name), :attr:`ragged_runtime` the one that runs rows to their own depths. Made by
    :meth:`Backend.plan`.

    A plan may offer other runtimes' chains for rows of mixed depths (``chains``): :meth:`ragged_prices` lists every
    offer with its price against :attr:`backend`'s graph, and :meth:`chain` is the same plan with one of them running
    the rows (``auto``: where OpenVINO serves a depth, ONNX Runtime's one-layer graphs may run a mixed call faster,
    and the caller measures which).

    Args:
        runtime: the name of what runs the call.
        backend: runs the call's batches.
        ragged: runs a batch whose rows need different depths (default: ``backend``).
        price: the ragged price (see :meth:`Backend.ragged_price`) as ``price(depth, site)`` (default:
            ``ragged.ragged_price``).
        ragged_runtime: the name of ``ragged`` (default: ``runtime``).
        chains: other runtimes that can run the rows of mixed depths, ``{name: (backend, price(depth, site))}``, each
            price relative to ``backend``'s graph.
    """

    def __init__(self, runtime: str, backend: Backend, ragged: Backend | None = None,
                 price: Callable[[int, str], float | None] | None = None, ragged_runtime: str | None = None,
                 chains: dict[str, tuple[Backend, Callable[[int, str], float | None]]] | None = None):
        self.runtime, self.backend = runtime, backend
        self.ragged = ragged if ragged is not None else backend
        self.ragged_runtime = ragged_runtime or runtime
        self.price_of = price  # the ragged price as price(depth, site), or None: ragged.ragged_price
        self.chains = dict(chains or {})

    def ragged_price(self, depth: int, site: str) -> float | None:
        """:meth:`Backend.ragged_price` of this call (``None``: rows cannot leave a batch early)."""
        return self.price_of(depth, site) if self.price_of is not None else self.ragged.ragged_price(depth, site)

    def ragged_prices(self, depth: int, site: str) -> dict[str, float]:
        """Every runtime that can run this call's rows to their own depths (up to ``depth`` at ``site``), with its
        price per token-layer against :attr:`backend`'s graph (:meth:`Backend.ragged_price`): :attr:`ragged_runtime`
        first, then the other ``chains`` prepared so far; empty where none can."""
        out: dict[str, float] = {}
        own = self.ragged_price(depth, site)
        if own is not None:
            out[self.ragged_runtime] = own
        for name, (_, price) in self.chains.items():
            value = price(depth, site)
            if value is not None and name not in out:
                out[name] = value
        return out

    def chain(self, name: str) -> "Plan":
        """This plan with ``name``'s chain running the rows of mixed depths (one of :meth:`ragged_prices`).

        Raises:
            LayerwiseError: ``name`` is not offered (the valid names listed).
        """
        if name == self.ragged_runtime:
            return self
        if name not in self.chains:
            raise LayerwiseError(f"no chain {name!r} for rows of mixed depths here; offered: "
                             f"{', '.join([self.ragged_runtime, *self.chains])}")
        plan = copy.copy(self)
        plan.ragged, plan.price_of = self.chains[name]
        plan.ragged_runtime = name
        return plan

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
              site: str) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start` on :attr:`backend`: ``[batch, tokens]`` in, a wait for ``[K, batch, tokens, W]``."""
        return self.backend.start(input_ids, attention_mask, layers, site)

    def start_ragged(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str,
                     depths: Sequence[int]) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start_ragged` on :attr:`ragged`: ``[batch, tokens]`` in, a wait for ``[K, batch, tokens,
        W]``."""
        return self.ragged.start_ragged(input_ids, attention_mask, layers, site, depths)

    def ahead(self, layers: Sequence[int], site: str) -> int:
        """:meth:`Backend.ahead` of :attr:`backend`."""
        return self.backend.ahead(layers, site)

    def batch_tokens_cap(self, layers: Sequence[int], site: str) -> int | None:
        """:meth:`Backend.batch_tokens_cap` of :attr:`backend`."""
        return self.backend.batch_tokens_cap(layers, site)

    def __repr__(self) -> str:
        return f"Plan({self.runtime!r}, {type(self.backend).__name__})"
