"""Every notebook of ``examples/`` runs, offline, on the embedded model: each asserts its numbers against
hand-written transformers code, and the objects it shows (``Extractor``, ``LayerStack``, ``FeatureStore``, probe
and head results) display as HTML. Notebooks that read ``../shared/data`` skip, with the reason, where it is absent."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.ipynb"))
SHARED = ROOT.parent / "shared" / "data"
HTML_OUTPUTS = {  # notebook -> the objects whose display must be HTML (their names start the cell's last line)
    "01_all_hidden_states.ipynb": ("ex", "stack"),
    "02_specific_layers.ipynb": ("stack", "spec"),
    "03_last_four_into_fc_layers.ipynb": ("result",),
    "04_ner_all_layers.ipynb": ("results",),
    "05_classification_analysis.ipynb": ("per_layer", "mix"),
    "06_store_serve_explore.ipynb": ("store",),
}


def test_every_notebook_is_listed():
    assert {p.name for p in EXAMPLES} == set(HTML_OUTPUTS)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_notebook_runs(path, monkeypatch, tmp_path):
    book = nbformat.read(path, as_version=4)
    needs_data = any("shared_data()" in c.source for c in book.cells)
    if needs_data and not SHARED.is_dir() and not os.environ.get("LAYERWISE_DATA"):
        pytest.skip(f"{path.name} reads SST-2 / UD English-EWT from {SHARED}, which is absent")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's temporary folders: pytest's, removed in turn
    started = time.monotonic()
    nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    took = time.monotonic() - started
    shown = {}
    for cell in book.cells:
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        last = cell.source.strip().splitlines()[-1].split("#")[0].strip()
        for out in cell.get("outputs", []):
            if out.get("output_type") == "execute_result":
                shown[last] = out["data"]
    for name in HTML_OUTPUTS[path.name]:
        assert name in shown and "text/html" in shown[name], (name, list(shown))
        assert "<script" not in shown[name]["text/html"]
    print(f"{path.name}: {took:.0f} s")
