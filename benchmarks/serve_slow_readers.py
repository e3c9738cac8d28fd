"""Clients that never read: what do they cost the server?

Run: ``./dev bench serve_slow_readers [--clients 15] [--texts 20] [--send-timeout 30]``.

Starts ``layerwise serve`` (the default model, its default limits: ``--max-response-bytes`` 64 MiB,
``--max-unsent-bytes`` 128 MiB, ``--send-timeout`` 30 s unless given) as a subprocess. One client first asks for a
token-level answer of every layer (about 64 MB of JSON, just under ``--max-response-bytes``) and reads it whole, so
the server's first-use memory is counted before the measure. Then ``--clients`` connections (receive buffers of 4 kB)
each ask for the same answer and read nothing. Sampled every second: the server's resident memory (it and its
children). Reported: the memory before, the most while the clients hang and after, what they added (the issue's
ceiling: < 200 MB for 15), how many were answered (the rest shed with 503 at ``--max-unsent-bytes``), and when each
answered connection was dropped by the server (within the send timeout of its answer). Results:
``benchmarks/results/serve_slow_readers.json``.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

from benchmarks.serve_load import commit, free_port, get, machine, stop_server
from benchmarks.serve_soak import tree_rss

RESULT = Path(__file__).resolve().parent / "results" / "serve_slow_readers.json"
TEXT = ("a quiet , charming and often very funny film about a family that gathers for one long weekend in the "
        "country , where old stories come back and nobody says what they mean until the very last scene , which "
        "is worth the wait and the price of the ticket . ")


ESTABLISHED = 1  # tcpi_state of Linux's struct tcp_info


def tcp_state(sock: socket.socket) -> int:
    """The connection's TCP state (the first byte of ``TCP_INFO``): 1 while established, other once the server has
    closed or reset it, whatever is left unread in the receive buffer."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def request(port: int, texts: int, close: bool = False) -> bytes:
    body = json.dumps({"texts": [TEXT] * texts, "level": "token", "layers": "all"}).encode()
    return (f"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}Content-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=15)
    ap.add_argument("--texts", type=int, default=20, help="texts per request (20: an answer of about 64 MB)")
    ap.add_argument("--send-timeout", type=float, default=None, help="the server's --send-timeout (default: its own)")
    ap.add_argument("--server-flag", action="append", default=[], help="more flags for the server, e.g. "
                    "--server-flag=--max-unsent-bytes=67108864")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    port = free_port()
    proc = _start(args, port)
    send_timeout = args.send_timeout or 30.0
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
            sock.sendall(request(port, args.texts, close=True))
            first = b""
            while chunk := sock.recv(1 << 20):
                first += chunk
        if not first.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the first answer failed: {first[:300]!r}")
        answer_mb = len(first) / 1e6
        time.sleep(2)
        before = tree_rss(proc.pid)
        socks = []
        for _ in range(args.clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(request(port, args.texts))
            sock.setblocking(False)
            socks.append(sock)
        t0 = time.monotonic()
        peak, samples = before, []
        dropped: dict[int, float] = {}
        deadline = t0 + send_timeout + 180
        while time.monotonic() < deadline and len(dropped) < len(socks):
            time.sleep(1.0)
            rss = tree_rss(proc.pid)
            peak = max(peak, rss)
            samples.append([round(time.monotonic() - t0), round(rss)])
            for k, sock in enumerate(socks):  # the connection's TCP state, read without reading a byte
                if k not in dropped and tcp_state(sock) != ESTABLISHED:
                    dropped[k] = time.monotonic() - t0
        statuses = []
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(5)
            try:
                head = sock.recv(64)
                statuses.append(int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None)
            except OSError:
                statuses.append(None)  # reset before any byte could be read: dropped
            sock.close()
        after = tree_rss(proc.pid)
        text = get(port, "/metrics")[1].decode()
    finally:
        stop_server(proc)
    timeouts = [line for line in text.splitlines() if line.startswith("layerwise_send_timeouts_total")]
    result = {
        "benchmark": "serve_slow_readers", "date": time.strftime("%Y-%m-%d"), "machine": machine(args.device),
        "commit": commit(), "server_flags": args.server_flag, "clients": args.clients,
        "answer_mb": round(answer_mb, 1), "send_timeout_s": send_timeout,
        "rss_mb": {"before": round(before), "peak_while_hanging": round(peak), "after": round(after)},
        "added_mb": round(peak - before), "answered_200": statuses.count(200), "shed_503": statuses.count(503),
        "dropped_after_s": sorted(round(v, 1) for v in dropped.values()),
        "send_timeouts_metric": timeouts, "samples": samples,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


def _start(args, port: int):
    """``layerwise serve`` on ``port`` (``--send-timeout`` where given), once ``/health`` answers."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "layerwise.cli.main", "serve", "--port", str(port), "--log-level", "warning",
           "--device", args.device]
    if args.send_timeout is not None:
        cmd += ["--send-timeout", str(args.send_timeout)]
    cmd += args.server_flag
    if args.model != "default":
        cmd += ["--model", args.model]
    if args.backend:
        cmd += ["--backend", args.backend]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for _ in range(1500):
        try:
            if get(port, "/health")[0] == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become healthy")


if __name__ == "__main__":
    main()
