"""Connection limits of the service as ``layerwise serve`` runs it (:func:`layerwise.serve.server`, here in a
thread), with raw sockets: an idle connection, a slow request head and a slow body are closed within their timeouts
(and not before), a kept-alive connection is closed after ``--keep-alive-timeout``, a connection past
``--max-connections`` is answered 503 while the open ones are still served, and a normal request works. Bad values
are refused naming the flag.

Bounds are generous (CI has 2 slow cores): a close is expected after at least half its timeout and within the
timeout plus :data:`SLACK` seconds.
"""

from __future__ import annotations

import json
import re
import select
import socket
import time
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from layerwise.cli.main import app
from layerwise.serve import ConnectionLimits
from layerwise.serve.connections import LimitedH11

from tiny import serve_in_thread

HEAD, BODY, KEEP, CAP = 2.0, 2.0, 2.0, 3  # seconds, seconds, seconds, connections
SLACK = 5.0


@pytest.fixture(scope="module")
def server(tiny_dirs):
    """The service on the tiny BERT with short timeouts and a cap of CAP connections (``--header-timeout 2
    --body-timeout 2 --keep-alive-timeout 2 --max-connections 3``), served in a thread: ``(host, port)``."""
    import layerwise as lw
    from layerwise.serve import create_app

    limits = ConnectionLimits(header_timeout=HEAD, body_timeout=BODY, keep_alive_timeout=KEEP, max_connections=CAP)
    with serve_in_thread(create_app(lw.Extractor(str(tiny_dirs["bert"]), device="cpu")), limits) as url:
        parsed = urlparse(url)
        yield parsed.hostname, parsed.port


def connect(server) -> socket.socket:
    sock = socket.create_connection(server, timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def until_closed(sock: socket.socket, limit: float = HEAD + BODY + SLACK) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took (``limit`` at most)."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit} s (got {got!r})")
    return got, time.monotonic() - start


