"""What ``auto``'s background preparation costs the caller (issue 51, item 4): the foreground's throughput while a
depth is prepared (export in a child process at ``nice`` 10, the exactness check, the race), against PyTorch alone.

Run: ``./dev bench background_cost [--rounds 3] [--seconds 20]``.

Each round runs two fresh processes, alternating (the machine is shared), each with a fresh, empty cache:

* ``torch``: ``backend="torch"``, encoding batches of 32 SST-2-like sentences at the last layer of the embedded
  default model for ``--seconds``; sentences a second;
* ``auto``: the default backend on the default path; ``warm`` queues the depth's preparation (what a server does)
  and the same batches run, on PyTorch, until the preparation is done; sentences a second over that window, the
  window's length, and which runtime was decided.

Prints a table (best of ``--rounds`` per case) and writes ``benchmarks/results/background_cost.json`` with the machine
and date. Target (issue 51): ``auto`` keeps at least 0.9x of ``torch`` while it prepares, on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time
import layerwise as lw
case, seconds = sys.argv[1], float(sys.argv[2])
words = "a gripping , funny and touching film that never loses its nerve even when the plot wanders".split()
texts = [" ".join(words[i % 7:(i % 7) + 8 + i % 9]) for i in range(32)]
ex = lw.Extractor(backend="torch") if case == "torch" else lw.Extractor()
ex.encode(texts[:4], layers=-1)  # loaded, warmed up
if case == "auto":
    ex.backend.warm(list(range(ex.num_layers + 1)))
done, t0 = 0, time.perf_counter()
while True:
    ex.encode(texts, layers=-1, pool="mean")
    done += len(texts)
    elapsed = time.perf_counter() - t0
    if case == "torch" and elapsed >= seconds:
        break
    if case == "auto" and not ex.backend.pending():
        break
out = {"rate": done / elapsed, "seconds": elapsed}
if case == "auto":
    out["runtime"] = ex.backend.runtime_for([ex.num_layers], "block")
print(json.dumps(out))
"""


def run(case: str, seconds: float) -> dict:
    """One fresh process of ``case`` with a fresh cache: ``{"rate", "seconds"[, "runtime"]}``."""
    with tempfile.TemporaryDirectory(prefix="lw-bg-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "LAYERWISE_AUTO_RUNTIME"}
        env.update(LAYERWISE_CACHE=cache, HF_HUB_OFFLINE="1", LAYERWISE_QUIET="1")
        done = subprocess.run([sys.executable, "-c", CHILD, case, str(seconds)], env=env, capture_output=True,
                              text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Run the rounds, print the table, write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    rounds: list[dict] = []
    for r in range(args.rounds):
        pair = {case: run(case, args.seconds) for case in (("torch", "auto") if r % 2 == 0 else ("auto", "torch"))}
        pair["ratio"] = pair["auto"]["rate"] / pair["torch"]["rate"]
        rounds.append(pair)
        print(f"round {r + 1}: torch {pair['torch']['rate']:.1f}/s, auto {pair['auto']['rate']:.1f}/s over "
              f"{pair['auto']['seconds']:.1f} s of preparation ({pair['auto']['runtime']} decided): "
              f"{pair['ratio']:.2f}x", flush=True)
    best = max(r["ratio"] for r in rounds)
    median = sorted(r["ratio"] for r in rounds)[len(rounds) // 2]
    print(f"auto while preparing / torch alone: best {best:.2f}x, median {median:.2f}x (target >= 0.9x)")
    from layerwise.model.hardware import cpu_model

    out = Path(__file__).parent / "results" / "background_cost.json"
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()}
    out.write_text(json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d"), "rounds": rounds, "best": best,
                               "median": median}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
