"""The linear probe, trained to convergence: multinomial logistic regression, its L2 strength chosen on the training
split.

A probe's score should measure the layer, not the optimiser's budget. So the linear probe is the convex problem
solved to its optimum, as scikit-learn's ``LogisticRegression`` solves it:

    minimise  sum_i CE(W x_i + b, y_i) * C  +  ||W||^2 / 2          (the bias is not penalised)

on features standardised with the training split's mean and standard deviation (hidden states have a few
dimensions hundreds of times larger than the rest; unscaled, L-BFGS needs thousands of iterations). The strength
``C`` is chosen among :data:`STRENGTHS` (scikit-learn's ``LogisticRegressionCV`` grid: ``Cs=10``) by ``folds``-fold
cross-validation *on the training split only* (a tagging task's folds keep each sentence's words together): the
strengths are scanned from the strongest regularisation up, each fold warm-started from the previous strength, until
two in a row score below the best (the weakly regularised end, slow to fit, is skipped once the accuracy falls);
above ``ONE_FOLD_ROWS`` training rows one fold (a third of train) ranks them.
Then the probe is refitted on the whole training split. The split a score is reported on is never read.

A learned scalar mix (``combine="scalar_mix"``) weighs the ``K`` standardised layers by softmax weights and
standardises the mix again (its per-feature spread computed from the layers' covariance), so the penalty on the probe
is the same for every mix. It is fitted from two starts, the uniform mix (its probe fitted first: L-BFGS only
descends from there) and the mix leaning on the layer that probe reads best, and the lower training objective is
kept, so a learned mix is never worse on the training objective than the uniform mix of the same layers. (Without
the second standardisation a mix of layers that are not perfectly correlated has a smaller spread than any one layer,
and the penalty pushed every mix onto one: 0.9999 of the weight on one layer on SST-2.)

Solvers: the final fit is scikit-learn's ``LogisticRegression`` (``lbfgs``) where the features fit (``rows x width
<= SKLEARN_VALUES``); otherwise, for a learned scalar mix of layers (not a plain logistic regression), and for the
cross-validation fits, a full-batch L-BFGS in torch on the same objective (float32, strong Wolfe line search), which
agrees with scikit-learn on the same data (tested) at a third of its time. Each final fit reports its iterations, the
final gradient norm of the mean objective and whether it converged; a probe that did not is warned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import LayerwiseError

COMBINES = ("concat", "sum", "scalar_mix")
SOLVERS = ("sklearn", "torch")
STRENGTHS = tuple(float(c) for c in np.logspace(-4, 4, 10))  # C: scikit-learn's LogisticRegressionCV(Cs=10) grid
FOLDS = 3
MAX_ITER = 1000
CV_MAX_ITER = 200  # the cross-validation fits (warm-started along the strengths) rank the strengths; the final fit
# runs to MAX_ITER
SCAN_PATIENCE = 2  # strengths in a row below the best before the scan stops
ONE_FOLD_ROWS = 5000  # above this many training rows, the strengths are ranked on one of the folds only
TOL = 1e-4
SKLEARN_VALUES = 10_000_000  # rows x width up to which scikit-learn fits the final probe (its float64 copy: 80 MB)


@dataclass
class LinearFit:
    """A fitted linear probe over ``[rows, K, W]`` features (``K`` layers combined by ``combine``).

    Attributes:
        weight, bias: ``[classes, D]`` and ``[classes]`` on the standardised combined features (``D`` = ``K * W``
            for ``concat``, else ``W``).
        mean, scale: the training split's per-feature mean and standard deviation ``[D]`` (or ``[K, W]`` for a mix).
        mix: a scalar mix's softmax weights ``[K]``, else ``None``.
        mix_scale: a scalar mix's per-feature standard deviation ``[W]`` over the training rows: the mix is
            standardised again, as the uniform mean of the layers is before a logistic regression reads it, so the
            L2 penalty weighs every mix alike (without it, a mix of layers that are not perfectly correlated has a
            smaller spread than any one layer, and the penalty pushed every mix onto one layer).
        strength: the chosen ``C`` (inverse L2 strength, as scikit-learn's).
        scores: the cross-validated training accuracy of each strength tried, ``{C: accuracy}``.
        iterations, grad_norm, converged: the final fit's L-BFGS iterations, the norm of its gradient of the mean
            objective, and whether it stopped before :data:`MAX_ITER`.
        solver: ``"scikit-learn lbfgs"`` or ``"torch L-BFGS"``.
        objective: the training objective at the fit (:func:`mean_objective`: mean cross-entropy plus the L2
            penalty over ``2 C rows``), comparable between probes of the same rows and strength.
        starts: a scalar mix: the final objective reached from each start (``{"uniform": .., "layer k": ..}``).
    """

    weight: np.ndarray
    bias: np.ndarray
    mean: np.ndarray
    scale: np.ndarray
    combine: str
    strength: float
    iterations: int
    grad_norm: float
    converged: bool
    solver: str
    mix: np.ndarray | None = None
    mix_scale: np.ndarray | None = None
    scores: dict[float, float] = field(default_factory=dict)
    objective: float = float("nan")
    starts: dict[str, float] = field(default_factory=dict)

    def logits(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """``[rows, classes]`` for features ``x [rows, K, W]``."""
        x = _as_float(x)
        z = _mixed((x - self.mean) / self.scale, self.mix) / self.mix_scale if self.mix is not None else \
            (_combined(x, self.combine) - self.mean) / self.scale
        return z.astype(np.float64) @ self.weight.T.astype(np.float64) + self.bias  # float64: ties as scikit-learn

    def predict(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """Class indices ``[rows]`` for features ``x [rows, K, W]``."""
        return self.logits(x).argmax(1)

    def report(self) -> dict[str, Any]:
        """What the fit chose and how it ended, JSON-ready."""
        out = {"solver": self.solver, "C": self.strength, "iterations": self.iterations,
               "grad_norm": float(f"{self.grad_norm:.3g}"), "converged": self.converged,
               "objective": float(f"{self.objective:.6g}"),
               "cv_accuracy": {f"{c:.4g}": round(s, 5) for c, s in self.scores.items()}}
        if self.starts:
            out["starts"] = {k: float(f"{v:.6g}") for k, v in self.starts.items()}
        return out


def _as_float(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x.float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)


def _combined(x: np.ndarray, combine: str) -> np.ndarray:
    """``[rows, D]`` from ``[rows, K, W]``: the layers concatenated or summed (a scalar mix is learned, not here)."""
    if combine == "sum":
        return x.sum(1)
    return x.reshape(len(x), -1)


def _mixed(z: np.ndarray, mix: np.ndarray | None) -> np.ndarray:
    """``[rows, W]``: the ``K`` layers of ``z [rows, K, W]`` weighed by a scalar mix ``[K]``; ``z`` itself without
    one (already ``[rows, D]``)."""
    return z if mix is None else np.einsum("nkw,k->nw", z, mix)


def _moments(z: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    mean = z.mean(axis, dtype=np.float64).astype(np.float32)
    scale = z.std(axis, dtype=np.float64).astype(np.float32)
    return mean, np.where(scale > 1e-8, scale, 1.0).astype(np.float32)


def folds_of(n: int, groups: np.ndarray | None, k: int = FOLDS, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` (train, validation) index pairs over ``n`` rows; rows with one ``groups`` value (a sentence's words)
    stay in one fold."""
    rng = np.random.default_rng(seed)
    ids = np.arange(n) if groups is None else groups
    unique = np.unique(ids)
    k = min(k, len(unique))
    if k < 2:  # one group: nothing to validate on
        return []
    fold_of = dict(zip(unique.tolist(), (rng.permutation(len(unique)) % k).tolist()))
    assign = np.array([fold_of[g] for g in ids.tolist()])
    return [(np.flatnonzero(assign != f), np.flatnonzero(assign == f)) for f in range(k)]


def fit_linear(x: torch.Tensor | np.ndarray, y: np.ndarray, classes: int, combine: str = "concat", *,
               groups: np.ndarray | None = None, strengths: tuple[float, ...] = STRENGTHS, folds: int = FOLDS,
               seed: int = 0, solver: str | None = None) -> LinearFit:
    """Fit the linear probe on ``x [rows, K, W]`` with labels ``y [rows]`` (``0 <= y < classes``; rows with a
    negative label are left out), ``C`` chosen by cross-validation on these rows only (see the module docstring).

    Args:
        combine: how the ``K`` layers are combined: ``concat``, ``sum`` or ``scalar_mix`` (learned with the probe).
        groups: ``[rows]`` group ids kept within one fold (a tagging task's sentence index), or ``None``.
        solver: ``None`` (scikit-learn where the features fit, else torch), ``"sklearn"`` or ``"torch"``.
    """
    if combine not in COMBINES:
        raise LayerwiseError(f"unknown combine {combine!r} for a linear probe. Valid values are: {', '.join(COMBINES)}")
    if solver not in (None, *SOLVERS):
        raise LayerwiseError(f"unknown solver {solver!r}. Valid values are: None (scikit-learn where the features "
                             f"fit, else torch), {', '.join(SOLVERS)}")
    keep = y >= 0
    x_all = _as_float(x)[keep]
    y = np.asarray(y)[keep]
    groups = None if groups is None else np.asarray(groups)[keep]
    cov = None
    if combine == "scalar_mix":
        mean, scale = _moments(x_all)
        z = (x_all - mean) / scale
        cov = layer_covariance(z)
        use = "torch"
    else:
        z = _combined(x_all, combine)
        mean, scale = _moments(z)
        z = (z - mean) / scale
        use = solver or ("sklearn" if z.size <= SKLEARN_VALUES else "torch")
    splits = folds_of(len(y), groups, folds, seed) if len(strengths) > 1 else []
    if len(y) > ONE_FOLD_ROWS:  # enough rows that one held-out fold ranks the strengths
        splits = splits[:1]
    scores = _choose(z, y, classes, strengths, splits, combine, seed, cov) if splits else {}
    if scores:
        best = max(scores.values())
        strength = min(c for c, s in scores.items() if s == best)  # ties: the strongest regularisation
    else:
        strength = 1.0 if len(strengths) > 1 else strengths[0]  # too few rows to validate: scikit-learn's default
    starts: dict[str, float] = {}
    mix_scale: np.ndarray | None = None
    mix: np.ndarray | None
    if cov is not None:
        w, b, iterations, grad_norm, mix, starts = _fit_mix(z, y, classes, strength, seed, cov)
        mix_scale = mix_spread(cov, mix)
        objective = mean_objective(_mixed(z, mix) / mix_scale, y, w, b, strength)
    else:
        fit = _fit_sklearn if use == "sklearn" else _fit_torch
        w, b, iterations, grad_norm, mix = fit(z, y, classes, strength, combine, seed)
        objective = mean_objective(z, y, w, b, strength)
    return LinearFit(weight=w, bias=b, mean=mean, scale=scale, combine=combine, strength=strength,
                     iterations=iterations, grad_norm=grad_norm, converged=iterations < MAX_ITER,
                     solver="scikit-learn lbfgs" if use == "sklearn" else "torch L-BFGS", mix=mix,
                     mix_scale=mix_scale, scores=scores, objective=objective, starts=starts)


def layer_covariance(z: np.ndarray) -> np.ndarray:
    """``[W, K, K]``: per feature, the covariance over the rows of the ``K`` standardised layers of ``z [rows, K,
    W]`` (ones on the diagonal): what a mix's spread is computed from (:func:`mix_spread`)."""
    n = len(z)
    cov = np.zeros((z.shape[2], z.shape[1], z.shape[1]), dtype=np.float64)
    for s in range(0, n, 16384):  # in blocks: no [rows, K, K, W] product in memory
        block = z[s : s + 16384].astype(np.float64)
        cov += np.einsum("nkw,nlw->wkl", block, block)
    return (cov / max(n, 1)).astype(np.float32)


def mix_spread(cov: np.ndarray, mix: np.ndarray) -> np.ndarray:
    """``[W]``: the standard deviation of each feature of the mix ``sum_k mix[k] z_k`` of standardised layers whose
    covariance is ``cov [W, K, K]``; 1 for a one-layer mix, less for a mix of layers that are not perfectly
    correlated."""
    var = np.einsum("k,wkl,l->w", mix.astype(np.float64), cov.astype(np.float64), mix.astype(np.float64))
    return np.sqrt(np.maximum(var, 1e-12)).astype(np.float32)


def mean_objective(z: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray, strength: float) -> float:
    """The training objective the probes minimise, per row: mean cross-entropy of ``z [rows, D] @ w.T + b`` on ``y``
    plus ``||w||^2 / (2 C rows)`` over the classes present (two classes: the difference of their rows, as
    scikit-learn's binary form). Comparable between fits on the same rows and strength, e.g. a learned mix and the
    uniform mix of the same layers."""
    present = np.unique(y)
    logits = (z.astype(np.float64) @ w.T.astype(np.float64) + b)[:, present]
    logits -= logits.max(1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ce = -float(log_p[np.arange(len(y)), np.searchsorted(present, y)].mean())
    kept = w[present].astype(np.float64)
    penalty = float(((kept[1] - kept[0]) ** 2).sum()) if len(present) == 2 else float((kept ** 2).sum())
    return ce + penalty / (2 * strength * len(y))


def _choose(z: np.ndarray, y: np.ndarray, classes: int, strengths: tuple[float, ...],
            splits: list[tuple[np.ndarray, np.ndarray]], combine: str, seed: int,
            cov: np.ndarray | None = None) -> dict[float, float]:
    """Cross-validated accuracy of the strengths, from the strongest regularisation up (each fold warm-started from
    the previous strength, with the torch solver), until :data:`SCAN_PATIENCE` strengths in a row score below the best
    (the accuracy of a strength is unimodal in practice: the weakly regularised end, the slowest to fit, is then left
    out)."""
    right: dict[float, int] = {}
    starts: list[Any] = [None] * len(splits)
    below = 0
    for c in sorted(strengths):
        right[c] = 0
        for f, (tr, va) in enumerate(splits):
            w, b, _, _, mix = _fit_torch(z[tr], y[tr], classes, c, combine, seed, starts[f], CV_MAX_ITER, cov)
            starts[f] = (w, b, mix)
            right[c] += int((_logits(z[va], w, b, mix, cov).argmax(1) == y[va]).sum())
        below = below + 1 if right[c] < max(right.values()) else 0
        if below >= SCAN_PATIENCE:
            break
    validated = sum(len(va) for _, va in splits)
    return {c: r / validated for c, r in right.items()}


def _logits(z: np.ndarray, w: np.ndarray, b: np.ndarray, mix: np.ndarray | None,
            cov: np.ndarray | None = None) -> np.ndarray:
    if mix is None:
        return z @ w.T + b
    return (_mixed(z, mix) / (mix_spread(cov, mix) if cov is not None else 1.0)) @ w.T + b


def _full(w: np.ndarray, b: np.ndarray, classes: int, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows for every class (a class absent from a fold's rows scores -inf there, as it never could be predicted)."""
    if len(present) == classes:
        return w, b
    wf = np.zeros((classes, w.shape[1]), dtype=w.dtype)
    bf = np.full(classes, -np.inf, dtype=b.dtype)
    wf[present], bf[present] = w, b
    return wf, bf


def mean_objective_grad(z: np.ndarray, y: np.ndarray, coef: np.ndarray, intercept: np.ndarray,
                        strength: float) -> float:
    """Norm of the gradient of scikit-learn's objective over the rows, ``mean loss + ||coef||^2 / (2 C rows)``, at
    ``(coef, intercept)`` in scikit-learn's form: ``[1, D]`` for two classes (the logistic loss of the second, the
    classes being ``np.unique(y)``), else ``[classes present, D]`` (the multinomial loss)."""
    present = np.unique(y)
    n = len(y)
    logits = z @ coef.T + intercept
    if len(coef) == 1:
        p = 1 / (1 + np.exp(-logits))
        p[:, 0] -= y == present[-1]
    else:
        logits -= logits.max(1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(1, keepdims=True)
        p[np.arange(n), np.searchsorted(present, y)] -= 1
    gw = (p.T @ z) / n + coef / (strength * n)
    gb = p.sum(0) / n
    return float(np.sqrt((gw.astype(np.float64) ** 2).sum() + (gb.astype(np.float64) ** 2).sum()))


Fitted = tuple[np.ndarray, np.ndarray, int, float, "np.ndarray | None"]


def _fit_mix(z: np.ndarray, y: np.ndarray, classes: int, strength: float, seed: int,
             cov: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, float, np.ndarray, dict[str, float]]:
    """A scalar mix over ``z [rows, K, W]`` (standardised layers; ``cov`` their covariance), fitted from several
    starts, the lowest training objective kept: ``(w, b, iterations, grad_norm, mix, {start: objective})``.

    The starts: the uniform mix, with the probe fitted first on the uniform mean of the layers (standardised again:
    the probe scikit-learn would fit on it), and the mix leaning on the layer that probe scores best on alone. From
    the uniform start L-BFGS only descends, so the learned mix is never worse than the uniform mix of the same
    layers on the training objective; should no start end below the uniform probe itself (a numerical failure), that
    probe is the fit."""
    k = z.shape[1]
    uniform = np.full(k, 1.0 / k, dtype=np.float32)
    zu = _mixed(z, uniform) / mix_spread(cov, uniform)
    wu, bu, it_u, grad_u, _ = _fit_torch(zu, y, classes, strength, "concat", seed)
    floor = mean_objective(zu, y, wu, bu, strength)
    alone = [mean_objective(z[:, j], y, wu, bu, strength) for j in range(k)]  # each layer standardised: spread 1
    lean = np.full(k, 0.1 / (k - 1), dtype=np.float32)
    lean[int(np.argmin(alone))] = 0.9
    fits: dict[str, tuple[np.ndarray, np.ndarray, int, float, np.ndarray]] = {}
    objectives: dict[str, float] = {}
    for name, start in (("uniform", uniform), (f"lean on input {int(np.argmin(alone))}", lean)):
        w, b, iterations, grad_norm, mix = _fit_torch(z, y, classes, strength, "scalar_mix", seed, (wu, bu, start),
                                                      MAX_ITER, cov)
        mix = start if mix is None else mix
        fits[name] = (w, b, iterations, grad_norm, mix)
        objectives[name] = mean_objective(_mixed(z, mix) / mix_spread(cov, mix), y, w, b, strength)
    best = min(objectives, key=lambda name: objectives[name])
    if not objectives[best] <= floor:  # never worse than the uniform mix, whatever the optimiser did
        return wu, bu, it_u, grad_u, uniform, {**objectives, "uniform probe": floor}
    return (*fits[best], objectives)


def _fit_sklearn(z: np.ndarray, y: np.ndarray, classes: int, strength: float, combine: str, seed: int) -> Fitted:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    present = np.unique(y)
    if len(present) == 1:  # one class in these rows: it is always predicted
        wf, bf = _full(np.zeros((1, z.shape[1]), dtype=np.float32), np.zeros(1, dtype=np.float32), classes, present)
        return wf, bf, 0, 0.0, None
    model = LogisticRegression(C=strength, max_iter=MAX_ITER, tol=TOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # said by the caller from `converged`
        model.fit(z, y)
    coef, intercept = model.coef_, model.intercept_  # float64, as scikit-learn predicts
    grad = mean_objective_grad(z, y, coef, intercept, strength)
    if len(present) == 2:  # scikit-learn's binary form: one row, the second class's logit
        coef, intercept = np.concatenate([-coef / 2, coef / 2]), np.concatenate([-intercept / 2, intercept / 2])
    wf, bf = _full(coef, intercept, classes, present)
    return wf, bf, int(np.max(model.n_iter_)), grad, None


def _fit_torch(z: np.ndarray, y: np.ndarray, classes: int, strength: float, combine: str, seed: int,
               start: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None,
               max_iter: int = MAX_ITER, cov: np.ndarray | None = None) -> Fitted:
    """Full-batch L-BFGS (strong Wolfe) on scikit-learn's objective divided by ``rows``; two classes are penalised
    as scikit-learn's binary form is (on the difference of their rows). A scalar mix's weights (softmax of ``K``
    logits) are learned with the probe, unpenalised, the mix standardised again by its spread (``cov``, the layers'
    covariance :func:`layer_covariance`; :func:`mix_spread`), so the penalty on the probe is the same for every mix.
    ``start``: an earlier fit to start from; ``max_iter``: L-BFGS iterations at most."""
    xt = torch.from_numpy(np.ascontiguousarray(z))
    yt = torch.from_numpy(y.astype(np.int64))
    n = len(y)
    mixing = combine == "scalar_mix"
    w = torch.zeros(classes, z.shape[-1], dtype=torch.float32)
    b = torch.zeros(classes, dtype=torch.float32)
    logit_k = torch.zeros(z.shape[1] if mixing else 0, dtype=torch.float32)
    if start is not None:
        w.copy_(torch.from_numpy(start[0]))
        b.copy_(torch.from_numpy(np.nan_to_num(start[1], neginf=0.0)))
        if mixing and start[2] is not None:
            logit_k.copy_(torch.log(torch.from_numpy(start[2]).clamp_min(1e-12)))
    elif mixing:  # away from the saddle where the mix's gradient is zero
        w.normal_(0, 0.01, generator=torch.Generator().manual_seed(seed))
    params = [w, b] + ([logit_k] if mixing else [])
    for p in params:
        p.requires_grad_(True)
    present = torch.zeros(classes, dtype=torch.bool)
    present[yt.unique()] = True
    binary = int(present.sum()) == 2

    stacked = xt.reshape(-1, z.shape[-1]) if mixing else xt  # [rows * K, D]: each layer's logits in one product
    cov_t = torch.from_numpy(cov).double() if mixing and cov is not None else None

    def objective() -> torch.Tensor:
        if mixing:  # the mix of the layers' logits, the logits of the mix (linear): one pass over the rows, no copy
            weights = torch.softmax(logit_k, 0)
            w_mix = w
            if cov_t is not None:  # the mix standardised again: its spread folded into the probe's weights
                wd = weights.double()
                w_mix = w / torch.einsum("k,wkl,l->w", wd, cov_t, wd).clamp_min(1e-12).sqrt().float()
            per_layer = (stacked @ w_mix.T).view(n, z.shape[1], classes)
            logits = (per_layer * weights[None, :, None]).sum(1) + b
        else:
            logits = xt @ w.T + b
        logits = logits.masked_fill(~present, float("-inf"))
        kept = w[present]
        penalty = ((kept[1] - kept[0]) ** 2).sum() if binary else (kept ** 2).sum()
        return torch.nn.functional.cross_entropy(logits, yt) + penalty / (2 * strength * n)

    optim = torch.optim.LBFGS(params, lr=1, max_iter=max_iter, tolerance_grad=TOL, tolerance_change=1e-10,
                              history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optim.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optim.step(closure)
    iterations = int(optim.state[w].get("n_iter", 0))
    optim.zero_grad()
    objective().backward()
    grad_norm = float(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).norm())
    wn, bn = w.detach().numpy().copy(), b.detach().numpy().copy()
    bn[~present.numpy()] = -np.inf
    mix = torch.softmax(logit_k, 0).detach().numpy() if mixing else None
    return wn, bn, iterations, grad_norm, mix
