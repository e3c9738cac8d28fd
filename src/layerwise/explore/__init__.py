"""The layer explorer: a local web page that shows what each layer holds (``layerwise explore``).

Three views: the corpus (a 2D projection of sentence vectors per layer, coloured by label, with kNN / probe /
silhouette scores per layer), one sentence (token x layer heatmaps and token similarity per layer and site) and a
``layerwise probe`` output directory (its table, per-layer curve and layer similarity). Loaded on first use:
``import layerwise`` never imports the web stack.

In a notebook, ``lw.explore(store_or_texts)`` (the module is callable: :func:`~layerwise.explore.inline.show`)
starts the explorer on a local port and shows it in the output cell.
"""

import sys
import types

from .app import Explorer, create_explorer_app, explorer_router
from .corpus import Corpus, corpus_from_store, corpus_from_texts
from .inline import InlineExplorer, show
from .probe_dir import read_probe_dir
from .projection import project
from .scores import layer_scores
from .sentence import sentence_view


class _CallableModule(types.ModuleType):
    """``lw.explore(...)``: the module called is :func:`show`."""

    def __call__(self, *args: object, **kwargs: object) -> InlineExplorer:
        return show(*args, **kwargs)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "Corpus", "Explorer", "InlineExplorer", "corpus_from_store", "corpus_from_texts", "create_explorer_app",
    "explorer_router", "layer_scores", "project", "read_probe_dir", "sentence_view", "show",
]
