"""Slow clients cannot hold connections: trickled request headers are dropped after keepalive_timeout,
a body that does not arrive within body_timeout gets 408, and the server keeps serving meanwhile."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import ServerThread, http, tiny_config


@pytest.fixture(scope="module")
def impatient(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(tiny_config(tiny_llama_dir, keepalive_timeout=0.5, body_timeout=0.5)).start()
    yield srv
    srv.stop()


def _connect(srv: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def test_trickled_headers_are_dropped(impatient: ServerThread) -> None:
    socks = [_connect(impatient) for _ in range(200)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")        # and never the rest
    t0 = time.monotonic()
    closed = [_read_all(s) for s in socks]                  # each returns when the server closes it
    assert all(c == b"" for c in closed)                    # closed without an answer: nothing was asked
    assert time.monotonic() - t0 < 9                        # (the recv timeout is 10 s: none hit it)
    for s in socks:
        s.close()
    assert http("POST", f"{impatient.url}/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_a_body_that_never_arrives_gets_408(impatient: ServerThread) -> None:
    s = _connect(impatient)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\":")
    answer = b""
    while b"}}" not in answer:                              # the end of the error body
        answer += s.recv(65536)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"body_timeout"' in answer.replace(b" ", b"")
