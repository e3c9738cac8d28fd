"""Classifier heads on hidden layers: configuration, modules, training, evaluation, saving and loading.

Example::

    >>> import layerwise as lw
    >>> cfg = lw.heads.HeadConfig(layers="-4:", pool="max", combine="concat", classifier="mlp", dropout=0.2)
    >>> result = lw.heads.train(cfg, "train.tsv", "dev.tsv", output="my-head")      # doctest: +SKIP
    >>> lw.heads.load("my-head").predict(["what a film"])                           # doctest: +SKIP
"""

from .classifier import SequenceClassifier, load
from .config import ACTIVATIONS, CLASSIFIERS, COMBINES, MODES, POOLS, HeadConfig
from .metrics import classification_scores, format_scores
from .model import LayerAttention, LayerHead
from .train import TrainOptions, TrainResult, train

__all__ = [
    "ACTIVATIONS", "CLASSIFIERS", "COMBINES", "HeadConfig", "LayerAttention", "LayerHead", "MODES", "POOLS",
    "SequenceClassifier", "TrainOptions", "TrainResult", "classification_scores", "format_scores", "load", "train",
]
