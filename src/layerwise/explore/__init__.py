"""The layer explorer: a local web page that shows what each layer holds (``layerwise explore``).

Three views: the corpus (a 2D projection of sentence vectors per layer, coloured by label, with kNN / probe /
silhouette scores per layer), one sentence (token x layer heatmaps and token similarity per layer and site) and a
``layerwise probe`` output directory (its table, per-layer curve and layer similarity). Loaded on first use:
``import layerwise`` never imports the web stack.
"""

from .app import Explorer, create_explorer_app, explorer_router
from .corpus import Corpus, corpus_from_store, corpus_from_texts
from .probe_dir import read_probe_dir
from .projection import project
from .scores import layer_scores
from .sentence import sentence_view

__all__ = [
    "Corpus", "Explorer", "corpus_from_store", "corpus_from_texts", "create_explorer_app", "explorer_router",
    "layer_scores", "project", "read_probe_dir", "sentence_view",
]
