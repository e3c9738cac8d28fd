"""Hostile requests while 64 clients load the server: every hostile request gets its refusal, the load keeps its
pace, and ``/health`` stays quick.

Run: ``./dev bench serve_hostile [--clients 64] [--seconds 40] [--rounds 3]``.

Starts ``layerwise serve`` (the embedded default model) as a subprocess, as ``benchmarks/serve_load.py`` does. Each
round has two phases of ``--seconds`` each, in turn: *load* (``--clients`` keep-alive clients sending 4 SST-2 sentences
a request to ``/v1/encode``) and *load + hostile* (the same, plus one more client sending the hostile requests of
issue #25 one after another, again and again, ``--pause`` seconds apart: 0 is a flood). During both, a prober
``GET``s ``/health`` every 50 ms on its own
connection. The hostile requests:

  layers x5000     ``{"texts": ["hi"], "layers": "all,all,...(5,000 times)"}`` (20 KB): froze the server 7.8 s
  huge answer      ``{"words": [[""] * 19999], "level": "word", "layers": "all", "combine": "concat"}``: a 215 MB body
  long prompt      a 100 KB ``prompt``: 20.7 s of compute
  abandoned        16 x 20,000-character texts, the connection closed right after sending (three in a row)
  probe path       ``GET /explorer/api/probe?path=/etc``
  4 MiB ids        (``--set all``) ``/v1/embeddings`` with token ids just under ``--max-body-bytes`` (parsing)
  garbage          (``--set all``) 4 MiB of invalid JSON

Reported: each hostile request's status and time, the load's texts/s in both phases (and their ratio), the load's
p50/p99 latency, and ``/health`` p50/p99/max per phase. The bound of issue #25 is ``/health`` p99 < 100 ms with the
hostile requests running. Writes ``benchmarks/results/serve_hostile.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.serve_load import _head, free_port, load_sentences, start_server

RESULTS = Path(__file__).parent / "results" / "serve_hostile.json"


def hostile_requests(port: int, which: str = "issue") -> list[tuple[str, bytes, bool]]:
    """(name, raw HTTP request, close the connection right after sending): the repros of issue #25 (``issue``), or
    those and two 4 MiB bodies (``all``)."""
    def post(path: str, body: bytes) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    long_text = "word " * 4000
    row = b"[" + b", ".join([b"1012"] * 1000) + b"]"  # 6,000 bytes: a list of 1,000 token ids
    n = ((4 << 20) - 10_000) // (len(row) + 2)
    ids = b'{"model": "all-MiniLM-L6-v2", "input": [' + b", ".join([row] * n) + b"]}"  # just under 4 MiB
    out = [
        ("layers x5000", post("/v1/encode", json.dumps({"texts": ["hi"], "layers": ",".join(["all"] * 5000)}).encode()),
         False),
        ("huge answer", post("/v1/encode", json.dumps({"words": [[""] * 19999], "level": "word", "layers": "all",
                                                       "combine": "concat"}).encode()), False),
        ("long prompt", post("/v1/encode", json.dumps({"texts": ["hi"], "prompt": "x " * 50_000}).encode()), False),
    ]
    out += [(f"abandoned {i}", post("/v1/encode", json.dumps({"texts": [long_text] * 16}).encode()), True)
            for i in range(3)]
    out += [
        ("probe path", f"GET /explorer/api/probe?path=/etc HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(), False),
    ]
    if which == "all":
        out += [("4 MiB ids", post("/v1/embeddings", ids), False),
                ("garbage", post("/v1/encode", b"{" * ((4 << 20) - 100)), False)]
    return out


async def exchange(port: int, wire: bytes, close: bool) -> tuple[int, float]:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(wire)
        await writer.drain()
        if close:
            return 0, time.perf_counter() - t0
        status, length = _head(await reader.readuntil(b"\r\n\r\n"))
        await reader.readexactly(length)
        return status, time.perf_counter() - t0
    finally:
        writer.close()


def run_phase(port: int, sentences: list[str], clients: int, seconds: float, hostile: bool, pause: float = 0.0,
              which: str = "issue") -> dict:
    head = f"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    rng = random.Random(0)
    health: list[float] = []
    load_lat: list[float] = []
    hostile_log: list[dict] = []
    texts_done = [0]
    refused: dict[int, int] = {}  # the load's own requests answered with another status than 200
    stop = threading.Event()

    def prober() -> None:  # its own thread and connection: what a load balancer's health check sees
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while not stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            health.append(time.perf_counter() - t0)
            time.sleep(0.05)
        conn.close()

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not stop.is_set():
                texts = rng.sample(sentences, 4)
                body = json.dumps({"texts": texts, "encoding": "base64"}).encode()
                t0 = time.perf_counter()
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                status, length = _head(await reader.readuntil(b"\r\n\r\n"))
                await reader.readexactly(length)
                if status == 200:
                    texts_done[0] += 4
                    load_lat.append(time.perf_counter() - t0)
                else:
                    refused[status] = refused.get(status, 0) + 1
        finally:
            writer.close()

    async def attacker() -> None:
        reqs = hostile_requests(port, which)
        while not stop.is_set():
            for name, wire, close in reqs:
                if stop.is_set():
                    break
                status, took = await exchange(port, wire, close)
                hostile_log.append({"request": name, "status": status, "s": round(took, 3)})
                await asyncio.sleep(pause)

    async def main() -> float:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        if hostile:
            tasks.append(asyncio.create_task(attacker()))
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return time.perf_counter() - t0

    probe = threading.Thread(target=prober, daemon=True)
    probe.start()
    wall = asyncio.run(main())
    probe.join()
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1000, 1) if xs else None  # noqa: E731
    return {"texts_per_s": round(texts_done[0] / wall, 1), "load_p50_ms": ms(load_lat, 50),
            "load_p99_ms": ms(load_lat, 99), "health_p50_ms": ms(health, 50), "health_p99_ms": ms(health, 99),
            "health_max_ms": round(max(health) * 1000, 1) if health else None, "health_probes": len(health),
            "load_refused": {str(k): v for k, v in refused.items()}, "hostile": hostile_log}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", default="issue", choices=["issue", "all"],
                    help="issue: the repros of issue #25; all: also a 4 MiB body of token ids and 4 MiB of bad JSON")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between two hostile requests (0: a flood, one right after another)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None)
    args = ap.parse_args(argv)
    sentences, source = load_sentences(2000)
    port = free_port()
    proc = start_server(args, port)
    try:
        run_phase(port, sentences, args.clients, 5, False)  # warm-up
        rounds = []
        for r in range(args.rounds):
            quiet = run_phase(port, sentences, args.clients, args.seconds, False)
            loud = run_phase(port, sentences, args.clients, args.seconds, True, args.pause, args.set)
            rounds.append({"load": quiet, "load+hostile": loud})
            print(f"round {r + 1}: load {quiet['texts_per_s']} texts/s, health p99 {quiet['health_p99_ms']} ms | "
                  f"+hostile {loud['texts_per_s']} texts/s, health p50 {loud['health_p50_ms']} p99 "
                  f"{loud['health_p99_ms']} max {loud['health_max_ms']} ms, {len(loud['hostile'])} hostile requests; "
                  f"load refused {quiet['load_refused']} | {loud['load_refused']}",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    loud_all = [x for r in rounds for x in r["load+hostile"]["hostile"]]
    by_name: dict[str, dict] = {}
    for h in loud_all:
        d = by_name.setdefault(h["request"], {"statuses": set(), "s": []})
        d["statuses"].add(h["status"])
        d["s"].append(h["s"])
    summary = {name: {"statuses": sorted(d["statuses"]), "max_s": max(d["s"]), "n": len(d["s"])}
               for name, d in by_name.items()}
    for name, d in summary.items():
        print(f"  {name:14s} status {d['statuses']}  x{d['n']}  slowest {d['max_s']:.2f} s")
    worst = max(r["load+hostile"]["health_p99_ms"] for r in rounds)
    ratio = float(np.median([r["load+hostile"]["texts_per_s"] / r["load"]["texts_per_s"] for r in rounds]))
    print(f"/health p99 with hostile requests, worst round: {worst} ms (bound 100 ms); load kept {ratio:.2f}x of "
          f"its pace")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs", "clients": args.clients, "seconds": args.seconds, "pause": args.pause,
           "set": args.set, "sentences": source,
           "rounds": [{k: {kk: vv for kk, vv in v.items() if kk != "hostile"} for k, v in r.items()} for r in rounds],
           "hostile": summary, "health_p99_ms_worst": worst, "load_kept": round(ratio, 3)}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
