"""``LayerStack``: the typed result of a capture.

A stack is a sequence of the layers it captured, in the order they were asked for; each carries its model-layer
label. One rule:

* **An int (or a slice) is a position in the stack**, as in any Python sequence: ``for h in stack``, ``len(stack)``,
  ``stack[0]``, ``stack[-1]`` and ``stack[1:]`` all walk the captured layers, whatever spec captured them.
  ``stack.layers[k]`` is the model layer at position ``k`` (``stack.labels[k]`` its label).
* **A model layer is addressed by :meth:`LayerStack.layer`** (or by any key that is not an int or a slice: a name,
  a string, a one-item list): ``stack.layer(3)``, ``stack.layer(-1)`` (the model's last layer), ``stack["last"]``,
  ``stack["layer_3"]``, ``stack["embeddings"]``. A model layer that was not captured is a ``KeyError`` naming the
  layers the stack holds; several model layers are :meth:`LayerStack.select`.

With ``layers="all"`` both agree (position ``i`` is layer ``i``); with a subset they differ: for ``layers=[0, 3, 5]``
of a 6-layer model, ``stack[1]`` is layer 3, ``stack[-1]`` is layer 5 and ``stack.layer(-1)`` (layer 6) is a
``KeyError``.

Example::

    >>> import layerwise as lw
    >>> stack = lw.Extractor().hidden_states(["I love Paris", "Hi"], layers="all")
    >>> stack.tensor.shape                    # [layers, batch, tokens, hidden]
    torch.Size([7, 2, 5, 384])
    >>> stack.labels[:2], stack["last"].shape, stack[-2].shape
    (('embeddings', 'layer_1'), torch.Size([2, 5, 384]), torch.Size([2, 5, 384]))
    >>> sub = lw.Extractor().hidden_states(["I love Paris"], layers=[0, 3, 5])
    >>> len(sub), [h.shape for h in sub][0], sub.labels[1], sub.layers[-1]   # sub[1] is layer 3, sub[-1] layer 5
    (3, torch.Size([1, 5, 384]), 'layer_3', 5)
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import SpecError
from .layers import LayerSpec, layer_label, resolve_layers
from .padding import pad_ids, pad_rows


@dataclass
class LayerStack:
    """Hidden states of the requested layers for a batch of texts, padded to the longest text.

    A sequence of ``[batch, tokens, width]`` states in captured order: iteration, ``len``, int and slice indexing
    (negative ints included) are positions; :meth:`layer` (and a string key) addresses a model layer by its index
    or name (see the module docstring).

    Attributes:
        tensor: ``[layers, batch, tokens, width]`` (float, on CPU; a torch tensor, or a float32 numpy array when
            made with ``return_tensors="np"``, as are the masks and ids). Padded positions (past a text's last
            token) are filled with zeros, not with the model's states for padding tokens; mask them with
            ``attention_mask``.
        layers: resolved layer indices in ``0..num_layers``, in the order of ``tensor``'s first axis.
        sites: the site recorded for each layer (all equal today).
        attention_mask: ``[batch, tokens]``, 1 for real tokens.
        input_ids: ``[batch, tokens]``; padding uses the tokenizer's pad id.
        special_tokens_mask: ``[batch, tokens]``, 1 for the model's special tokens (and padding).
        word_ids: per text, per real token, the word index or ``None`` for special tokens.
        offsets: per text, per real token, ``(start, end)`` character offsets into the text.
        num_layers: the model's ``L`` (to resolve specs such as ``-1`` or ``"last"``).
    """

    tensor: Any
    layers: tuple[int, ...]
    sites: tuple[str, ...]
    attention_mask: Any
    input_ids: Any
    special_tokens_mask: Any
    word_ids: list[list[int | None]]
    offsets: list[list[tuple[int, int]]]
    num_layers: int

    @classmethod
    def from_tokens(cls, tensor: torch.Tensor, layers, site: str, toks, pad_id: int, num_layers: int) -> "LayerStack":
        """A stack for ``tensor [layers, batch, tokens, width]`` with masks and ids built from tokenised texts."""
        longest = tensor.shape[2]
        ids, mask = pad_ids([t.ids for t in toks], pad_id)
        ids = torch.nn.functional.pad(ids, (0, longest - ids.shape[1]), value=pad_id)
        mask = torch.nn.functional.pad(mask, (0, longest - mask.shape[1]))
        special, _ = pad_rows([torch.tensor(t.special, dtype=torch.long) for t in toks], longest=longest)
        special = special | (1 - mask)  # padding counts as special
        return cls(tensor=tensor, layers=tuple(layers), sites=(site,) * len(layers), attention_mask=mask, input_ids=ids,
                   special_tokens_mask=special, word_ids=[t.word_ids for t in toks],
                   offsets=[t.offsets for t in toks], num_layers=num_layers)

    @property
    def labels(self) -> tuple[str, ...]:
        """``"embeddings"``, ``"layer_1"``, ... for each entry of ``layers``."""
        return tuple(layer_label(i) for i in self.layers)

    @property
    def shape(self) -> tuple[int, ...]:
        """``tensor``'s shape ``[layers, batch, tokens, width]`` (a ``torch.Size`` for torch tensors)."""
        return self.tensor.shape

    def as_numpy(self) -> "LayerStack":
        """This stack with numpy arrays: ``tensor`` float32 ``[layers, batch, tokens, width]``, masks and ids int64
        ``[batch, tokens]`` (what ``hidden_states(..., return_tensors="np")`` returns)."""
        return dataclasses.replace(self, tensor=self.numpy(), attention_mask=np.asarray(self.attention_mask),
                                   input_ids=np.asarray(self.input_ids),
                                   special_tokens_mask=np.asarray(self.special_tokens_mask))

    def _position(self, key) -> int:
        """The position in the stack of the model layer ``key`` (an index, ``"layer_4"``, or a name)."""
        if isinstance(key, str) and key.startswith("layer_") and key[6:].isdigit():
            index = int(key[6:])
        else:
            resolved = resolve_layers(key, self.num_layers)
            if len(resolved) != 1:
                raise SpecError(
                    f"stack[key] gives ONE layer, but key {key!r} selects {len(resolved)} layers "
                    f"(indices {list(resolved)}); use stack.select({key!r}) for a LayerStack of several"
                )
            (index,) = resolved
        if index not in self.layers:
            raise KeyError(
                f"model layer {key!r} (index {index}) was not captured; this stack holds {list(self.labels)} "
                f"(model layers {list(self.layers)}). stack[i] with an int is a position in the stack "
                f"(0..{len(self.layers) - 1}); stack.layer(i) is model layer i"
            )
        return self.layers.index(index)

    def layer(self, key: LayerSpec) -> Any:
        """``[batch, tokens, width]`` of one MODEL layer (a torch tensor, or numpy for a ``return_tensors="np"``
        stack), addressed like a spec (``4``, ``-1`` = the model's last layer, ``"last"``, ``"layer_4"``,
        ``"embeddings"``), whatever its position in the stack.

        Raises:
            SpecError: a key that selects several layers (``"all"``, ``"-2:"``, ``[0, 1]``): use :meth:`select`.
            KeyError: a model layer that was not captured (the message lists the captured ones).
        """
        return self.tensor[self._position(key)]

    def __getitem__(self, key: Any) -> Any:
        """``stack[k]``: the ``[batch, tokens, width]`` state at POSITION ``k`` (an int; ``-1``: the last captured
        layer); ``stack[i:j]``: a :class:`LayerStack` of those positions. Any other key is a one-layer spec of a
        MODEL layer, as :meth:`layer`: ``stack["last"]``, ``stack["layer_3"]``, ``stack["-1"]``, ``stack[[3]]``.

        Raises:
            IndexError: a position outside ``-len(stack)..len(stack) - 1``.
            SpecError, KeyError, TypeError: as :meth:`layer` for any other key (several layers: use :meth:`select`).
        """
        if isinstance(key, slice):
            return self._take(list(range(len(self.layers)))[key])
        if isinstance(key, (str, bool)) or not hasattr(key, "__index__"):
            return self.layer(key)
        n = len(self.layers)
        pos = operator.index(key)
        if not -n <= pos < n:
            raise IndexError(
                f"stack position {pos} is out of range: this stack holds {n} layer(s) {list(self.labels)}, positions "
                f"0..{n - 1} or -{n}..-1; stack.layer(i) addresses model layer i"
            )
        return self.tensor[pos]

    def __iter__(self) -> Iterator[Any]:
        """Each captured layer's ``[batch, tokens, width]`` state, in stack order (``zip(stack.layers, stack)``
        pairs them with their model layer)."""
        return iter(self.tensor)

    def _take(self, pos: list[int]) -> "LayerStack":
        """A stack of the layers at positions ``pos``, in that order."""
        return LayerStack(
            tensor=self.tensor[pos],
            layers=tuple(self.layers[p] for p in pos),
            sites=tuple(self.sites[p] for p in pos),
            attention_mask=self.attention_mask,
            input_ids=self.input_ids,
            special_tokens_mask=self.special_tokens_mask,
            word_ids=self.word_ids,
            offsets=self.offsets,
            num_layers=self.num_layers,
        )

    def select(self, spec: LayerSpec) -> "LayerStack":
        """A stack holding only the MODEL layers of ``spec`` (resolved against the model: ``"-4:"``, ``[0, 6]``),
        in spec order; ``KeyError`` for a layer that was not captured."""
        return self._take([self._position(i) for i in resolve_layers(spec, self.num_layers)])

    def numpy(self) -> np.ndarray:
        """``tensor`` as a float32 numpy array ``[layers, batch, tokens, width]``."""
        if isinstance(self.tensor, np.ndarray):
            return self.tensor.astype(np.float32, copy=False)
        return self.tensor.float().cpu().numpy()

    def __len__(self) -> int:
        """The number of captured layers (``tensor.shape[0]``)."""
        return len(self.layers)

    def norms(self) -> list[float]:
        """Per layer: the mean L2 norm of its token vectors, padding excluded (``[layers]``)."""
        mask = torch.as_tensor(self.attention_mask).bool()
        states = torch.as_tensor(self.tensor)
        with torch.no_grad():
            return [float(states[k].float().norm(dim=-1)[mask].mean()) for k in range(len(self.layers))]

    def _repr_html_(self) -> str:
        """Per layer: label, site, shape, mean token norm and mean |x| (padding excluded), and the norm curve as
        inline SVG."""
        from ..display import card, svg_curve, table

        mask = torch.as_tensor(self.attention_mask).bool()
        states = torch.as_tensor(self.tensor)
        norms = self.norms()
        rows = []
        for k, label in enumerate(self.labels):
            h = states[k].float()
            rows.append([label, self.sites[k], tuple(h.shape), f"{norms[k]:.3f}", f"{float(h[mask].abs().mean()):.4f}"])
        return card(
            "LayerStack", [("tensor", f"{tuple(self.tensor.shape)} [layers, batch, tokens, width]"),
                           ("dtype", str(self.tensor.dtype).replace("torch.", "")),
                           ("tokens", f"{int(mask.sum())} (padding excluded)")],
            table(["layer", "site", "shape [batch, tokens, width]", "mean token norm", "mean |x|"], rows),
            svg_curve(list(self.labels), norms, title="mean token norm per layer"),
        )

    def __repr__(self) -> str:
        return (
            f"LayerStack(layers={list(self.labels)}, site={self.sites[0]!r}, "
            f"tensor={tuple(self.tensor.shape)} [layers, batch, tokens, width], dtype={self.tensor.dtype})"
        )
