"""One graph cache for every process, on ``auto``'s default path (no runtime pinned): three processes warm and
encode every depth in turns against one cache with a limit smaller than what they build, evicting each other's
graphs; none errs, every result is PyTorch's within 1e-5, no temporary file is left, and the cache ends within its
limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from layerwise.model.backends.cache import GraphCache
from layerwise.model.memory import parse_size

pytest.importorskip("onnxruntime")

LIMIT = "300KB"  # one tiny BERT's export (142 kB) and a cut or two: every round evicts

WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import layerwise as lw

    model, rounds = sys.argv[1], int(sys.argv[2])
    texts = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naive cafes " * 9]
    ex, ref = lw.Extractor(model), lw.Extractor(model, backend="torch")
    worst, served = 0.0, []
    for r in range(rounds):
        for depth in (1, 2, 0):
            ex.backend.warm(list(range(depth + 1)))   # what a server does for a depth it will serve
            assert ex.backend.settle(120), "the preparation did not end"
            got = ex.encode(texts, layers=depth, pool="mean")
            want = ref.encode(texts, layers=depth, pool="mean")
            worst = max(worst, float(np.abs(got - want).max()))
            served.append(ex.backend.runtime_for([max(depth, 1)], "block"))
    print(json.dumps({"worst": worst, "served": served}))
    """
)


def test_three_processes_share_one_cache_with_a_small_limit(tiny_dirs, tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "LAYERWISE_AUTO_RUNTIME"}  # the default path
    env.update(LAYERWISE_CACHE=str(cache), LAYERWISE_CACHE_LIMIT=LIMIT, HF_HUB_OFFLINE="1")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(tiny_dirs["bert"]), "3"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["worst"] <= 1e-5 for r in results), results
    assert any(s != "torch" for r in results for s in r["served"]), results  # compiled runtimes served too
    graphs = GraphCache(cache / "onnx")
    survey = graphs.survey()
    assert survey.temps == [], survey.temps  # no temporary file left behind
    leftovers = [p.name for p in (cache / "onnx").rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
    assert graphs.total() <= parse_size(LIMIT, "LAYERWISE_CACHE_LIMIT"), [(e.name, e.bytes) for e in graphs.entries()]
    said = "".join(err for _, err in outs)
    assert "failed" not in said, said[-3000:]
    import re

    built = {Path(p).name.split(".")[0] for p in re.findall(r"cached at (\S+)", said)}
    left = {e.name for e in graphs.entries()}
    assert built - left, (built, left)  # graphs were evicted to keep the limit (the test exercised eviction)
