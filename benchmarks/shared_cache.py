"""Three processes share one graph cache with a limit smaller than what they build (issue 51's acceptance), the
embedded default model on ``auto``'s default path (no runtime named).

Run: ``./dev bench shared_cache [--processes 3] [--rounds 2] [--limit 200MB]``.

Each process loops ``--rounds`` times over depths 1..6: ``warm`` the depth (a server's path: its preparation queued
at once), wait for it, encode 16 sentences at that depth and compare with ``backend="torch"`` (max abs difference).
Meanwhile the cache directory is sampled every 0.2 s. Reported: errors, the worst difference (target <= 1e-5), the
temporary files left (target: none), the largest the cache grew and where it ended against the limit (target: within
it plus the graphs in use), how often a process waited for another's build instead of building it twice, and the
wall time. Writes ``benchmarks/results/shared_cache.json`` with the machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKER = r"""
import json, sys
import numpy as np
import layerwise as lw
rounds = int(sys.argv[1])
texts = [f"sentence {i}: the film never loses its nerve, even when the plot wanders for a while" for i in range(16)]
ex, ref = lw.Extractor(), lw.Extractor(backend="torch")
worst, served = 0.0, {}
for r in range(rounds):
    for depth in range(1, 7):
        ex.backend.warm(list(range(depth + 1)))
        assert ex.backend.settle(900), "the preparation did not end"
        got, want = ex.encode(texts, layers=depth, pool="mean"), ref.encode(texts, layers=depth, pool="mean")
        worst = max(worst, float(np.abs(got - want).max()))
        served[depth] = ex.backend.runtime_for([depth], "block")
print(json.dumps({"worst": worst, "served": served}))
"""


def on_disk(root: Path) -> int:
    """Bytes of every file under ``root`` (0 when absent)."""
    total = 0
    for p in root.rglob("*") if root.is_dir() else []:
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:
            pass
    return total


def main(argv: list[str] | None = None) -> None:
    """Run the processes, sample the cache, print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", default="200MB")
    args = parser.parse_args(argv)
    from layerwise.model.backends.cache import GraphCache
    from layerwise.model.hardware import cpu_model
    from layerwise.model.memory import parse_size

    limit = parse_size(args.limit, "--limit")
    with tempfile.TemporaryDirectory(prefix="lw-shared-") as tmp:
        root = Path(tmp) / "onnx"
        env = {k: v for k, v in os.environ.items() if k != "LAYERWISE_AUTO_RUNTIME"}
        env.update(LAYERWISE_CACHE=tmp, LAYERWISE_CACHE_LIMIT=args.limit, HF_HUB_OFFLINE="1")
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                peak[0] = max(peak[0], on_disk(root))

        sampler = threading.Thread(target=sample, daemon=True)
        t0 = time.perf_counter()
        sampler.start()
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(args.rounds)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(args.processes)]
        outs = [p.communicate(timeout=3600) for p in procs]
        done.set()
        seconds = time.perf_counter() - t0
        errors = [err[-2000:] for p, (_, err) in zip(procs, outs) if p.returncode != 0]
        results = [json.loads(out.strip().splitlines()[-1]) for p, (out, _) in zip(procs, outs) if p.returncode == 0]
        said = "".join(err for _, err in outs)
        survey = GraphCache(root).survey()
        report = {
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
            "date": time.strftime("%Y-%m-%d"), "processes": args.processes, "rounds": args.rounds,
            "limit_bytes": limit, "errors": errors, "worst_abs_diff": max((r["worst"] for r in results), default=None),
            "served": [r["served"] for r in results], "temporary_files_left": [str(t.path) for t in survey.temps],
            "cache_bytes_end": survey.bytes, "cache_bytes_peak": peak[0],
            "waited_for_another_build": said.count("waiting for another process"),
            "failed_preparations": said.count("failed"), "seconds": round(seconds, 1),
        }
    print(json.dumps({k: v for k, v in report.items() if k != "served"}, indent=1))
    out = Path(__file__).parent / "results" / "shared_cache.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
