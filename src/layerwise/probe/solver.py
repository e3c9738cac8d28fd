"""The linear probe's solver: multinomial logistic regression by full-batch L-BFGS over cached features read in
chunks and standardised on the fly.

A probe on a corpus reads features of ``[rows, K, W]`` (float16 in the probe's cache). Standardising them first
(a float32 copy of every layer a probe reads) held about 4x the cache in memory on CoNLL-2003, and a scalar mix
recomputed the mix over the whole copy at every evaluation. Here nothing is copied: a :class:`FeatureView` reads the
rows a fit uses chunk by chunk (:data:`CHUNK_VALUES` values at a time, widened to float32), the standardisation is
folded into the weights (``((v - mean) / scale) A^T + b = v (A / scale)^T + (b - (A / scale) mean)``), and each
evaluation of the objective is one pass over the rows that gives the loss and the gradient of the effective weights
at once; the gradient of the probe's own parameters (the weights on the standardised features, and a scalar mix's
logits) follows from it by a small autograd graph.

A scalar mix is folded the same way: the ``K`` standardised layers weighed by softmax weights ``s`` and the mix
standardised again by its spread ``sigma(s)`` (from the layers' per-feature covariance: :func:`mix_spread`) is a
linear probe on the concatenated standardised layers with effective weights ``A = [s_k W / sigma(s)]_k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

CHUNK_VALUES = 1 << 22  # feature values widened to float32 at a time (16 MB)
TOL = 1e-4
MAX_ITER = 1000


class FeatureView:
    """Features ``x [rows, K, W]`` (a float16 or float32 tensor, never copied whole) as a probe reads them: the
    ``K`` layers concatenated (``concat``, and a scalar mix, which folds into the weights), ``[rows, K * W]``, or
    summed (``sum``), ``[rows, W]``."""

    def __init__(self, x: torch.Tensor, combine: str):
        self.x, self.summed = x, combine == "sum"
        self.layers, self.width = int(x.shape[1]), int(x.shape[2])
        self.dim = self.width if self.summed else self.layers * self.width
        self.chunk = max(256, CHUNK_VALUES // (self.layers * self.width))
        self._buffer: torch.Tensor | None = None

    def chunks(self, rows: np.ndarray | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, end, v)`` over ``rows`` (indices into ``x``; ``None``: every row), ``v [end - start, D]``
        float32: the features of rows ``rows[start:end]`` as this view combines them. ``v`` lives in a buffer that
        the next chunk overwrites (one allocation for the whole pass, none per chunk): use it before the next."""
        n = len(self.x) if rows is None else len(rows)
        if self._buffer is None:
            self._buffer = torch.empty(self.chunk, self.layers, self.width, dtype=torch.float32)
        for s in range(0, n, self.chunk):
            e = min(n, s + self.chunk)
            block = self._buffer[: e - s]
            block.copy_(self.x[s:e] if rows is None else self.x[torch.from_numpy(rows[s:e])])
            yield s, e, block.sum(1) if self.summed else block.view(e - s, -1)

    def count(self, rows: np.ndarray | None) -> int:
        return len(self.x) if rows is None else len(rows)

    def moments(self, rows: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, scale)``, each ``[D]`` float32: the per-feature mean and standard deviation over ``rows`` (a
        constant feature's scale is 1)."""
        total = torch.zeros(self.dim, dtype=torch.float64)
        squares = torch.zeros(self.dim, dtype=torch.float64)
        for _, _, v in self.chunks(rows):
            total += v.sum(0, dtype=torch.float64)
            squares += torch.einsum("nd,nd->d", v, v).double()
        n = max(self.count(rows), 1)
        mean = total / n
        var = (squares / n - mean * mean).clamp_min(0)
        scale = var.sqrt()
        return mean.float(), torch.where(scale > 1e-8, scale, torch.ones_like(scale)).float()

    def layer_covariance(self, rows: np.ndarray | None, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``[W, K, K]`` float64: per feature, the covariance over ``rows`` of the ``K`` standardised layers (ones on
        the diagonal)."""
        cov = torch.zeros(self.width, self.layers, self.layers, dtype=torch.float64)
        for _, _, v in self.chunks(rows):
            z = v.sub_(mean).div_(scale).view(-1, self.layers, self.width)  # in the chunk's own buffer
            cov += torch.einsum("nkw,nlw->wkl", z, z).double()
        return cov / max(self.count(rows), 1)

    def dense(self, rows: np.ndarray | None, mean: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
        """``[rows, D]`` float32, standardised: the whole view in memory (for scikit-learn on small data)."""
        out = torch.empty(self.count(rows), self.dim, dtype=torch.float32)
        for s, e, v in self.chunks(rows):
            torch.div(v - mean, scale, out=out[s:e])
        return out.numpy()

    def held(self, rows: np.ndarray | None) -> torch.Tensor:
        """``[rows, 1, D]`` float16: this view computed once for ``rows`` and held (a mix's view, read as one
        layer)."""
        out = torch.empty(self.count(rows), 1, self.dim, dtype=torch.float16)
        for s, e, v in self.chunks(rows):
            out[s:e, 0] = v
        return out


class MixView(FeatureView):
    """The fixed mix ``sum_k s_k z_k / sigma(s)`` of the ``K`` standardised layers of ``x`` (``mean``, ``scale``
    ``[K * W]``; ``cov`` their covariance), standardised again: ``[rows, W]``, computed chunk by chunk. A probe on it
    costs what a one-layer probe does (its matrix products are ``W`` wide, not ``K * W``); its mean is 0 and its
    scale 1 by construction. ``rounded``: its values rounded to float16 (as a held copy of it, :meth:`held`, keeps
    them)."""

    def __init__(self, x: torch.Tensor, mix: np.ndarray, mean: torch.Tensor, scale: torch.Tensor,
                 cov: torch.Tensor, *, rounded: bool = False):
        super().__init__(x, "concat")
        self.rounded = rounded  # the mix's values rounded to float16, as :meth:`held` keeps them
        self.dim = self.width
        self.mix = torch.as_tensor(np.asarray(mix, dtype=np.float32))
        self.spread = torch.from_numpy(mix_spread(cov, mix))
        self.layer_mean, self.layer_scale = mean.view(self.layers, self.width), scale.view(self.layers, self.width)

    def chunks(self, rows: np.ndarray | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        for s, e, v in super().chunks(rows):
            z = v.view(e - s, self.layers, self.width).sub_(self.layer_mean).div_(self.layer_scale)
            mixed = (z * self.mix[None, :, None]).sum(1).div_(self.spread)
            yield s, e, mixed.half().float() if self.rounded else mixed


def mix_spread(cov: torch.Tensor | np.ndarray, mix: torch.Tensor | np.ndarray) -> np.ndarray:
    """``[W]``: the standard deviation of each feature of the mix ``sum_k mix[k] z_k`` of standardised layers whose
    covariance is ``cov [W, K, K]``; 1 for a one-layer mix, less for a mix of layers that are not perfectly
    correlated."""
    c = torch.as_tensor(np.asarray(cov), dtype=torch.float64)
    s = torch.as_tensor(np.asarray(mix), dtype=torch.float64)
    return torch.einsum("k,wkl,l->w", s, c, s).clamp_min(1e-12).sqrt().float().numpy()


def mix_effective(cov: torch.Tensor | np.ndarray, weight: torch.Tensor | np.ndarray,
                  mix: torch.Tensor | np.ndarray) -> torch.Tensor:
    """``[C, K * W]`` float32: the probe ``weight [C, W]`` on the scalar mix ``mix [K]`` of standardised layers
    (standardised again by its spread, :func:`mix_spread`) as weights on the ``K`` standardised layers
    concatenated."""
    w = torch.as_tensor(np.asarray(weight, dtype=np.float32))
    s = torch.as_tensor(np.asarray(mix, dtype=np.float32))
    spread = torch.from_numpy(mix_spread(cov, mix))
    return (s[None, :, None] * (w / spread)[:, None, :]).reshape(len(w), -1)


@dataclass
class Problem:
    """One fit's data: the view, the rows it fits on (``None``: all), their labels ``y [rows]`` (int64, ``0 <= y <
    classes``), the standardisation (``mean``, ``scale`` ``[D]``) and, for a scalar mix, the layers' covariance."""

    view: FeatureView
    rows: np.ndarray | None
    y: torch.Tensor
    classes: int
    mean: torch.Tensor
    scale: torch.Tensor
    cov: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.present = torch.zeros(self.classes, dtype=torch.bool)
        self.present[self.y.unique()] = True
        self.n = len(self.y)

    def subset(self, rows: np.ndarray) -> "Problem":
        """The same problem on ``rows`` (positions into this problem's rows), standardised as this one."""
        picked = rows if self.rows is None else self.rows[rows]
        return Problem(self.view, picked, self.y[torch.from_numpy(rows)], self.classes, self.mean, self.scale,
                       self.cov)

    def folded(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U, beta)``: the effective weights ``a [C, D]`` on standardised features folded onto the raw view."""
        u = a / self.scale
        return u, b - u @ self.mean

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``[rows, C]`` float32 of the probe ``(a, b)`` on this problem's rows (absent classes included)."""
        u, beta = self.folded(a, b)
        return torch.cat([v @ u.T + beta for _, _, v in self.view.chunks(self.rows)])

    def pass_over(self, a: torch.Tensor, b: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        """One pass over the rows: ``(mean cross-entropy, d/da [C, D], d/db [C])`` of the probe ``(a, b)``, the
        classes absent from the rows never predicted."""
        u, beta = self.folded(a, b)
        grad_u = torch.zeros_like(u)
        grad_beta = torch.zeros_like(beta)
        loss = 0.0
        absent = ~self.present
        for s, e, v in self.view.chunks(self.rows):
            logits = v @ u.T + beta
            logits[:, absent] = float("-inf")
            log_p = torch.log_softmax(logits, 1)
            yc = self.y[s:e]
            loss -= float(log_p.gather(1, yc[:, None]).sum())
            g = log_p.exp()
            g[torch.arange(e - s), yc] -= 1
            grad_u += g.T @ v
            grad_beta += g.sum(0)
        grad_u /= self.n
        grad_beta /= self.n
        return loss / self.n, (grad_u - grad_beta[:, None] * self.mean[None, :]) / self.scale, grad_beta


@dataclass
class Solution:
    """A fitted probe: ``weight`` on the standardised features (``[C, D]``; a scalar mix's ``[C, W]``), ``bias``
    ``[C]`` (``-inf`` for the classes absent from the rows), a scalar mix's weights ``mix [K]`` (else ``None``), the
    effective weights ``effective [C, D]`` on the standardised concatenated features, the L-BFGS iterations, the
    gradient norm of the mean objective at the end, and that objective."""

    weight: np.ndarray
    bias: np.ndarray
    mix: np.ndarray | None
    effective: torch.Tensor
    iterations: int
    grad_norm: float
    objective: float


def solve(problem: Problem, strength: float, *, mix: np.ndarray | None = None, learn_mix: bool = False,
          start: tuple[np.ndarray, np.ndarray] | None = None, max_iter: int = MAX_ITER, seed: int = 0) -> Solution:
    """Minimise the mean cross-entropy plus ``||W||^2 / (2 C rows)`` (two classes: the difference of their rows,
    as scikit-learn's binary form) by full-batch L-BFGS (strong Wolfe).

    Args:
        mix: a scalar mix's weights ``[K]``: fixed (``learn_mix=False``: the probe of that mix) or the start of the
            learned weights (``learn_mix=True``); ``None``: a plain probe on the view.
        start: ``(weight, bias)`` to start from (``-inf`` biases start at 0); else zeros (a learned mix without a
            start: small random weights, away from the saddle where the mix's gradient is zero).
        max_iter: L-BFGS iterations at most.
    """
    classes, dim = problem.classes, problem.view.dim
    mixing = mix is not None
    width = problem.view.width if mixing else dim
    w = torch.zeros(classes, width, dtype=torch.float32)
    b = torch.zeros(classes, dtype=torch.float32)
    logit_k = torch.log(torch.as_tensor(mix, dtype=torch.float32).clamp_min(1e-12)) if mixing else torch.zeros(0)
    if start is not None:
        w.copy_(torch.from_numpy(np.asarray(start[0], dtype=np.float32)))
        b.copy_(torch.from_numpy(np.nan_to_num(np.asarray(start[1], dtype=np.float32), neginf=0.0)))
    elif learn_mix:
        w.normal_(0, 0.01, generator=torch.Generator().manual_seed(seed))
    params = [w, b] + ([logit_k] if learn_mix else [])
    for p in params:
        p.requires_grad_(True)
    present = problem.present
    binary = int(present.sum()) == 2
    cov = problem.cov
    k = problem.view.layers

    def effective() -> torch.Tensor:
        if not mixing:
            return w
        weights = torch.softmax(logit_k, 0)
        wd = weights.double()
        if cov is None:  # pragma: no cover - solve() of a mix needs the layers' covariance
            raise RuntimeError("a scalar mix needs its problem's layer covariance")
        spread = torch.einsum("k,wkl,l->w", wd, cov, wd).clamp_min(1e-12).sqrt().float()
        return (weights[None, :, None] * (w / spread)[:, None, :]).reshape(classes, k * width)

    def penalty() -> torch.Tensor:
        kept = w[present]
        return (((kept[1] - kept[0]) ** 2).sum() if binary else (kept ** 2).sum()) / (2 * strength * problem.n)

    def closure() -> torch.Tensor:
        for p in params:
            p.grad = None
        a = effective()
        loss, grad_a, grad_b = problem.pass_over(a.detach(), b.detach())
        reg = penalty()
        ((a * grad_a).sum() + (b * grad_b).sum() + reg).backward()
        return torch.tensor(loss + float(reg.detach()))

    optim = torch.optim.LBFGS(params, lr=1, max_iter=max_iter, tolerance_grad=TOL, tolerance_change=1e-10,
                              history_size=20, line_search_fn="strong_wolfe")
    optim.step(closure)
    iterations = int(optim.state[w].get("n_iter", 0))
    objective = float(closure())
    grad_norm = float(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).norm())
    bias = b.detach().numpy().copy()
    bias[~present.numpy()] = -np.inf
    final_mix = torch.softmax(logit_k, 0).detach().numpy() if learn_mix else (
        np.asarray(mix, dtype=np.float32) if mixing else None)
    with torch.no_grad():
        a = effective().detach().clone()
    return Solution(weight=w.detach().numpy().copy(), bias=bias, mix=final_mix, effective=a,
                    iterations=iterations, grad_norm=grad_norm, objective=objective)


def objective_at(problem: Problem, strength: float, weight: np.ndarray, bias: np.ndarray,
                 mix: np.ndarray | None = None) -> float:
    """The objective :func:`solve` minimises, at the probe ``(weight, bias)`` (with the scalar mix ``mix``, its
    weight then ``[C, W]`` on the mix standardised again): one pass over the rows."""
    w = torch.from_numpy(np.asarray(weight, dtype=np.float32))
    b = torch.from_numpy(np.nan_to_num(np.asarray(bias, dtype=np.float32), neginf=0.0))
    a = w
    if mix is not None:
        if problem.cov is None:  # pragma: no cover
            raise RuntimeError("a scalar mix needs its problem's layer covariance")
        a = mix_effective(problem.cov, w, mix)
    loss, _, _ = problem.pass_over(a, b)
    kept = w[problem.present].double()
    reg = ((kept[1] - kept[0]) ** 2).sum() if len(kept) == 2 else (kept ** 2).sum()
    return loss + float(reg) / (2 * strength * problem.n)


def layer_objectives(problem: Problem, weight: np.ndarray, bias: np.ndarray) -> list[float]:
    """The mean cross-entropy of the one-layer probe ``(weight [C, W], bias)`` on each of the ``K`` standardised
    layers alone (one pass over the rows): which layer a mix's probe reads best."""
    k, width = problem.view.layers, problem.view.width
    w = torch.from_numpy(np.asarray(weight, dtype=np.float32))
    b = torch.from_numpy(np.nan_to_num(np.asarray(bias, dtype=np.float32), neginf=-1e30))
    mean, scale = problem.mean.view(k, width), problem.scale.view(k, width)
    total = torch.zeros(k, dtype=torch.float64)
    for s, e, v in problem.view.chunks(problem.rows):
        z = (v.view(-1, k, width) - mean) / scale
        log_p = torch.log_softmax(torch.einsum("nkw,cw->nkc", z, w) + b, -1)
        yc = problem.y[s:e]
        total -= log_p.gather(2, yc[:, None, None].expand(-1, k, 1)).squeeze(2).double().sum(0)
    return (total / problem.n).tolist()


__all__ = ["CHUNK_VALUES", "FeatureView", "MixView", "Problem", "Solution", "layer_objectives", "mix_effective",
           "mix_spread", "objective_at", "solve"]
