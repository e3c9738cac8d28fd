"""The service's memory ceilings (:mod:`layerwise.serve.ceilings`): clients that never read their answers are
dropped within ``--send-timeout`` and their answers' memory is bounded by ``--max-unsent-bytes`` (a real server
subprocess, raw sockets with small receive buffers); a slow reader that keeps reading is served; a request over
``--max-memory`` is shed with 503 and ``Retry-After`` while ``/health`` stays 200; the counts are in ``/metrics``.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from urllib.parse import urlparse

import pytest
from fastapi.testclient import TestClient

import layerwise as lw
from layerwise.errors import LayerwiseError, ServiceError
from layerwise.serve import Limits, create_app
from layerwise.serve.ceilings import Ceilings, resident_bytes

from tiny import serving, wait_until

SEND = 2.0  # --send-timeout
SLACK = 8.0  # CI's slow cores
UNSENT = 30_000_000  # --max-unsent-bytes
TEXT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3  # > 64 tokens: truncated


def big_request(host: str, texts: int = 100, close: bool = False) -> bytes:
    """A request whose JSON answer is ~12 MB (token level, every layer of the tiny model, truncated texts)."""
    body = json.dumps({"texts": [TEXT] * texts, "level": "token", "layers": "all", "truncate": True}).encode()
    return (f"POST /v1/encode HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, flags=re.MULTILINE))


def non_reader(address: tuple[str, int]) -> socket.socket:
    """A connection that will read nothing: a receive buffer of a few kB, so the server's send buffer fills."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    return sock


def drain(sock: socket.socket, limit: float) -> tuple[bytes, bool]:
    """Everything left on ``sock`` until it closes (``limit`` seconds at most): (bytes, closed by the server)."""
    got = b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(1 << 20):
            got += chunk
        return got, True
    except ConnectionResetError:
        return got, True
    except TimeoutError:
        return got, False


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("ceilings") / "server.log"
    # keep-alive shorter than the send timeout: uvicorn closes a connection after its answer was handed over, and a
    # closing connection that still holds its answer must be counted and dropped all the same
    with serving(tiny_dirs["bert"], log, "--send-timeout", str(SEND), "--max-response-bytes", "15000000",
                 "--max-unsent-bytes", str(UNSENT), "--keep-alive-timeout", "0.5") as url:
        yield url


def test_clients_that_never_read_are_dropped_and_their_answers_bounded(server):
    parsed = urlparse(server)
    address = (parsed.hostname, parsed.port)
    with socket.create_connection(address, timeout=60) as sock:  # one answer read whole: first-use memory counted
        sock.sendall(big_request(parsed.netloc, close=True))
        assert drain(sock, 60)[0].startswith(b"HTTP/1.1 200")
    before = metric(server, "layerwise_resident_bytes")
    answered = metric(server, "layerwise_requests_total")
    socks = [non_reader(address) for _ in range(6)]
    for sock in socks:
        sock.sendall(big_request(parsed.netloc))
    # the six answered (the two scrapes above count too)
    wait_until(lambda: metric(server, "layerwise_requests_total") >= answered + 2 + len(socks), 120,
               "the six requests answered", interval=0.2)
    held = metric(server, "layerwise_unsent_answer_bytes")  # the answers wait in the send buffers, unread
    grown = metric(server, "layerwise_resident_bytes") - before
    assert 0 < held <= UNSENT, f"{held:,.0f} bytes of answers held (--max-unsent-bytes {UNSENT:,})"
    assert grown < UNSENT + 100e6, f"the server grew {grown / 1e6:,.0f} MB for answers nobody reads"

    def dropped() -> bool:  # each of the six shed at admission or dropped by the send timeout, no answer held
        gone = metric(server, "layerwise_send_timeouts_total") + metric(server, "layerwise_shed_total")
        return gone >= len(socks) and metric(server, "layerwise_unsent_answer_bytes") == 0

    # past the send timeout the admitted ones are dropped, unread
    wait_until(dropped, SEND + SLACK, "the unread answers dropped", interval=0.2)
    statuses = []
    for sock in socks:
        got, closed = drain(sock, SLACK)
        head, _, body = got.partition(b"\r\n\r\n")
        statuses.append(int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None)
        length = re.search(rb"content-length: (\d+)", head.lower())
        if statuses[-1] != 503:  # dropped: the answer never arrived whole
            assert closed and (length is None or len(body) < int(length.group(1))), (statuses[-1], len(got))
        sock.close()
    assert statuses.count(503) >= 1 and statuses.count(503) < len(socks), statuses  # the rest shed at the budget
    assert metric(server, "layerwise_send_timeouts_total") >= len(socks) - statuses.count(503)
    assert metric(server, "layerwise_shed_total") >= statuses.count(503)
    assert metric(server, "layerwise_unsent_answer_bytes") == 0  # every dropped answer's memory is released


