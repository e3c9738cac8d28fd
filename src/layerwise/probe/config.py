"""``ProbeConfig``: what a probing run trains and reports (the data and the model are given to :func:`run`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..checks import positive_ints, positive_numbers
from ..errors import SpecError
from .data import TASKS
from .metrics import SCHEMES
from .models import PROBES

FEATURE_DTYPES = ("float16", "float32")  # what the probe caches its features in

@dataclass(frozen=True)
class ProbeConfig:
    """A probing run's settings.

    Attributes:
        task: ``tagging`` (one label per word) or ``sentence`` (one label per record).
        column: tag column (CoNLL-2003: ``ner`` default, ``chunk``, ``pos``; CoNLL-U: ``upos`` default, ``xpos``)
            or the sentence label column (default ``label``).
        probe: ``linear`` (default), ``mlp`` (``hidden`` units) or ``bilstm`` (tagging; 2 layers, ``hidden`` per
            direction; the BERT paper used 768), with ``crf=True`` for a CRF output layer.
        hidden, lr: MLP/BiLSTM probe size and Adam's learning rate.
        epochs: MLP/BiLSTM: at most this many epochs; ``None`` (default): the budget follows the data
            (:meth:`~layerwise.probe.train.ProbeOptions.budget`). The linear probe is solved to convergence instead.
        patience: MLP/BiLSTM: stop after this many checks without a better score on the held-out part of train
            (``None``: a quarter of the checks, at least 3).
        restarts: seeds per probe; tables show mean ± std (the paper averages 5). The linear probe of one layer, a
            convex problem solved exactly, is fitted once.
        control: also train each single-layer probe on a control task (Hewitt & Liang 2019: every word type, or
            every distinct text of a sentence task, given a fixed random label drawn from the training label
            distribution) and report selectivity: the task's accuracy minus the control's.
        scheme: tag scheme for entity F1: ``auto`` (detected), ``IOB1``, ``IOB2``, ``IOBES`` or ``none``.
        subword: how a word's sub-tokens are pooled (``first`` as in the paper; ``mean``, ``last``, ...).
        pool: sentence tasks: how tokens are pooled per layer.
        document_context: CoNLL-2003: encode sentences with their document neighbours (the paper's setting).
        layers_only: train single-layer probes only (skip the strategies).
        feature_dtype: the dtype of the features cached in ``OUT/features`` and probed: ``float16`` (the default:
            half the disk and memory; the fits compute in float32 and standardise their inputs) or ``float32``.
        mdl: also give each single layer's online code length of the training labels (Voita & Titov 2020:
            :mod:`layerwise.probe.mdl`), with the linear probe at the strength its fit chose.
    """

    task: str = "tagging"
    column: str | None = None
    probe: str = "linear"
    crf: bool = False
    hidden: int = 256
    epochs: int | None = None
    lr: float = 1e-3
    patience: int | None = None
    restarts: int = 1
    scheme: str = "auto"
    subword: str = "first"
    pool: str = "mean"
    document_context: bool = False
    layers_only: bool = False
    control: bool = False
    mdl: bool = False
    feature_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise SpecError(f"unknown task {self.task!r}. Valid tasks are: {', '.join(TASKS)}")
        if self.probe not in PROBES:
            raise SpecError(f"unknown probe {self.probe!r}. Valid probes are: {', '.join(PROBES)}")
        if self.scheme not in SCHEMES:
            raise SpecError(f"unknown scheme {self.scheme!r}. Valid schemes are: {', '.join(SCHEMES)}")
        positive_ints(restarts=self.restarts, hidden=self.hidden)
        if self.patience is not None:
            positive_ints(patience=self.patience)
        if self.epochs is not None:
            positive_ints(epochs=self.epochs)
        positive_numbers(lr=self.lr)
        if self.probe == "bilstm" and self.task != "tagging":
            raise SpecError("probe='bilstm' reads sentences word by word: use it with task='tagging'")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise SpecError(f"unknown feature_dtype {self.feature_dtype!r}. Valid values are: "
                            f"{', '.join(FEATURE_DTYPES)}")
        if self.mdl and self.probe != "linear":
            raise SpecError(f"mdl=True codes the labels with the linear probe; use probe='linear' (got {self.probe!r})")
        if self.crf and self.probe != "bilstm":
            raise SpecError(
                f"crf=True is the output layer of the bilstm probe; use probe='bilstm' (got {self.probe!r})"
            )

    def replace(self, **changes: Any) -> "ProbeConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
