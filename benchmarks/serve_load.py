"""Load test of ``layerwise serve``: the service's throughput at 1, 8 and 64 concurrent clients over a direct encode.

Run: ``./dev bench serve_load [--model default] [--backend B] [--requests 512] [--texts-per-request 4]
[--clients 1,8,64] [--repeat 3] [--device cpu|cuda] [--mixed]``.

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

**Mixed specs** (``--mixed``, e.g. ``./dev bench serve_load --mixed --clients 32,64 --requests 512 --repeat 5``):
the server against itself, no direct baseline. At each client count, two loads over the same requests (the same
texts, ``encoding: base64``): **all-last**, every request ``layers=--layers`` (default -1) ``pool=--pool``, and
**mixed**, each request one layer of 1..L (L: the model's layer count, from ``GET /v1/model``) and one pool of
``--mix-pools`` (default mean, cls); the (layer, pool) pairs are spread evenly over the requests and shuffled with
``--seed``, so the layers needed (the mean requested depth over L) are as close to (L + 1) / 2L as the request count
allows (58% for 6 layers). Before timing, every depth 1..L is compiled: the server starts with ``--warm 1 ... --warm
L`` (where ``layerwise serve`` has the option; ``--warm all`` would warm the deepest only), ``GET /ready`` is polled
until it answers 200 with nothing pending, one request per (depth, pool) is sent, and ``/ready`` is polled again
until no depth is pending (the ``auto`` backend's background preparation). Each round runs both loads at each client
count back to back, the order alternating from one round to the next; the table shows the best round of each load,
the ratio of their texts/s, the median over rounds of the ratio within a round, and p50/p99 latencies over every
round's requests, the requests per model call with, for the mixed load, the share of its model calls whose rows each
left at their own depth (``layerwise_batches_ragged``; the rest ran cut into depth segments), and the batcher's
corrections of each way at the end (``layerwise_cost_correction``). Issue: mixed >= 1.3x all-last at 32 and 64
clients. ``--device cuda`` runs it on a GPU (the server's device).

**While the stages prepare** (``--mixed --preparing``): the server starts on an empty graph cache (a temporary
``LAYERWISE_CACHE``: every graph exported, and the runtimes raced, before ``/ready``, as on a first start on a
machine), and the rounds start as soon as ``/ready`` answers, with no mixed request before them: the first mixed load
is the one that asks for the one-layer graphs of mixed depths, which are then built, checked and timed in the
background while it runs. The first round's pair is reported on its own (with what ``/ready`` listed as pending
before and after its mixed load), the later rounds as usual. Issue: >= 1.0x while the stages prepare.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import http.client
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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


def start_server(args, port: int, warm: Sequence[str] = (), env: dict | None = None) -> subprocess.Popen:
    """``layerwise serve`` on ``port`` (``args``: model, device, backend), each of ``warm`` as a ``--warm`` option;
    returned once ``/health`` answers 200."""
    cmd = [sys.executable, "-m", "layerwise.cli.main", "serve", "--device", args.device, "--port", str(port),
           "--log-level", "warning"]
    if args.model != "default":
        cmd += ["--model", args.model]
    if args.backend:
        cmd += ["--backend", args.backend]
    for spec in warm:
        cmd += ["--warm", spec]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
                                      **(env or {})})
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


def metrics(port: int, *names: str) -> np.ndarray:
    """The server's counters ``names`` (each summed over its label sets), from one scrape of ``/metrics``."""
    text = get(port, "/metrics")[1].decode()
    return np.array([sum(float(v) for v in re.findall(rf"^{re.escape(name)} (\S+)$", text, flags=re.MULTILINE))
                     for name in names])


COUNTED = ("layerwise_batches_total", "layerwise_batch_requests_sum", "layerwise_batches_ragged_total")