def test_a_slow_reader_that_keeps_reading_is_served(server):
    parsed = urlparse(server)
    sock = non_reader((parsed.hostname, parsed.port))
    sock.sendall(big_request(parsed.netloc, texts=4))  # ~0.5 MB
    got, start, length = b"", time.monotonic(), None
    sock.settimeout(30)
    while length is None or len(got) < length:
        time.sleep(SEND / 2)  # reads 48 kB well within every send timeout, for longer than one in all
        tick = b""
        while len(tick) < 48 << 10:
            chunk = sock.recv((48 << 10) - len(tick))
            assert chunk, f"closed after {len(got) + len(tick):,} bytes"
            tick += chunk
            if length is not None and len(got) + len(tick) >= length:
                break
        got += tick
        head, sep, _ = got.partition(b"\r\n\r\n")
        found = re.search(rb"content-length: (\d+)", head.lower()) if sep else None
        if found:
            length = len(head) + 4 + int(found.group(1))
    sock.close()
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert time.monotonic() - start > 2 * SEND, "the answer was read in under two send timeouts: nothing was tested"
    assert len(json.loads(got.partition(b"\r\n\r\n")[2])["vectors"]) == 4


def test_a_request_past_the_memory_ceiling_is_shed_and_health_stays_up(tiny_dirs):
    ex = lw.Extractor(model=str(tiny_dirs["bert"]))
    app = create_app(ex, Limits(max_memory=2 ** 20))  # 1 MiB: below what the process holds already
    with TestClient(app) as client:
        got = client.post("/v1/encode", json={"texts": ["hello world"]})
        assert got.status_code == 503, got.text
        assert got.headers["retry-after"] == "1"
        assert "memory ceiling" in got.json()["detail"] and "max_memory" in got.json()["detail"]
        openai = client.post("/v1/embeddings", json={"input": "hello", "model": "bert"})
        assert openai.status_code == 503 and openai.json()["error"]["code"] == "overloaded"
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        assert re.search(r'^layerwise_shed_total\{reason="memory"\} 2\.0$', metrics, flags=re.MULTILINE), metrics
    app = create_app(ex, Limits(max_memory=0))  # 0: no ceiling
    with TestClient(app) as client:
        assert client.post("/v1/encode", json={"texts": ["hello world"]}).status_code == 200


def test_the_answer_budget_counts_admitted_answers_until_released():
    shed: list[str] = []
    ceilings = Ceilings(max_memory=0, max_unsent_bytes=1000, shed=shed.append)
    first = ceilings.admit(600)
    with pytest.raises(ServiceError) as refused:
        ceilings.admit(600)
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert "max_unsent_bytes" in refused.value.detail and shed == ["answers"]
    first.release()
    first.release()  # idempotent
    assert ceilings.unsent() == 0
    ceilings.admit(1000).release()
    assert Ceilings(max_memory=None).max_memory > resident_bytes()  # the default: what it holds plus a share


def test_limits_refuse_an_answer_budget_below_the_largest_answer():
    with pytest.raises(LayerwiseError, match="max-unsent-bytes"):
        Limits(max_response_bytes=64 << 20, max_unsent_bytes=1 << 20)
    with pytest.raises(Exception, match="max-memory"):
        Limits(max_memory="lots")
