"""Load test of ``layerwise serve``: throughput and latency at 1, 8 and 64 concurrent clients vs direct encode.

Run: ``./dev bench serve_load [--model default] [--requests 512] [--texts-per-request 4] [--clients 1,8,64]``.

Starts the server as a subprocess (``python -m layerwise.cli.main serve``) on a free loopback port, then for each
client count runs ``--requests`` requests from that many threads (each thread its own keep-alive connection; each
request a few short sentences: SST-2 dev sentences from ``../shared/data/sst2/dev.tsv`` when present, overridable
by ``$LAYERWISE_SHARED_DATA``, else generated ones) and reports texts/s, tokens/s, p50/p99 request latency and how
many requests the server merged per model call (from ``/metrics``). In the same run, with the server idle, it times
``Extractor.encode`` in this process on the same texts: once as one call over all texts (the batching upper
bound) and once per request, sequentially (what a client without a server would do). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

import layerwise as lw

WORDS = (
    "the a of to and in film movie story actor charming bleak funny slow long good bad best worst journey plot "
    "ending characters performance script director visual quiet loud heart mind"
).split()


def shared_data() -> Path:
    env = os.environ.get("LAYERWISE_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"


def load_sentences(n: int, seed: int = 0) -> tuple[list[str], str]:
    path = shared_data() / "sst2" / "dev.tsv"
    if path.is_file():
        with open(path, encoding="utf-8", newline="") as f:
            rows = [r["sentence"].strip() for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
        rows = [r for r in rows if r]
        if rows:
            return [rows[i % len(rows)] for i in range(n)], f"SST-2 dev ({path})"
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) for _ in range(n)], "generated sentences"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "layerwise.cli.main", "serve", "--device", args.device, "--port", str(port),
           "--log-level", "warning"]
    if args.model != "default":
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            if get(port, "/health")[0] == 200:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("server did not become healthy in 300 s")
        time.sleep(0.2)


def metric(port: int, name: str) -> float:
    text = get(port, "/metrics")[1].decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)} (\S+)$", text, flags=re.MULTILINE))


def run_load(port: int, requests: list[list[str]], clients: int, options: dict) -> tuple[float, list[float]]:
    """Send every request from ``clients`` threads; returns (wall seconds, per-request latencies in seconds)."""
    bodies = [json.dumps({"texts": texts, **options}).encode() for texts in requests]
    next_index, lock = iter(range(len(bodies))), threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    start = threading.Barrier(clients + 1)

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start.wait()
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            t0 = time.perf_counter()
            conn.request("POST", "/v1/encode", body=bodies[i], headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
                if resp.status != 200:
                    errors.append(f"HTTP {resp.status}: {data[:200]!r}")
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return wall, latencies


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (embedded all-MiniLM-L6-v2) or a model dir / hub id")
    ap.add_argument("--requests", type=int, default=512, help="requests per client count")
    ap.add_argument("--texts-per-request", type=int, default=4)
    ap.add_argument("--clients", default="1,8,64", help="comma-separated client counts")
    ap.add_argument("--layers", default="-1")
    ap.add_argument("--pool", default="mean")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    layers = int(args.layers) if re.fullmatch(r"-?\d+", args.layers) else args.layers
    options = {"layers": layers, "pool": args.pool, "encoding": "base64"}

    k = args.texts_per_request
    texts, source = load_sentences(args.requests * k)
    requests = [texts[i * k : (i + 1) * k] for i in range(args.requests)]
    ex = lw.Extractor(None if args.model == "default" else args.model, device=args.device)
    n_tokens = sum(len(ids) for ids in ex.tokenizer(texts)["input_ids"])

    port = free_port()
    proc = start_server(args, port)
    rows = []
    try:
        run_load(port, requests[: min(16, len(requests))], 4, options)  # warm-up
        for c in clients:
            b0, r0 = metric(port, "layerwise_batches_total"), metric(port, "layerwise_batch_requests_sum")
            wall, lat = run_load(port, requests, c, options)
            merged_requests = metric(port, "layerwise_batch_requests_sum") - r0
            merged = merged_requests / max(metric(port, "layerwise_batches_total") - b0, 1)
            rows.append((f"server, {c} client{'s' if c > 1 else ''}", wall, np.percentile(lat, 50),
                         np.percentile(lat, 99), f"{merged:.1f}"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    # direct, in this process, with the server stopped (same texts, same options)
    ex.encode(texts[:64], layers=layers, pool=args.pool)  # warm-up
    t0 = time.perf_counter()
    ex.encode(texts, layers=layers, pool=args.pool)
    rows.append(("direct `Extractor.encode`, one call", time.perf_counter() - t0, None, None, "-"))
    lat = []
    for req in requests:
        t1 = time.perf_counter()
        ex.encode(req, layers=layers, pool=args.pool)
        lat.append(time.perf_counter() - t1)
    rows.append(
        ("direct `Extractor.encode`, per request", sum(lat), np.percentile(lat, 50), np.percentile(lat, 99), "-")
    )

    print(f"\nlayerwise serve load on {ex!r}: {args.requests} requests x {k} texts ({source}), {len(texts)} texts, "
          f"{n_tokens:,} tokens, layers={layers!r}, pool={args.pool}, {torch.get_num_threads()} torch threads\n")
    print("| mode | wall s | texts/s | tokens/s | p50 ms | p99 ms | requests / model call |")
    print("|---|---|---|---|---|---|---|")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    for name, wall, p50, p99, merged in rows:
        print(f"| {name} | {wall:.2f} | {len(texts) / wall:,.0f} | {n_tokens / wall:,.0f} | {ms(p50)} | {ms(p99)} | "
              f"{merged} |")


if __name__ == "__main__":
    main()