def decode(data: bytes) -> np.ndarray:
    """What a client does with a sentence-level answer: parse the JSON, unpack the vectors (base64 or lists)."""
    packed = json.loads(data)["vectors"]
    if isinstance(packed, list):
        return np.asarray(packed, dtype=np.float32)
    dt = np.dtype(np.float16 if packed["dtype"] == "float16" else np.float32).newbyteorder("<")
    return np.frombuffer(base64.b64decode(packed["base64"]), dtype=dt).reshape(packed["shape"])


def request_options(options: dict | list[dict], n: int) -> list[dict]:
    """The options of each of ``n`` requests: one dict for all, or a list with one per request."""
    if isinstance(options, dict):
        return [options] * n
    if len(options) != n:
        raise ValueError(f"{len(options)} request options for {n} requests")
    return options


def run_load(port: int, requests: list[list[str]], clients: int,
             options: dict | list[dict]) -> tuple[float, list[float]]:
    """Send every request from ``clients`` concurrent keep-alive connections (asyncio, one thread, so the load
    generator takes as little of the shared CPU as it can); returns (wall seconds, per-request latencies).
    ``options``: the request fields besides ``texts``, for all requests or one dict per request."""
    head = f"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    wires = []
    for texts, opts in zip(requests, request_options(options, len(requests))):
        body = json.dumps({"texts": texts, **opts}).encode()
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


def run_openai(port: int, requests: list[list[str]], clients: int,
               options: dict | list[dict]) -> tuple[float, list[float]]:
    """The same load through the official ``openai`` client (``AsyncOpenAI.embeddings.create`` on
    ``/v1/embeddings``, base64 as the client asks by default, layers in ``extra_body``): what a user of the OpenAI
    protocol sees, client overhead included. Returns (wall seconds, per-request latencies)."""
    import httpx
    from openai import AsyncOpenAI

    extras = [{"layers": o["layers"], "pool": o["pool"], "normalize": False}
              for o in request_options(options, len(requests))]
    todo = iter(range(len(requests)))
    latencies: list[float] = []

    async def main() -> float:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client:
            async def worker() -> None:
                for i in todo:
                    t0 = time.perf_counter()
                    got = await client.embeddings.create(model=MODEL_NAME[0], input=requests[i], extra_body=extras[i])
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

