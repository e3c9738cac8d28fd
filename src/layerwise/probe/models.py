"""Probe models: which layers (and how combined) a probe reads, and the sequence probes (BiLSTM, CRF).

Linear and MLP probes reuse :class:`layerwise.heads.LayerHead` on per-word (or per-sentence) features
``[rows, K, W]``. Tagging can also use :class:`SequenceProbe`: the layers combined per word (with
:func:`layerwise.encoding.combine.combine`; ``scalar_mix`` learned), a 2-layer BiLSTM over
the sentence (hidden size per direction configurable; the BERT paper's feature-based NER uses 768) and a linear
layer, optionally followed by a linear-chain :class:`CRF`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..encoding.combine import ScalarMix, combine, learned_combiner
from ..encoding.vocab import combined_shape
from ..heads import HeadConfig, LayerHead

PROBES = ("linear", "mlp", "bilstm")


@dataclass(frozen=True)
class ProbeSpec:
    """One probe: a name, the layer indices it reads (0 = embeddings) and how they are combined."""

    name: str
    kind: str  # "layer" (one layer) or "strategy"
    layers: tuple[int, ...]
    combine: str  # concat | sum | scalar_mix


def probe_specs(num_layers: int) -> list[ProbeSpec]:
    """Every single layer ``0..L``, then the BERT-paper strategies (Table 7) and a full scalar mix.

    ``weighted sum`` strategies are learned scalar mixes (softmax weights, ELMo / Tenney et al.; the linear probe
    standardises the mix again, so that its L2 penalty weighs every mix alike, :func:`~layerwise.probe.linear.
    fit_linear`);
    ``weighted sum all layers`` mixes the ``L`` encoder layers, ``scalar mix all`` adds the embeddings.
    """
    L = num_layers
    last4 = tuple(range(max(1, L - 3), L + 1))
    specs = [ProbeSpec("embeddings" if i == 0 else f"layer {i}", "layer", (i,), "concat") for i in range(L + 1)]
    specs += [
        ProbeSpec("second-to-last", "strategy", (max(L - 1, 0),), "concat"),
        ProbeSpec("last", "strategy", (L,), "concat"),
        ProbeSpec(f"sum last {len(last4)}", "strategy", last4, "sum"),
        ProbeSpec(f"weighted sum last {len(last4)}", "strategy", last4, "scalar_mix"),
        ProbeSpec(f"concat last {len(last4)}", "strategy", last4, "concat"),
        ProbeSpec(f"weighted sum all {L} layers", "strategy", tuple(range(1, L + 1)), "scalar_mix"),
        ProbeSpec("scalar mix all (with embeddings)", "strategy", tuple(range(0, L + 1)), "scalar_mix"),
    ]
    return specs


def word_head(spec: ProbeSpec, labels: list[str], width: int, probe: str, hidden: int, dropout: float) -> LayerHead:
    """A linear or MLP probe over ``[rows, K, W]`` features."""
    cfg = HeadConfig(labels=labels, combine=spec.combine, classifier=probe, hidden=[hidden], dropout=dropout)
    return LayerHead(cfg, len(spec.layers), width)


class CRF(nn.Module):
    """Linear-chain CRF over emission scores ``[batch, T, C]`` with a mask ``[batch, T]`` (left-aligned)."""

    def __init__(self, num_tags: int):
        super().__init__()
        self.start = nn.Parameter(torch.zeros(num_tags))
        self.end = nn.Parameter(torch.zeros(num_tags))
        self.trans = nn.Parameter(torch.zeros(num_tags, num_tags))  # trans[i, j]: score of tag i followed by j

    def nll(self, em: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood of the gold ``tags [batch, T]``."""
        mask = mask.bool()
        b = torch.arange(em.shape[0], device=em.device)
        gold = self.start[tags[:, 0]] + em[b, 0, tags[:, 0]]
        for t in range(1, em.shape[1]):
            step = self.trans[tags[:, t - 1], tags[:, t]] + em[b, t, tags[:, t]]
            gold = gold + step * mask[:, t]
        last = tags[b, mask.sum(1) - 1]
        gold = gold + self.end[last]
        alpha = self.start + em[:, 0]  # [batch, C]
        for t in range(1, em.shape[1]):
            nxt = torch.logsumexp(alpha.unsqueeze(2) + self.trans + em[:, t].unsqueeze(1), dim=1)
            alpha = torch.where(mask[:, t : t + 1], nxt, alpha)
        return (torch.logsumexp(alpha + self.end, dim=1) - gold).mean()

    def decode(self, em: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        """Viterbi: the best tag sequence of each row (its unmasked length)."""
        mask = mask.bool()
        score = self.start + em[:, 0]
        back = []
        for t in range(1, em.shape[1]):
            total = score.unsqueeze(2) + self.trans  # [batch, C_prev, C]
            best, idx = total.max(1)
            nxt = best + em[:, t]
            score = torch.where(mask[:, t : t + 1], nxt, score)
            stay = torch.arange(em.shape[2], device=em.device).expand_as(idx)  # masked steps keep their tag
            back.append(torch.where(mask[:, t : t + 1], idx, stay))
        score = score + self.end
        out = []
        lengths = mask.sum(1).tolist()
        for r in range(em.shape[0]):
            tag = int(score[r].argmax())
            path = [tag]
            for t in range(lengths[r] - 2, -1, -1):
                tag = int(back[t][r, tag])
                path.append(tag)
            out.append(path[::-1])
        return out


class SequenceProbe(nn.Module):
    """Layers combined per word -> 2-layer BiLSTM -> linear (-> CRF). ``x [batch, T, K, W]``, ``mask [batch, T]``."""

    def __init__(
        self, spec: ProbeSpec, num_tags: int, width: int, hidden: int = 256, crf: bool = False, dropout: float = 0.1
    ):
        super().__init__()
        self.combine_mode = spec.combine
        self.mix = learned_combiner(spec.combine, len(spec.layers), width)
        (dim,) = combined_shape(spec.combine, len(spec.layers), width)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(2 * hidden, num_tags)
        self.crf = CRF(num_tags) if crf else None

    def layer_weights(self) -> torch.Tensor | None:
        """The learned layer weights of a ``scalar_mix`` probe (``[K]``), else ``None``."""
        return self.mix.mixing_weights().detach() if isinstance(self.mix, ScalarMix) else None

    def emissions(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Tag scores ``[batch, T, C]`` for word features ``x [batch, T, K, W]``."""
        h = combine(x.movedim(-2, 0), self.mix if self.mix is not None else self.combine_mode)  # [batch, T, D]
        lengths = mask.sum(1).cpu()
        packed = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.out(self.drop(out))

    def loss(self, x: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        em = self.emissions(x, mask)
        if self.crf is not None:
            return self.crf.nll(em, tags, mask)
        keep = mask.bool()
        return nn.functional.cross_entropy(em[keep], tags[keep])

    def predict(self, x: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        em = self.emissions(x, mask)
        if self.crf is not None:
            return self.crf.decode(em, mask)
        best = em.argmax(-1)
        return [best[r, : int(n)].tolist() for r, n in enumerate(mask.sum(1))]
