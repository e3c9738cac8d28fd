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
above ``SCAN_ROWS`` training rows they are ranked on a sample of about that many (whole sentences for a tagging task,
stratified by label otherwise: :func:`scan_sample`), and above ``ONE_FOLD_ROWS`` on one fold (a third of it). Then
the probe is refitted on the whole training split, starting from the scan's fit at the chosen strength. The split a
score is reported on is never read. For a tagging task the strengths are ranked on token accuracy while the table
reports entity F1 (:func:`~layerwise.probe.report.method_note` says so).

A learned scalar mix (``combine="scalar_mix"``) weighs the ``K`` standardised layers by softmax weights and
standardises the mix again (its per-feature spread computed from the layers' covariance), so the penalty on the probe
is the same for every mix. It is fitted from two starts, the uniform mix (its probe fitted first: L-BFGS only
descends from there) and the mix leaning on the layer that probe reads best, and the lower training objective is
kept, so a learned mix is never worse on the training objective than the uniform mix of the same layers. A lower
training objective can still be an overfit of ``K`` more parameters, so both mixes are then fitted on the strength
scan's folds and scored on their held-out rows, and the uniform mix is kept where it validates strictly better
(:func:`validate_mix`; ``mix_validation`` in the fit's report). (Without
the second standardisation a mix of layers that are not perfectly correlated has a smaller spread than any one layer,
and the penalty pushed every mix onto one: 0.9999 of the weight on one layer on SST-2.)

Solvers: the final fit is scikit-learn's ``LogisticRegression`` (``lbfgs``) where the features fit (``rows x width
<= SKLEARN_VALUES``); otherwise, for a learned scalar mix of layers (not a plain logistic regression), and for the
cross-validation fits, a full-batch L-BFGS in torch on the same objective (float32, strong Wolfe line search,
:mod:`layerwise.probe.solver`: the cached features read in chunks, never copied whole), which agrees with
scikit-learn on the same data (tested). The strengths of a scalar mix are ranked on the uniform mix's probe (a
one-layer probe's cost). Each final fit reports its iterations, the final gradient norm of the mean objective and
whether it converged; a probe that did not is warned.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import LayerwiseError
from .solver import (
    FeatureView,
    MixView,
    Problem,
    Solution,
    layer_objectives,
    mix_effective,
    mix_spread,
    objective_at,
    solve,
)

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
PREDICT_VALUES = 1 << 21  # feature values widened at a time when a fit predicts (float64: 16 MB)
HELD_MIX_BYTES = 32 << 20  # a uniform mix's values up to this size are held (float16), above computed at each pass
SCAN_ROWS = 20_000  # above this many training rows, the strengths are ranked on a sample of about this many


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
        mix_validation: a scalar mix: the held-out accuracy of the learned and of the uniform mix on the scan's
            folds and which was kept (:func:`validate_mix`; empty when there were too few rows to validate).
        scan_rows: the training rows the strengths were ranked on (all of them, or a sample above
            :data:`SCAN_ROWS`; 0: no scan).
        seconds: the wall time of the strength scan and of the final fit (``{"scan": .., "fit": ..}``).
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
    mix_validation: dict[str, Any] = field(default_factory=dict)
    scan_rows: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def logits(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """``[rows, classes]`` float64 for features ``x [rows, K, W]`` (any float dtype: widened a block of rows at
        a time, :data:`PREDICT_VALUES` values, never whole)."""
        step = max(1, PREDICT_VALUES // max(1, int(np.prod(x.shape[1:]))))
        w = self.weight.T.astype(np.float64)
        out = np.empty((len(x), len(self.bias)), dtype=np.float64)
        for s in range(0, len(x), step):
            v = _as_float(x[s : s + step])
            z = _mixed((v - self.mean) / self.scale, self.mix) / self.mix_scale if self.mix is not None else \
                (_combined(v, self.combine) - self.mean) / self.scale
            out[s : s + step] = z.astype(np.float64) @ w + self.bias  # float64: ties as scikit-learn
        return out

    def predict(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """Class indices ``[rows]`` for features ``x [rows, K, W]``."""
        return self.logits(x).argmax(1)

    def report(self) -> dict[str, Any]:
        """What the fit chose and how it ended, JSON-ready (the same for the same data: its times are in
        :attr:`seconds`)."""
        out = {"solver": self.solver, "C": self.strength, "iterations": self.iterations,
               "grad_norm": float(f"{self.grad_norm:.3g}"), "converged": self.converged,
               "objective": float(f"{self.objective:.6g}"), "scan_rows": self.scan_rows,
               "cv_accuracy": {f"{c:.4g}": round(s, 5) for c, s in self.scores.items()}}
        if self.starts:
            out["starts"] = {k: float(f"{v:.6g}") for k, v in self.starts.items()}
        if self.mix_validation:
            out["mix_validation"] = dict(self.mix_validation)
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


def scan_sample(n: int, groups: np.ndarray | None, y: np.ndarray, seed: int = 0,
                limit: int | None = None) -> np.ndarray | None:
    """The rows the strengths are ranked on: ``None`` (all ``n``) up to ``limit`` (:data:`SCAN_ROWS`), else a
    sample of about ``limit`` of them, sorted: whole groups (a tagging task's sentences) drawn at random, or, without
    groups, rows drawn per class in proportion to it (stratified), seeded."""
    limit = SCAN_ROWS if limit is None else limit
    if n <= limit:
        return None
    rng = np.random.default_rng(seed)
    if groups is None:
        picked = [rng.choice(np.flatnonzero(y == c), max(1, round(int((y == c).sum()) * limit / n)), replace=False)
                  for c in np.unique(y)]
        return np.sort(np.concatenate(picked))
    unique, counts = np.unique(groups, return_counts=True)
    order = rng.permutation(len(unique))
    take = int(np.searchsorted(np.cumsum(counts[order]), limit)) + 1
    return np.flatnonzero(np.isin(groups, unique[order[:take]]))


def fit_linear(x: torch.Tensor | np.ndarray, y: np.ndarray, classes: int, combine: str = "concat", *,
               groups: np.ndarray | None = None, strengths: tuple[float, ...] = STRENGTHS, folds: int = FOLDS,
               seed: int = 0, solver: str | None = None) -> LinearFit:
    """Fit the linear probe on ``x [rows, K, W]`` (a float16 or float32 tensor or array: read in chunks, never
    copied whole) with labels ``y [rows]`` (``0 <= y < classes``; rows with a negative label are left out), ``C``
    chosen by cross-validation on these rows only (on a sample of :data:`SCAN_ROWS` above that; see the module
    docstring).

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
    t0 = time.perf_counter()
    xt = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    if xt.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        xt = xt.float()
    y = np.asarray(y)
    keep = y >= 0
    rows = None if keep.all() else np.flatnonzero(keep)
    y = y[keep]
    groups = None if groups is None else np.asarray(groups)[keep]
    mixing = combine == "scalar_mix"
    view = FeatureView(xt, combine)
    mean, scale = view.moments(rows)
    cov = view.layer_covariance(rows, mean, scale) if mixing else None
    problem = Problem(view, rows, torch.from_numpy(y.astype(np.int64)), classes, mean, scale, cov)
    use = "torch" if mixing else solver or ("sklearn" if len(y) * view.dim <= SKLEARN_VALUES else "torch")
    sample = scan_sample(len(y), groups, y, seed) if len(strengths) > 1 else None
    scanned = problem if sample is None else problem.subset(sample)
    scan_groups = groups if sample is None or groups is None else groups[sample]
    splits = folds_of(scanned.n, scan_groups, folds, seed) if len(strengths) > 1 else []
    if scanned.n > ONE_FOLD_ROWS:  # enough rows that one held-out fold ranks the strengths
        splits = splits[:1]
    # a scalar mix's strengths are ranked on the uniform mix's probe (a one-layer probe's cost, not K layers')
    scores, warm = _choose(uniform_problem(scanned) if mixing else scanned, strengths, splits) if splits else ({}, {})
    if scores:
        best = max(scores.values())
        strength = min(c for c, s in scores.items() if s == best)  # ties: the strongest regularisation
    else:
        strength = 1.0 if len(strengths) > 1 else strengths[0]  # too few rows to validate: scikit-learn's default
    t1 = time.perf_counter()
    starts: dict[str, float] = {}
    mix_scale: np.ndarray | None = None
    mix: np.ndarray | None = None
    validation: dict[str, Any] = {}
    if mixing:
        sol, plain, starts = _fit_mix(problem, strength, seed)
        if splits:  # held-out rows decide between the learned and the uniform mix, as they decided the strength
            validation = validate_mix(scanned, splits, strength, seed, sol, plain)
            if validation["kept"] == "uniform":
                sol = plain
        w, b, iterations, grad_norm, objective, mix = (sol.weight, sol.bias, sol.iterations, sol.grad_norm,
                                                       sol.objective, sol.mix)
        if mix is None or cov is None:  # pragma: no cover - a mix's fit always has both
            raise RuntimeError("a scalar mix's fit returned no mix weights")
        mix_scale = mix_spread(cov, mix)
    elif use == "sklearn":
        z = view.dense(rows, mean, scale)
        w, b, iterations, grad_norm, _ = _fit_sklearn(z, y, classes, strength, combine, seed)
        objective = mean_objective(z, y, w, b, strength)
    else:
        sol = solve(problem, strength, start=warm.get(strength), seed=seed)
        w, b, iterations, grad_norm, objective = sol.weight, sol.bias, sol.iterations, sol.grad_norm, sol.objective
    shape = (view.layers, view.width) if mixing else (view.dim,)
    return LinearFit(weight=w, bias=b, mean=mean.numpy().reshape(shape), scale=scale.numpy().reshape(shape),
                     combine=combine, strength=strength, iterations=iterations, grad_norm=grad_norm,
                     converged=iterations < MAX_ITER, solver="scikit-learn lbfgs" if use == "sklearn" else
                     "torch L-BFGS", mix=mix, mix_scale=mix_scale, scores=scores, objective=objective, starts=starts,
                     mix_validation=validation, scan_rows=scanned.n if splits else 0,
                     seconds={"scan": round(t1 - t0, 2), "fit": round(time.perf_counter() - t1, 2)})


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


Warm = tuple[np.ndarray, np.ndarray]


def _choose(problem: Problem, strengths: tuple[float, ...],
            splits: list[tuple[np.ndarray, np.ndarray]]) -> tuple[dict[float, float], dict[float, Warm]]:
    """Cross-validated accuracy of the strengths, from the strongest regularisation up (each fold warm-started from
    the previous strength), until :data:`SCAN_PATIENCE` strengths in a row score below the best (the accuracy of a
    strength is unimodal in practice: the weakly regularised end, the slowest to fit, is then left out); with the
    first fold's fit at each strength (a start for the final fit)."""
    right: dict[float, int] = {}
    fitting = [problem.subset(tr) for tr, _ in splits]
    checking = [problem.subset(va) for _, va in splits]
    starts: list[Warm | None] = [None] * len(splits)
    warm: dict[float, Warm] = {}
    below = 0
    for c in sorted(strengths):
        right[c] = 0
        for f in range(len(splits)):
            sol = solve(fitting[f], c, start=starts[f], max_iter=CV_MAX_ITER)
            starts[f] = fitted = (sol.weight, sol.bias)
            if f == 0:
                warm[c] = fitted
            bias = torch.from_numpy(np.nan_to_num(sol.bias, neginf=-1e30).astype(np.float32))
            predicted = checking[f].logits(sol.effective, bias).argmax(1)
            right[c] += int((predicted == checking[f].y).sum())
        below = below + 1 if right[c] < max(right.values()) else 0
        if below >= SCAN_PATIENCE:
            break
    validated = sum(len(va) for _, va in splits)
    return {c: r / validated for c, r in right.items()}, warm


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


def uniform_problem(problem: Problem) -> Problem:
    """The problem of a scalar mix with its weights fixed at the uniform mix: a plain probe on the mean of the
    standardised layers, standardised again (:class:`~layerwise.probe.solver.MixView`, its values rounded to
    float16). Up to :data:`HELD_MIX_BYTES` it is computed once for the problem's rows and held ``[rows, 1, W]`` (a
    one-layer probe's features and cost); above, it is computed chunk by chunk at every pass (the same values, no
    copy: 0.16 GB on UD English-EWT's 204k words, beside 1.1 GB of features)."""
    held = problem.n * problem.view.width * 2 <= HELD_MIX_BYTES
    view = problem.view
    if problem.cov is None:  # pragma: no cover - only a scalar mix's problem is made uniform
        raise RuntimeError("uniform_problem needs a scalar mix's problem (its layers' covariance)")
    mixed = MixView(view.x, np.full(view.layers, 1.0 / view.layers, dtype=np.float32), problem.mean, problem.scale,
                    problem.cov, rounded=True)
    plain: FeatureView = FeatureView(mixed.held(problem.rows), "concat") if held else mixed
    rows = None if held else problem.rows
    mean, scale = plain.moments(rows)
    return Problem(plain, rows, problem.y, problem.classes, mean, scale)


def _fit_mix(problem: Problem, strength: float, seed: int) -> tuple[Solution, Solution, dict[str, float]]:
    """A scalar mix over the problem's ``K`` standardised layers, fitted from several starts, the lowest training
    objective kept: ``(learned, uniform, {start: objective})``, ``uniform`` being the probe of the uniform mix.

    The starts: the uniform mix, with the probe fitted first on the uniform mix of the layers (standardised again:
    the probe scikit-learn would fit on their mean), and the mix leaning on the layer that probe reads best alone.
    From the uniform start L-BFGS only descends, so the learned mix is never worse than the uniform mix of the same
    layers on the training objective; should no start end below the uniform probe itself (a numerical failure),
    that probe is the fit."""
    k = problem.view.layers
    uniform = np.full(k, 1.0 / k, dtype=np.float32)
    base = solve(uniform_problem(problem), strength, seed=seed)  # the probe of the uniform mix: one layer's cost
    floor = objective_at(problem, strength, base.weight, base.bias, uniform)  # where the uniform start began
    if problem.cov is None:  # pragma: no cover - only a scalar mix's problem is mixed
        raise RuntimeError("a scalar mix needs its problem's layer covariance")
    plain = Solution(weight=base.weight, bias=base.bias, mix=uniform,
                     effective=mix_effective(problem.cov, base.weight, uniform), iterations=base.iterations,
                     grad_norm=base.grad_norm, objective=floor)
    alone = layer_objectives(problem, base.weight, base.bias)
    j = int(np.argmin(alone))
    lean = np.full(k, 0.1 / (k - 1), dtype=np.float32)
    lean[j] = 0.9
    fits = {name: solve(problem, strength, mix=start, learn_mix=True, start=(base.weight, base.bias), seed=seed)
            for name, start in (("uniform", uniform), (f"lean on input {j}", lean))}
    objectives = {name: fit.objective for name, fit in fits.items()}
    best = min(objectives, key=lambda name: objectives[name])
    if not objectives[best] <= floor:  # never worse than the uniform mix, whatever the optimiser did
        return plain, plain, {**objectives, "uniform probe": floor}
    return fits[best], plain, objectives


def validate_mix(problem: Problem, splits: list[tuple[np.ndarray, np.ndarray]], strength: float, seed: int,
                 learned: Solution, plain: Solution) -> dict[str, Any]:
    """Whether a learned scalar mix predicts held-out rows at least as well as the uniform mix of its layers: on
    each of ``splits`` (the strength scan's folds of the training rows), both are fitted on the fold's training rows
    at ``strength``, each warm-started from its fit on every row (``learned``, ``plain``: :func:`_fit_mix`), and
    scored on its held-out rows. ``{"learned": accuracy, "uniform": accuracy, "rows": validated rows, "kept":
    "learned" | "uniform"}``: the learned mix is kept unless the uniform one validates strictly better (a lower
    training objective alone can be an overfit of ``K`` more parameters)."""
    if problem.cov is None or learned.mix is None:  # pragma: no cover - only a scalar mix is validated
        raise RuntimeError("validate_mix needs a scalar mix's problem and its learned mix")
    uniform = np.full(problem.view.layers, 1.0 / problem.view.layers, dtype=np.float32)
    right = {"learned": 0, "uniform": 0}
    for tr, va in splits:
        fold = problem.subset(tr)
        mixed = solve(fold, strength, mix=learned.mix, learn_mix=True, start=(learned.weight, learned.bias),
                      seed=seed)
        base = solve(uniform_problem(fold), strength, start=(plain.weight, plain.bias), seed=seed)
        check = problem.subset(va)
        for name, effective, bias in (("learned", mixed.effective, mixed.bias),
                                      ("uniform", mix_effective(problem.cov, base.weight, uniform), base.bias)):
            b = torch.from_numpy(np.nan_to_num(bias, neginf=-1e30).astype(np.float32))
            right[name] += int((check.logits(effective, b).argmax(1) == check.y).sum())
    rows = sum(len(va) for _, va in splits)
    return {"learned": round(right["learned"] / rows, 5), "uniform": round(right["uniform"] / rows, 5), "rows": rows,
            "kept": "learned" if right["learned"] >= right["uniform"] else "uniform"}


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