def serve_has_warm() -> bool:
    """Whether this ``layerwise serve`` takes ``--warm`` (its ``--help`` names it)."""
    out = subprocess.run([sys.executable, "-m", "layerwise.cli.main", "serve", "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
    return "--warm" in out.stdout


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_ready(port: int, timeout: float) -> tuple[dict | None, float]:
    """Poll ``GET /ready`` (once a second: the ``auto`` backend prepares in the caller's quiet moments) until it
    answers 200 with no depth pending; returns (its last state, seconds waited). The state is None where the server
    has no ``/ready``; a state that is not ready (an error, or ``timeout`` passed) is said on stderr."""
    t0 = time.monotonic()
    said = t0
    while True:
        status, body = get(port, "/ready")
        if status == 404:
            return None, time.monotonic() - t0
        try:
            state = json.loads(body)
        except ValueError:
            state = {"raw": body[:200].decode(errors="replace")}
        waited = time.monotonic() - t0
        if status == 200 and not state.get("pending"):
            return state, waited
        if state.get("error") or waited > timeout:
            why = f"error {state['error']}" if state.get("error") else f"not ready after {timeout:.0f} s"
            print(f"WARNING: /ready {status} ({why}): {state}; measuring anyway", file=sys.stderr)
            return state, waited
        if time.monotonic() - said > 15:
            print(f"  ... waiting for /ready ({waited:.0f} s): pending {state.get('pending')}", file=sys.stderr)
            said = time.monotonic()
        time.sleep(1.0)


def background(port: int) -> list:
    """The depths whose runtime or one-layer graphs the server is still preparing: ``/ready``'s ``pending`` (warmed
    depths) and ``preparing`` (others)."""
    state = json.loads(get(port, "/ready")[1])
    return sorted(set(state.get("pending") or []) | set(state.get("preparing") or []))


def mixed_options(n: int, num_layers: int, pools: list[str], seed: int, base: dict) -> list[dict]:
    """One option dict per request: ``base`` with a layer of 1..num_layers and a pool of ``pools``. The pairs are
    dealt evenly (every pair once per ``num_layers * len(pools)`` requests, each deal shuffled) and the whole list
    shuffled, with ``seed``: the mean depth is as close to (num_layers + 1) / 2 as ``n`` allows."""
    rng = random.Random(seed)
    pairs = [(d, p) for d in range(1, num_layers + 1) for p in pools]
    drawn: list[tuple[int, str]] = []
    while len(drawn) < n:
        deal = pairs[:]
        rng.shuffle(deal)
        drawn += deal
    drawn = drawn[:n]
    rng.shuffle(drawn)
    return [{**base, "layers": d, "pool": p} for d, p in drawn]


def machine(device: str) -> str:
    """The CPU (and GPU where ``device`` is one), e.g. ``AMD EPYC, 2 cores``."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    out = f"{cpu or platform.machine()}, {os.cpu_count()} cores"
    if device.startswith("cuda") and torch.cuda.is_available():
        out += f", {torch.cuda.get_device_name(torch.device(device))}"
    return out


def commit() -> str:
    """The checkout's commit, ``+ uncommitted changes`` when its tree differs."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + uncommitted changes" if dirty else "")


def main_mixed(args, clients: list[int], options: dict, requests: list[list[str]], texts: list[str],
               source: str) -> None:
    """``--mixed``: all-last against mixed specs at each client count, alternating within each round (see the module
    docstring)."""
    k = args.texts_per_request
    pools = [p.strip() for p in args.mix_pools.split(",") if p.strip()]
    # the model's layer count, from a first start of the server (the --warm options below need it)
    port = free_port()
    proc = start_server(args, port)
    try:
        info = json.loads(get(port, "/v1/model")[1])
    finally:
        stop_server(proc)
    num_layers = int(info["num_layers"])
    mixed = mixed_options(len(requests), num_layers, pools, args.seed,
                          {key: v for key, v in options.items() if key not in ("layers", "pool")})
    depths = [o["layers"] for o in mixed]
    needed = float(np.mean(depths)) / num_layers

    has_warm = serve_has_warm()
    port = free_port()
    t_start = time.monotonic()
    fresh = tempfile.TemporaryDirectory(prefix="layerwise-cache-") if args.preparing else None
    proc = start_server(args, port, [str(d) for d in range(1, num_layers + 1)] if has_warm else [],
                        env={"LAYERWISE_CACHE": fresh.name} if fresh is not None else None)
    load = run_load
    if args.protocol == "openai":
        MODEL_NAME[0] = json.loads(get(port, "/v1/models")[1])["data"][0]["id"]
        load = run_openai
    loads = {"last": options, "mixed": mixed}
    modes: dict[tuple[str, int], Mode] = {(kind, c): Mode() for kind in loads for c in clients}
    all_lat: dict[tuple[str, int], list[float]] = {key: [] for key in modes}
    rounds: list[tuple[str, ...]] = []
    pending: list[tuple[object, object]] = []  # --preparing: what is being prepared before and after each mixed load
    try:
        state, _ = wait_ready(port, args.ready_timeout)
        if not args.preparing:
            # one request per (depth, pool), then until no depth is pending: every depth compiled before any timing
            load(port, [requests[0]] * (num_layers * len(pools)), 1,
                 [{**options, "layers": d, "pool": p} for d in range(1, num_layers + 1) for p in pools])
            state, _ = wait_ready(port, args.ready_timeout)
        for kind, opts in loads.items():  # warm-up of both loads (--preparing: all-last only)
            n = min(64, len(requests))
            if kind == "last" or not args.preparing:
                load(port, requests[:n], 4, opts if isinstance(opts, dict) else opts[:n])
        if not args.preparing:
            state, _ = wait_ready(port, args.ready_timeout)
        t_ready = time.monotonic() - t_start
        for r in range(args.repeat):
            for ci, c in enumerate(clients):  # both loads back to back, the order alternating
                order = ("last", "mixed") if (r + ci) % 2 == 0 else ("mixed", "last")
                rounds.append(order)
                for kind in order:
                    if kind == "mixed" and args.preparing:
                        pending.append((background(port), None))
                    before = metrics(port, *COUNTED)
                    cpu0 = time.process_time()
                    wall, lat = load(port, requests, c, loads[kind])
                    modes[kind, c].client_cpu.append((time.process_time() - cpu0) / len(requests))
                    calls, requested, ragged_calls = metrics(port, *COUNTED) - before
                    merged, ragged = requested / max(calls, 1), ragged_calls / max(calls, 1)
                    modes[kind, c].add(wall, lat, f"{merged:.1f}" + (f" ({ragged:.0%} ragged)" if kind == "mixed"
                                                                        else ""))
                    all_lat[kind, c] += lat
                    if kind == "mixed" and args.preparing:
                        pending[-1] = (pending[-1][0], background(port))
        info = json.loads(get(port, "/v1/model")[1])
        text = get(port, "/metrics")[1].decode()
        corrections = re.findall(r'^layerwise_cost_correction\{.*way="([\w:]+)"\} (\S+)$', text, flags=re.MULTILINE)
        by_runtime = re.findall(r'^layerwise_runtime_calls_total\{runtime="([^"]+)"\} (\S+)$', text, flags=re.MULTILINE)
    finally:
        stop_server(proc)
        if fresh is not None:
            fresh.cleanup()

    runtimes = state.get("depths") if state else None
    if isinstance(runtimes, dict):
        runtimes = ", ".join(f"{d}: {runtimes[d]}" for d in sorted(runtimes, key=lambda d: int(d)))
    print(f"\nlayerwise serve load, mixed specs ({args.protocol} protocol): {info.get('name')} ({num_layers} layers), "
          f"device {args.device}, backend {args.backend or 'default'}; {len(requests)} requests x {k} texts "
          f"({source}), {len(texts)} texts a load, best of {args.repeat} rounds (both loads at each client count "
          f"back to back, order alternating)")
    print(f"all-last: layers={options['layers']!r}, pool={options['pool']}; mixed: layers 1..{num_layers} x pools "
          f"{', '.join(pools)} (seed {args.seed}): mean depth {np.mean(depths):.2f} of {num_layers}, "
          f"layers needed {needed:.1%}")
    print(f"warm: {'--warm ' + ' --warm '.join(str(d) for d in range(1, num_layers + 1)) if has_warm else 'no --warm'}"
          f"; /ready {'absent' if state is None else ('200' if state.get('ready') else 'NOT ready')}, runtime per "
          f"depth {{{runtimes}}}; {t_ready:.0f} s from start to the first timed load")
    print(f"machine: {machine(args.device)}; {time.strftime('%Y-%m-%d')}; commit {commit()}; "
          f"model backend {info.get('backend')}; cost corrections at the end "
          f"{{{', '.join(f'{w}: {float(v):.2f}' for w, v in corrections) or 'none'}}}; model calls by runtime "
          f"(X-Layerwise-Runtime, the whole run) "
          f"{{{', '.join(f'{r}: {float(v):.0f}' for r, v in by_runtime) or 'none'}}}\n")

    def ms(lat: list[float], q: float) -> str:
        return f"{np.percentile(lat, q) * 1000:,.1f}" if lat else "-"

    def ratios(c: int) -> tuple[float, float]:
        """(best all-last / best mixed, median over rounds of the same round's): the mixed texts/s over all-last's."""
        last, mix = modes["last", c], modes["mixed", c]
        return last.best / mix.best, float(np.median([a / b for a, b in zip(last.walls, mix.walls)]))

    print("| clients | all-last texts/s | mixed texts/s | ratio (best rounds) | median within-round ratio "
          "| p50 all-last / mixed ms | p99 all-last ms | p99 mixed ms | layers needed "
          "| requests / model call (all-last / mixed) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in clients:
        last, mix = modes["last", c], modes["mixed", c]
        best, median = ratios(c)
        print(f"| {c} | {len(texts) / last.best:,.0f} | {len(texts) / mix.best:,.0f} | {best:.2f}x | {median:.2f}x "
              f"| {ms(all_lat['last', c], 50)} / {ms(all_lat['mixed', c], 50)} | {ms(all_lat['last', c], 99)} "
              f"| {ms(all_lat['mixed', c], 99)} | {needed:.0%} | {last.merged} / {mix.merged} |")
    if args.preparing:
        c = clients[0]
        last, mix = modes["last", c].walls[0], modes["mixed", c].walls[0]
        print(f"\nwhile the stages prepare (round 1 at {c} clients, order {' then '.join(rounds[0])}): all-last "
              f"{len(texts) / last:,.0f} texts/s, mixed {len(texts) / mix:,.0f} texts/s: {last / mix:.2f}x (target >= "
              f"1.0x); depths being prepared (/ready) before / after the mixed load: {pending[0][0]} / {pending[0][1]}")
        for before, after in pending[1:]:
            print(f"  a later mixed load: depths being prepared before / after: {before} / {after}")
    print("\nratio: mixed texts/s over all-last texts/s (best rounds; and the median over rounds of the ratio within a "
          "round). Latencies over every round's requests; requests / model call: the best round's. Issue: mixed >= "
          "1.3x all-last at 32 and 64 clients, every depth compiled.")
    for c in clients:
        best, median = ratios(c)
        verdict = " (target >= 1.3x)" if c in (32, 64) else ""
        print(f"  {c:>3} client{'s' if c > 1 else ' '}: {best:.2f}x{verdict}, median of rounds {median:.2f}x; "
              f"load generator {1000 * float(np.median(modes['last', c].client_cpu)):.2f} / "
              f"{1000 * float(np.median(modes['mixed', c].client_cpu)):.2f} ms CPU / request (all-last / mixed)")


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
    ap.add_argument("--mixed", action="store_true",
                    help="all-last (--layers, --pool) against mixed specs (each request a layer of 1..L and a pool of "
                         "--mix-pools) on the server, no direct baseline; every depth compiled before timing")
    ap.add_argument("--mix-pools", default="mean,cls", help="--mixed: the pools the mixed requests draw from")
    ap.add_argument("--preparing", action="store_true",
                    help="--mixed: start on an empty graph cache and time from /ready on, the first round while the "
                         "one-layer graphs of mixed depths prepare (reported on its own)")
    ap.add_argument("--seed", type=int, default=0, help="--mixed: the seed of the mixed requests' layers and pools")
    ap.add_argument("--ready-timeout", type=float, default=900,
                    help="--mixed: seconds to wait for GET /ready (every depth prepared) before measuring anyway")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    layers = int(args.layers) if re.fullmatch(r"-?\d+", args.layers) else args.layers
    options = {"layers": layers, "pool": args.pool, "encoding": "base64"}

    k = args.texts_per_request
    texts, source = load_sentences(args.requests * k)
    requests = [texts[i * k : (i + 1) * k] for i in range(args.requests)]
    if args.mixed:
        main_mixed(args, clients, options, requests, texts, source)
        return
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
                before = metrics(port, *COUNTED[:2])
                cpu0 = time.process_time()
                wall, lat = load(port, requests, c, options)
                modes[c].client_cpu.append((time.process_time() - cpu0) / len(requests))
                calls, requested = metrics(port, *COUNTED[:2]) - before
                merged = requested / max(calls, 1)
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
