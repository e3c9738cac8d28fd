"""The :class:`Backend` interface: what the pipeline needs from a model runtime, and nothing more."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

import torch

from ..loading import LoadedModel, load_model
from ..provenance import tensors_fingerprint


def refuse_torch_only(backend: str, source: str, *, device: Any, dtype: Any, revision: Any, layers: Any,
                      options: dict[str, Any]) -> None:
    """For a backend that runs float32 on the CPU from ``source``: refuse the loading options only torch takes.

    Raises:
        ValueError: a CUDA device, reduced precision, ``revision=`` or ``layers=``, naming it.
        TypeError: options the backend's constructor does not take.
    """
    for name, value, ok in (("device", device, (None, "cpu")), ("dtype", dtype, (None, "float32", torch.float32)),
                            ("revision", revision, (None,)), ("layers", layers, (None,))):
        if value not in ok:
            raise ValueError(f"backend={backend!r} runs float32 on the CPU ({source}); {name}={value!r} is not "
                             f"supported with it (use backend='torch')")
    if options:
        raise TypeError(f"backend={backend!r} takes no options {sorted(options)}")


class Backend(ABC):
    """A model runtime behind the pipeline.

    Subclasses set :attr:`name` and :attr:`sites` and implement :meth:`forward`. The default implementation keeps
    the :class:`~layerwise.loading.LoadedModel` (transformers model + fast tokenizer + facts) it was built from;
    a backend for another framework overrides the facts it cannot take from there.

    Attributes:
        name: the registry name (``"torch"``, ``"onnx"``).
        sites: the sites this backend can record (see :mod:`layerwise.layers`).
        loaded: the loaded model and tokenizer.
    """

    name: ClassVar[str]
    sites: ClassVar[tuple[str, ...]]

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self._fingerprint: str | None = None

    @classmethod
    def load(
        cls,
        model: Any = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        revision: str | None = None,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        layers: str | None = None,
        **options: Any,
    ) -> "Backend":
        """Load ``model`` (directory, hub id or ``None`` for the embedded default; see ``load_model``).

        ``layers`` names the layer list by hand (see ``load_model``); ``options`` go to the backend's constructor
        (``cache=`` for ONNX, ``padding_side=`` for torch).
        """
        loaded = load_model(model, device=device, dtype=dtype, revision=revision, allow_pickle=allow_pickle,
                            trust_remote_code=trust_remote_code, layers=layers)
        return cls(loaded, **options)

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
            self._fingerprint = tensors_fingerprint(self.loaded.model.state_dict())
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.loaded.name!r}, device={self.device}, dtype={self.dtype})"
