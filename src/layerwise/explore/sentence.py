"""One sentence through every layer: per-token statistics and token-to-token similarity.

For a text and a site, :func:`sentence_view` returns (as JSON-ready lists):

- ``norm [L', T]``: the L2 norm of each token's state at each layer;
- ``change [L', T]``: ``1 - cos`` between a token's state at a layer and at the previous one (0 at the first
  layer shown): where the representation moves;
- ``cos_last [L', T]``: cosine of each token's state to its state at the last layer;
- ``similarity [L', T, T]``: cosine between every pair of tokens at each layer.

``L'`` is the layers the site has (``block``: the embeddings and every layer; other sites: layers 1..L).

    >>> view = sentence_view(lw.Extractor(), "I love Paris")        # doctest: +SKIP
    >>> view["tokens"], len(view["norm"]), len(view["norm"][0])      # doctest: +SKIP
    (['[CLS]', 'i', 'love', 'paris', '[SEP]'], 7, 5)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import LayerwiseError
from .corpus import layer_name

if TYPE_CHECKING:
    from ..extractor import Extractor

MAX_CHARS = 2000


def sentence_view(ex: Extractor, text: str, site: str = "block") -> dict:
    """Per-token statistics of ``text`` at every layer of ``site`` (see the module docstring).

    Raises:
        ValueError: an empty or too long text, or a site the model does not have (with the valid sites).
    """
    if not isinstance(text, str) or not text.strip():
        raise LayerwiseError("type a sentence: the text is empty")
    if len(text) > MAX_CHARS:
        raise LayerwiseError(f"the text has {len(text):,} characters; the sentence view takes at most {MAX_CHARS:,}")
    if site not in ex.sites:
        raise LayerwiseError(f"site {site!r} is not recorded for this model. Valid sites are: {', '.join(ex.sites)}")
    layers = "all" if site == "block" else f"1:{ex.num_layers + 1}"
    stack = ex.hidden_states([text], layers=layers, site=site, truncate=True)
    n = int(stack.attention_mask[0].sum())
    h = stack.tensor[:, 0, :n].double().numpy()  # Shape: (layers, tokens, width)
    ids = stack.input_ids[0, :n].tolist()
    tokens = ex.tokenizer.convert_ids_to_tokens(ids)
    norm = np.linalg.norm(h, axis=-1)  # Shape: (layers, tokens)
    unit = h / np.maximum(norm[..., None], 1e-12)
    change = np.zeros_like(norm)
    change[1:] = 1.0 - (unit[1:] * unit[:-1]).sum(-1)
    cos_last = (unit * unit[-1:]).sum(-1)
    similarity = unit @ unit.transpose(0, 2, 1)  # Shape: (layers, tokens, tokens)
    return {
        "text": text, "site": site, "tokens": tokens, "layers": list(stack.layers),
        "layer_names": [layer_name(i) for i in stack.layers],
        "norm": _round(norm), "change": _round(change), "cos_last": _round(cos_last),
        "similarity": _round(similarity),
    }


def _round(a: np.ndarray) -> list:
    return np.round(a, 4).tolist()


__all__ = ["MAX_CHARS", "sentence_view"]
