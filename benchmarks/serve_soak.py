"""Soak test of ``layerwise serve``: does the server's memory level off under a long, varied load?

Run: ``./dev bench serve_soak [--minutes 15] [--clients 32] [--backend B] [--sample 5]``.

Starts the server as a subprocess on the default ``auto`` backend (or ``--backend``) and drives it from ``--clients``
keep-alive connections (asyncio, one thread) for ``--minutes``. Every request is drawn at random (seeded): 1-16
SST-2 training sentences (``../shared/data/sst2/train.tsv``, overridable by ``$LAYERWISE_SHARED_DATA``; generated
sentences where absent), so batch sizes and padded lengths vary from call to call as they do in real traffic; a
layer spec of ``-1``, one layer of 1..L, ``-4:`` concatenated or ``-4:`` averaged; a pool of mean, cls or max;
``encoding: base64``. The server's resident memory (RSS of it and any child process it started, read from
``/proc``) is sampled every ``--sample`` seconds. Reported: RSS at minute 3 (once the runtime's graphs have been
built), the highest RSS after it, the last, the growth after minute 3 in percent (the issue's ceiling: < 10%), the
answers by status (a 503 or 429 is the server shedding load, not a failure) and the requests per second.
Results: ``benchmarks/results/serve_soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from benchmarks.serve_load import (
    WORDS,
    _head,
    commit,
    decode,
    free_port,
    get,
    machine,
    shared_data,
    start_server,
    stop_server,
)

RESULT = Path(__file__).resolve().parent / "results" / "serve_soak.json"
SETTLED_S = 180.0  # the growth is measured from this point of the run on


def sentences(n: int = 20000) -> tuple[list[str], str]:
    """Up to ``n`` SST-2 training sentences (varied lengths), or generated ones where the data is absent."""
    path = shared_data() / "sst2" / "train.tsv"
    if path.is_file():
        with open(path, encoding="utf-8", newline="") as f:
            rows = [r["sentence"].strip() for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
        rows = [r for r in rows if r][:n]
        if rows:
            return rows, f"SST-2 train ({path})"
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)], "generated sentences"


def options(rng: random.Random, num_layers: int) -> dict:
    """One request's fields besides ``texts``: a random layer spec and pool."""
    layers = rng.choice(["-1", str(rng.randint(1, num_layers)), "-4:", "-4:"])
    opts = {"layers": layers, "pool": rng.choice(["mean", "cls", "max"]), "encoding": "base64"}
    if layers == "-4:" and rng.random() < 0.5:
        opts["combine"] = "mean"
    return opts


def tree_rss(pid: int) -> float:
    """MB resident in process ``pid`` and its children."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 1e6


async def drive(port: int, clients: int, seconds: float, texts: list[str], num_layers: int, seed: int,
                statuses: Counter) -> None:
    """``clients`` connections sending random requests until ``seconds`` have passed."""
    head = f"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    end = time.monotonic() + seconds

    async def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < end:
                body = json.dumps({"texts": rng.sample(texts, rng.randint(1, 16)),
                                   **options(rng, num_layers)}).encode()
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                status, length = _head(await reader.readuntil(b"\r\n\r\n"))
                data = await reader.readexactly(length)
                statuses[status] += 1
                if status == 200:
                    decode(data)
                elif status in (429, 503):
                    await asyncio.sleep(1.0)  # what a client does with Retry-After
                else:
                    print(f"HTTP {status}: {data[:200]!r}", file=sys.stderr)
        finally:
            writer.close()

    await asyncio.gather(*(client(k) for k in range(clients)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--backend", default=None, help="the server's --backend (default: its own, auto)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    texts, source = sentences()
    port = free_port()
    proc = start_server(args, port)
    samples: list[tuple[float, float]] = []
    statuses: Counter = Counter()
    try:
        num_layers = json.loads(get(port, "/v1/model")[1])["num_layers"]
        t0 = time.monotonic()

        async def run() -> None:
            load = asyncio.ensure_future(drive(port, args.clients, args.minutes * 60, texts, num_layers, args.seed,
                                               statuses))
            while not load.done():
                samples.append((time.monotonic() - t0, tree_rss(proc.pid)))
                print(f"  t={samples[-1][0]:6.0f} s  RSS {samples[-1][1]:7.0f} MB  answers {dict(statuses)}",
                      flush=True)
                await asyncio.wait({load}, timeout=args.sample)
            load.result()

        asyncio.run(run())
        wall = time.monotonic() - t0
        ready = json.loads(get(port, "/ready")[1])
    finally:
        stop_server(proc)
    settled = [rss for t, rss in samples if t >= SETTLED_S]
    at3 = settled[0] if settled else samples[-1][1]
    peak = max(settled) if settled else at3
    result = {
        "benchmark": "serve_soak", "date": time.strftime("%Y-%m-%d"), "machine": machine(args.device),
        "commit": commit(), "backend": args.backend or "auto", "served_by": ready.get("depths", ready),
        "clients": args.clients, "minutes": round(wall / 60, 1), "texts": source,
        "rss_mb": {"start": round(samples[0][1]), "minute_3": round(at3), "peak_after_3": round(peak),
                   "end": round(samples[-1][1])},
        "growth_after_minute_3_pct": round(100 * (peak - at3) / at3, 1),
        "answers": {str(k): v for k, v in sorted(statuses.items())},
        "requests_per_s": round(sum(statuses.values()) / wall, 1),
        "samples": [[round(t), round(rss)] for t, rss in samples],
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
