"""Load test of ``layerwise serve``: the service's throughput at 1, 8 and 64 concurrent clients over a direct encode.

Run: ``./dev bench serve_load [--model default] [--backend B] [--requests 512] [--texts-per-request 4]
[--clients 1,8,64] [--repeat 3]``.

Starts the server as a subprocess (``python -m layerwise.cli.main serve``, the same model, device and backend as the
in-process :class:`~layerwise.Extractor`) on a free loopback port. Each request is ``--texts-per-request`` short
sentences (SST-2 dev sentences from ``../shared/data/sst2/dev.tsv`` when present, overridable by
``$LAYERWISE_SHARED_DATA``, else generated ones) sent with ``encoding: base64`` (as :class:`layerwise.Client` does).
The clients are ``N`` keep-alive connections driven by one asyncio thread that sends prepared requests and parses
each answer to a numpy array, so the load generator takes as little as it can of the CPU it shares with the server
(its CPU per request is printed); a client per OS thread with ``http.client`` costs several times more and on two
cores competes with the model.

The direct baselines run in this process while the server is idle, on the same texts and options:

* **per request**: ``Extractor.encode`` once per request, one request after another. This is what "the same
  requests" means for one client: a lone client sends one request at a time, so no server can merge them. The
  ratio at 1 client is over this.
* **one call**: ``Extractor.encode`` over all texts at once (length-sorted token-budget batches): the upper bound
  that a server merging concurrent requests can approach. The ratio at 8 and 64 clients is over this (64 clients
  of 4 texts merge at most 256 texts per model call, so it is a bound rather than a like-for-like baseline).

Each round runs: per request, the server at each client count, one call; ``--repeat`` rounds after a warm-up.
The table shows each mode's best round and two ratios (texts/s of the server over texts/s of its baseline): of the
best rounds, and the median over rounds of the ratio within a round (the machine may be shared: compare ratios,
never absolute times). The acceptance of issue #16 is >= 0.85x at 1 client and >= 0.9x at 64 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
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
    if args.backend:
        cmd += ["--backend", args.backend]
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


def decode(data: bytes) -> np.ndarray:
    """What a client does with a sentence-level answer: parse the JSON, unpack the vectors (base64 or lists)."""
    packed = json.loads(data)["vectors"]
    if isinstance(packed, list):
        return np.asarray(packed, dtype=np.float32)
    dt = np.dtype(np.float16 if packed["dtype"] == "float16" else np.float32).newbyteorder("<")
    return np.frombuffer(base64.b64decode(packed["base64"]), dtype=dt).reshape(packed["shape"])


def run_load(port: int, requests: list[list[str]], clients: int, options: dict) -> tuple[float, list[float]]:
    """Send every request from ``clients`` concurrent keep-alive connections (asyncio, one thread, so the load
    generator takes as little of the shared CPU as it can); returns (wall seconds, per-request latencies)."""
    head = f"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    wires = []
    for texts in requests:
        body = json.dumps({"texts": texts, **options}).encode()
        wires.append(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    todo = iter(range(len(wires)))
    latencies: list[float] = []
    errors: list[str] = []

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in todo:  # shared by the clients: each takes the next request when it is free
                t0 = time.perf_counter()
                writer.write(wires[i])
                status, length = _head(await reader.readuntil(b"\r\n\r\n"))
                data = await reader.readexactly(length)
                if status == 200:
                    decode(data)
                else:
                    errors.append(f"HTTP {status}: {data[:200]!r}")
                latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - t0

    wall = asyncio.run(main())
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return wall, latencies


def run_openai(port: int, requests: list[list[str]], clients: int, options: dict) -> tuple[float, list[float]]:
    """The same load through the official ``openai`` client (``AsyncOpenAI.embeddings.create`` on
    ``/v1/embeddings``, base64 as the client asks by default, layers in ``extra_body``): what a user of the OpenAI
    protocol sees, client overhead included. Returns (wall seconds, per-request latencies)."""
    import httpx
    from openai import AsyncOpenAI

    extra = {"layers": options["layers"], "pool": options["pool"], "normalize": False}
    todo = iter(range(len(requests)))
    latencies: list[float] = []

    async def main() -> float:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client:
            async def worker() -> None:
                for i in todo:
                    t0 = time.perf_counter()
                    got = await client.embeddings.create(model=MODEL_NAME[0], input=requests[i], extra_body=extra)
                    np.asarray([d.embedding for d in got.data], dtype=np.float32)
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            return time.perf_counter() - t0

    return asyncio.run(main()), latencies


MODEL_NAME = ["bert"]  # the served name the OpenAI load asks for (set from the server's /v1/models)


def _head(raw: bytes) -> tuple[int, int]:
    """(status, Content-Length) of a response head."""
    lines = raw.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    return int(lines[0].split()[1]), length


@dataclass
class Mode:
    """The rounds of one mode: wall seconds of each, and the latencies and merge count of its best round."""

    walls: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    merged: str = "-"
    client_cpu: list[float] = field(default_factory=list)  # load generator CPU seconds per request, each round

    @property
    def best(self) -> float:
        return min(self.walls)

    def add(self, wall: float, latencies: list[float], merged: str = "-") -> None:
        if not self.walls or wall < self.best:
            self.latencies, self.merged = latencies, merged
        self.walls.append(wall)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (embedded all-MiniLM-L6-v2) or a model dir / hub id")
    ap.add_argument("--requests", type=int, default=512, help="requests per round and client count")
    ap.add_argument("--texts-per-request", type=int, default=4)
    ap.add_argument("--clients", default="1,8,64", help="comma-separated client counts")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (server and direct alternate); best round kept")
    ap.add_argument("--layers", default="-1")
    ap.add_argument("--pool", default="mean")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--protocol", default="layerwise", choices=["layerwise", "openai"],
                    help="layerwise: POST /v1/encode from raw keep-alive connections; openai: the official AsyncOpenAI "
                         "client on POST /v1/embeddings")
    ap.add_argument("--backend", default=None,
                    help="the Extractor's backend, for the server and the direct calls alike (default: its default)")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    layers = int(args.layers) if re.fullmatch(r"-?\d+", args.layers) else args.layers
    options = {"layers": layers, "pool": args.pool, "encoding": "base64"}

    k = args.texts_per_request
    texts, source = load_sentences(args.requests * k)
    requests = [texts[i * k : (i + 1) * k] for i in range(args.requests)]
    ex = lw.Extractor(None if args.model == "default" else args.model, device=args.device,
                      **({"backend": args.backend} if args.backend else {}))
    n_tokens = sum(len(ids) for ids in ex.tokenizer(texts)["input_ids"])

    def per_request() -> tuple[float, list[float]]:
        lat = []
        for req in requests:
            t1 = time.perf_counter()
            ex.encode(req, layers=layers, pool=args.pool)
            lat.append(time.perf_counter() - t1)
        return sum(lat), lat

    def one_call() -> tuple[float, list[float]]:
        t1 = time.perf_counter()
        ex.encode(texts, layers=layers, pool=args.pool)
        return time.perf_counter() - t1, []

    modes: dict[str | int, Mode] = {name: Mode() for name in ("per request", "one call", *clients)}
    port = free_port()
    proc = start_server(args, port)
    load = run_load
    if args.protocol == "openai":
        MODEL_NAME[0] = json.loads(get(port, "/v1/models")[1])["data"][0]["id"]
        load = run_openai
    try:
        load(port, requests[: min(64, len(requests))], 4, options)  # warm-up (both sides)
        ex.encode(texts[:64], layers=layers, pool=args.pool)
        for _ in range(args.repeat):  # each round: per request, the servers, one call (each ratio's pair adjacent)
            modes["per request"].add(*per_request())
            for c in clients:
                b0, r0 = metric(port, "layerwise_batches_total"), metric(port, "layerwise_batch_requests_sum")
                cpu0 = time.process_time()
                wall, lat = load(port, requests, c, options)
                modes[c].client_cpu.append((time.process_time() - cpu0) / len(requests))
                merged = (metric(port, "layerwise_batch_requests_sum") - r0) / max(
                    metric(port, "layerwise_batches_total") - b0, 1)
                modes[c].add(wall, lat, f"{merged:.1f}")
            modes["one call"].add(*one_call())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    print(f"\nlayerwise serve load ({args.protocol} protocol) on {ex!r}: {args.requests} requests x {k} texts "
          f"({source}), {len(texts)} texts, "
          f"{n_tokens:,} tokens, layers={layers!r}, pool={args.pool}, {torch.get_num_threads()} torch threads, "
          f"best of {args.repeat} alternating rounds\n")
    print("| mode | best wall s | texts/s | tokens/s | p50 ms | p99 ms | requests / model call | ratio (best) "
          "| ratio (median of rounds) |")
    print("|---|---|---|---|---|---|---|---|---|")

    def ms(lat: list[float], q: float) -> str:
        return f"{np.percentile(lat, q) * 1000:.1f}" if lat else "-"

    def row(name: str, m: Mode, ratio: str = "-", median: str = "-") -> None:
        print(f"| {name} | {m.best:.2f} | {len(texts) / m.best:,.0f} | {n_tokens / m.best:,.0f} "
              f"| {ms(m.latencies, 50)} | {ms(m.latencies, 99)} | {m.merged} | {ratio} | {median} |")

    def baseline(c: int) -> str:
        return "per request" if c == 1 else "one call"

    def ratios(c: int) -> tuple[float, float]:
        """(best direct / best server, median over rounds of direct / server of the same round): texts/s ratios."""
        base = modes[baseline(c)]
        return base.best / modes[c].best, float(np.median([b / s for b, s in zip(base.walls, modes[c].walls)]))

    row("direct `Extractor.encode`, per request", modes["per request"])
    row("direct `Extractor.encode`, one call", modes["one call"])
    for c in clients:
        best, median = ratios(c)
        row(f"server, {c} client{'s' if c > 1 else ''}", modes[c], f"{best:.2f}x {baseline(c)}", f"{median:.2f}x")
    print("\nratio: the service's texts/s over the direct baseline's on the same texts (1 client: `per request`, "
          "the same requests one at a time; more clients: `one call`, all texts at once). Acceptance (issue #16): "
          ">= 0.85x at 1 client, >= 0.9x at 64 clients.")
    for c in clients:
        best, median = ratios(c)
        verdict = {1: " (>= 0.85x)", 64: " (>= 0.9x)"}.get(c, "")
        print(f"  {c:>3} client{'s' if c > 1 else ' '}: {best:.2f}x {baseline(c)}{verdict}, median of rounds "
              f"{median:.2f}x; {modes['per request'].best / modes[c].best:.2f}x per request, "
              f"{modes['one call'].best / modes[c].best:.2f}x one call; load generator "
              f"{1000 * float(np.median(modes[c].client_cpu)):.2f} ms CPU / request")


if __name__ == "__main__":
    main()
