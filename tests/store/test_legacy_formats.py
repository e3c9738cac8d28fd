"""What the previous version wrote still loads: a store manifest whose spec names ``output_dtype`` "dtype" (and has no
``model_options``) opens, reads and resumes; a service request with "dtype" is served; a head config with the model
as a path and ``max_length`` beside it loads (tests/heads/test_heads.py)."""

from __future__ import annotations

import json

import numpy as np
from fastapi.testclient import TestClient

import layerwise as lw
from layerwise.serve import create_app

from tiny import extract


def _as_written_by_0x(store):
    path = store / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["spec"]["dtype"] = manifest["spec"].pop("output_dtype")
    manifest.pop("model_options")
    path.write_text(json.dumps(manifest, indent=2))
    return manifest


def test_a_store_of_the_previous_version_opens_and_resumes(tiny_extractors, tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("".join(f"text number {i}\n" for i in range(9)))
    ex = tiny_extractors["bert"]
    extract(src, tmp_path / "s", model=ex, layers="-2:", output_dtype="float16", shard_records=2, max_records=4)
    _as_written_by_0x(tmp_path / "s")
    st = lw.open_store(tmp_path / "s")
    assert st.spec.output_dtype == "float16" and st.dtype == np.float16 and len(st) == 4
    summary = extract(src, tmp_path / "s", model=ex, layers="-2:", output_dtype="float16", shard_records=2)
    assert summary.resumed_from == 4 and summary.total_records == 9  # the same run: resumed, not refused
    whole = tmp_path / "whole"
    extract(src, whole, model=ex, layers="-2:", output_dtype="float16", shard_records=2)
    np.testing.assert_array_equal(lw.open_store(tmp_path / "s").to_numpy(), lw.open_store(whole).to_numpy())


def test_a_request_of_the_previous_version_is_served(tiny_extractors):
    client = TestClient(create_app(tiny_extractors["bert"]))
    old = client.post("/v1/encode", json={"texts": ["I love Paris"], "dtype": "float16", "encoding": "base64"})
    new = client.post("/v1/encode", json={"texts": ["I love Paris"], "output_dtype": "float16", "encoding": "base64"})
    assert old.status_code == new.status_code == 200, old.text
    assert old.json()["vectors"] == new.json()["vectors"] and new.json()["vectors"]["dtype"] == "float16"
    assert new.json()["spec"]["output_dtype"] == "float16"