def trickle(sock: socket.socket, data: bytes, every: float = 0.25, limit: float = HEAD + BODY + SLACK
            ) -> tuple[bytes, float]:
    """Send ``data`` a byte every ``every`` seconds until the server answers or closes; what it sent and when."""
    start = time.monotonic()
    for i in range(len(data)):
        try:
            sock.sendall(data[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        if select.select([sock], [], [], every)[0]:
            break
        assert time.monotonic() - start < limit, f"still open after {limit} s of trickling"
    got, _ = until_closed(sock, limit)
    return got, time.monotonic() - start


def get_health(sock: socket.socket) -> bytes:
    """One complete ``GET /health`` on ``sock`` (kept alive); the response's bytes."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return read_response(sock)


def read_response(sock: socket.socket) -> bytes:
    got = b""
    sock.settimeout(30)
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.lower().split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_normal_request_is_answered(server):
    with connect(server) as sock:
        body = json.dumps({"texts": ["I love Paris"], "layers": -1, "pool": "mean"}).encode()
        sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert len(json.loads(answer.partition(b"\r\n\r\n")[2])["vectors"][0]) == 32


def test_an_idle_connection_is_closed_within_the_header_timeout(server):
    with connect(server) as sock:
        got, took = until_closed(sock)
    assert got == b""  # nothing of a request came: closed without an answer
    assert HEAD / 2 <= took <= HEAD + SLACK, took


def test_a_slow_request_head_is_closed_with_408(server):
    with connect(server) as sock:
        got, took = trickle(sock, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: y\r\n" * 100)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert HEAD / 2 <= took <= HEAD + SLACK, took


def test_a_slow_body_is_closed_with_408(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        got, took = trickle(sock, b'{"texts": ["' + b"a" * 990)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert BODY / 2 <= took <= BODY + SLACK, took


def test_a_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    with connect(server) as sock:
        assert get_health(sock).startswith(b"HTTP/1.1 200")
        assert get_health(sock).startswith(b"HTTP/1.1 200")  # kept alive: a second request on it
        got, took = until_closed(sock)
    assert got == b""
    assert KEEP / 2 <= took <= KEEP + SLACK, took


def test_a_slow_head_after_keep_alive_is_closed_by_the_header_timeout(server):
    with connect(server) as sock:
        assert get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(KEEP / 2)
        got, took = trickle(sock, b"GET /health HTTP/1.1\r\n" + b"X-Slow: y\r\n" * 100)  # first byte: keep-alive ends
    assert got.startswith(b"HTTP/1.1 408"), got
    assert HEAD / 2 <= took <= HEAD + SLACK, took


def test_a_connection_past_the_cap_gets_503_and_the_open_ones_are_served(server):
    """Past the cap, a request is answered 503 at once (not by the header timeout), but for the orchestrator's probes:
    GET /health and /ready are answered on the probe slots (200 at the cap); past those, 503 on connecting."""
    from layerwise.serve.connections import PROBE_SLOTS

    held = [connect(server) for _ in range(CAP)]
    probes = []
    try:
        for sock in held:  # each has begun a request: in its head phase, well within the header timeout
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.2)  # the server has accepted them all
        with connect(server) as extra:
            extra.sendall(b"POST /v1/encode HTTP/1.1\r\n")
            got, took = until_closed(extra)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), got
        assert f"content-length: {len(body)}".encode() in head and b"connections" in body, got
        assert took < HEAD / 2, took  # refused at once, not by the header timeout
        with connect(server) as probe:  # a liveness probe at the cap
            probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert read_response(probe).startswith(b"HTTP/1.1 200")
        probes = [connect(server) for _ in range(PROBE_SLOTS)]  # every probe slot taken, idle
        time.sleep(0.2)
        with connect(server) as beyond:
            got, took = until_closed(beyond)
        assert got.startswith(b"HTTP/1.1 503") and took < HEAD / 2, (got, took)
        for sock in held:
            sock.sendall(b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held + probes:
            sock.close()


@pytest.mark.parametrize("flag, value", [("--header-timeout", "0"), ("--body-timeout", "-1"),
                                         ("--keep-alive-timeout", "7200"), ("--max-connections", "0")])
def test_bad_values_are_refused_naming_the_flag(flag, value):
    res = CliRunner().invoke(app, ["serve", flag, value], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert flag in res.output and "error:" in res.output, res.output


def test_serve_hands_uvicorn_the_limited_protocol(monkeypatch):
    from fastapi import FastAPI

    from layerwise.serve import server

    limits = ConnectionLimits(header_timeout=3, max_connections=7)
    http = server(FastAPI(), connections=limits).config.http  # an app is served as given
    assert issubclass(http, LimitedH11) and http.limits == limits
    assert server(FastAPI()).config.http.limits == ConnectionLimits()  # the defaults
    ran = []
    monkeypatch.setattr("uvicorn.Server.run", lambda self: ran.append(self.config.http.limits))
    from layerwise.serve import serve

    serve(FastAPI(), connections=limits)  # `layerwise serve` runs that server
    assert ran == [limits]


def test_refusals_on_the_connection_are_counted(server):
    """503 past the cap, 408 on a deadline and h11's 400 are answered below the app: the metrics count them too."""

    def counted(status: int) -> float:
        with connect(server) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            text = until_closed(sock)[0].decode()
        pattern = rf'^layerwise_requests_total{{route="connection",status="{status}"}} (\S+)$'
        return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))

    before = {status: counted(status) for status in (400, 408, 503)}
    with connect(server) as sock:  # a request line that does not parse
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert until_closed(sock)[0].startswith(b"HTTP/1.1 400")
    with connect(server) as sock:  # a head that never ends
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        assert until_closed(sock)[0].startswith(b"HTTP/1.1 408")
    held = [connect(server) for _ in range(CAP)]
    try:
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.2)
        with connect(server) as extra:  # past the cap, not a probe
            extra.sendall(b"GET /v1/model HTTP/1.1\r\n")
            assert until_closed(extra)[0].startswith(b"HTTP/1.1 503")
        for sock in held:  # the server closes its end once it has let the connection go: below the cap again
            sock.shutdown(socket.SHUT_WR)
            until_closed(sock)
    finally:
        for sock in held:
            sock.close()
    assert {status: counted(status) - before[status] for status in before} == {400: 1, 408: 1, 503: 1}
