"""``LayerStack``: the typed result of a capture.

Example::

    >>> import layerwise as lw
    >>> stack = lw.Extractor().hidden_states(["I love Paris", "Hi"], layers="all")
    >>> stack.tensor.shape                    # [layers, batch, tokens, hidden]
    torch.Size([7, 2, 5, 384])
    >>> stack.labels[:2], stack["last"].shape, stack[-2].shape
    (('embeddings', 'layer_1'), torch.Size([2, 5, 384]), torch.Size([2, 5, 384]))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SpecError
from .layers import LayerSpec, layer_label, resolve_layers
from .padding import pad_ids, pad_rows


@dataclass
class LayerStack:
    """Hidden states of the requested layers for a batch of texts, padded to the longest text.

    Attributes:
        tensor: ``[layers, batch, tokens, width]`` (float, on CPU). Padded positions (past a text's last
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

    tensor: torch.Tensor
    layers: tuple[int, ...]
    sites: tuple[str, ...]
    attention_mask: torch.Tensor
    input_ids: torch.Tensor
    special_tokens_mask: torch.Tensor
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
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def _position(self, key) -> int:
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
                f"layer {key!r} (index {index}) was not captured; this stack holds {list(self.labels)}"
            )
        return self.layers.index(index)

    def layer(self, key: int | str) -> torch.Tensor:
        """``[batch, tokens, width]`` of one layer, addressed like a spec (``-1``, ``"last"``, ``4``, ``"layer_4"``).

        Raises ``ValueError`` for a key that selects several layers (``"all"``, ``"-2:"``, ``[0, 1]``): use
        :meth:`select` for those; ``KeyError`` for a layer that was not captured.
        """
        return self.tensor[self._position(key)]

    __getitem__ = layer

    def select(self, spec: LayerSpec) -> "LayerStack":
        """A stack holding only the layers of ``spec`` (resolved against the model), in spec order."""
        wanted = resolve_layers(spec, self.num_layers)
        pos = [self._position(i) for i in wanted]
        return LayerStack(
            tensor=self.tensor[pos],
            layers=wanted,
            sites=tuple(self.sites[p] for p in pos),
            attention_mask=self.attention_mask,
            input_ids=self.input_ids,
            special_tokens_mask=self.special_tokens_mask,
            word_ids=self.word_ids,
            offsets=self.offsets,
            num_layers=self.num_layers,
        )

    def numpy(self) -> np.ndarray:
        """``tensor`` as a float32 numpy array ``[layers, batch, tokens, width]``."""
        return self.tensor.float().cpu().numpy()

    def __len__(self) -> int:
        return len(self.layers)

    def norms(self) -> list[float]:
        """Per layer: the mean L2 norm of its token vectors, padding excluded (``[layers]``)."""
        mask = self.attention_mask.bool()
        with torch.no_grad():
            return [float(self.tensor[k].float().norm(dim=-1)[mask].mean()) for k in range(len(self.layers))]

    def _repr_html_(self) -> str:
        """Per layer: label, site, shape, mean token norm and mean |x| (padding excluded), and the norm curve as
        inline SVG."""
        from ..display import card, svg_curve, table

        mask = self.attention_mask.bool()
        norms = self.norms()
        rows = []
        for k, label in enumerate(self.labels):
            h = self.tensor[k].float()
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
