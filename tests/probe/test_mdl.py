"""The online code (``layerwise.probe.mdl``): blocks that keep sentences whole, a first block at the uniform code,
later blocks coded by a probe fitted on what came before (checked against scikit-learn), and code lengths that
order layers by how much of the label they carry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerwise.errors import LayerwiseError
from layerwise.probe.mdl import SMOOTHING, block_ends, online_code


def _layers(n: int, seed: int = 0):
    """``[n, 2, 16]``: layer 0 carries the label (3 classes), layer 1 is noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = np.random.default_rng(7).normal(size=(3, 16))
    signal = centres[y] + 0.8 * rng.normal(size=(n, 16))
    noise = rng.normal(size=(n, 16))
    return torch.from_numpy(np.stack([signal, noise], 1).astype(np.float32)), y


def test_blocks_end_on_whole_sentences_and_cover_every_row():
    groups = np.repeat(np.arange(100), 10)  # 100 sentences of 10 words
    order = np.arange(1000)
    ends = block_ends(1000, groups, order, (0.001, 0.013, 0.5, 1.0))
    assert ends == [10, 20, 500, 1000]  # 1 row and 13 rows moved to the end of their sentence
    assert block_ends(1000, None, order, (0.001, 0.0011, 1.0)) == [1, 1000]  # an empty block is dropped


def test_the_informative_layer_has_the_shorter_code_and_noise_compresses_about_not_at_all():
    x, y = _layers(3000)
    signal = online_code(x[:, :1], y, 3, 1.0)
    noise = online_code(x[:, 1:], y, 3, 1.0)
    assert signal.rows == noise.rows == 3000
    assert signal.uniform_bits == pytest.approx(3000 * np.log2(3))
    assert signal.compression > 3 > 1.1 > noise.compression > 0.9
    assert signal.blocks[0] == {"rows": 3, "bits": pytest.approx(3 * np.log2(3))}  # 0.1%: the uniform code
    assert sum(b["bits"] for b in signal.blocks) == pytest.approx(signal.bits)
    report = signal.report()
    assert report["kbits"] == pytest.approx(signal.bits / 1000, abs=1e-3) and report["rows"] == 3000


def test_a_block_is_coded_by_the_probe_fitted_on_the_blocks_before_it():
    """Two blocks: the first at the uniform code, the second under scikit-learn's logistic regression fitted on the
    first (same strength; features standardised on every labelled row, as the code does). The solvers stop at their
    own tolerances: the bits agree within 0.05 of the block's 317 uniform bits."""
    from sklearn.linear_model import LogisticRegression

    x, y = _layers(400, seed=3)
    y[5] = -1  # an unlabelled row is left out
    code = online_code(x[:, :1], y, 3, 0.5, fractions=(0.5, 1.0), seed=0)
    keep = np.flatnonzero(y >= 0)
    order = keep[np.random.default_rng(0).permutation(len(keep))]
    z = x[:, 0].numpy().astype(np.float64)
    mean, std = z[keep].mean(0), z[keep].std(0)
    z = (z - mean) / std
    half = code.blocks[0]["rows"]
    model = LogisticRegression(C=0.5, max_iter=2000, tol=1e-8).fit(z[order[:half]], y[order[:half]])
    p = model.predict_proba(z[order[half:]])
    p = (1 - SMOOTHING) * p + SMOOTHING / 3
    bits = -np.log2(p[np.arange(len(p)), y[order[half:]]]).sum()
    assert code.rows == 399 and code.blocks[0]["bits"] == pytest.approx(half * np.log2(3))
    assert code.blocks[1]["bits"] == pytest.approx(bits, abs=0.05)
    assert bits < 0.05 * code.blocks[0]["bits"]  # the probe learned: far below the uniform code


def test_too_few_rows_is_refused():
    x, y = _layers(4)
    with pytest.raises(LayerwiseError, match="at least 2 labelled rows, got 1"):
        online_code(x, np.array([0, -1, -1, -1]), 3, 1.0)
