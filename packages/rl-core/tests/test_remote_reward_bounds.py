"""Bounds on a remote reward call: a total deadline per attempt (not a per-read timeout) and a
cap on the answer's size (issue 31)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_core.errors import ConfigError, RewardError
from rl_core.rewards.remote import RemoteReward
from rl_core.types import Prompt

_SENT: dict[str, int] = {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if self.path == "/trickle":  # a byte every 1.5 s: each read is quick
                body = b'{"reward": 1.0}' + b" " * 64
                self._head(len(body))
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(1.5)
            elif self.path in ("/huge", "/huge-chunked"):  # 400 MiB, sent lazily
                total, block = 400 * 1024 * 1024, b" " * (1024 * 1024)
                self._head(None if self.path == "/huge-chunked" else total)
                sent = 0
                while sent < total:
                    data = block if self.path == "/huge" else _chunk(block)
                    self.wfile.write(data)
                    sent += len(block)
                    _SENT[self.path] = sent
            else:
                body = b'{"reward": 0.5}'
                self._head(len(body))
                self.wfile.write(body)

    def _head(self, length: int | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.flush()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _call(url: str, **kw) -> dict[str, float]:
    reward = RemoteReward(RemoteReward.Config(url=url, max_retries=0, **kw))
    return asyncio.run(reward(Prompt(uid="p0", input="q", token_ids=(1,), label="a"), "x", None))


def test_deadline_is_total_not_per_read(server):
    """A server sending a byte every 1.5 s never lets one read wait 2 s; the 2 s deadline on
    the whole answer still ends the call in about 2 s (it took 13.5 s with a per-read
    timeout)."""
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"failed after 1 attempts.*2\.0 s deadline"):
        _call(f"{server}/trickle", timeout_seconds=2.0)
    took = time.monotonic() - t0
    assert 1.9 <= took < 3.2, took
    assert _call(f"{server}/ok", timeout_seconds=2.0) == {"reward": 0.5}


def test_huge_answer_refused_without_reading_it(server):
    """A 400 MiB answer: refused from its Content-Length before the body is read, and a
    chunked one (no length) after at most the cap; neither is retried."""
    with pytest.raises(RewardError, match=r"419430400 bytes.*max_response_bytes = 16777216"):
        _call(f"{server}/huge", timeout_seconds=20.0)
    with pytest.raises(RewardError, match=r"passed reward.max_response_bytes = 1048576"):
        _call(f"{server}/huge-chunked", timeout_seconds=20.0, max_response_bytes=1024 * 1024)
    time.sleep(0.2)
    # The server stopped being read long before the end (the socket buffers hold a few MiB).
    assert _SENT.get("/huge-chunked", 0) < 64 * 1024 * 1024


def test_size_cap_config_error():
    with pytest.raises(ConfigError, match="reward.max_response_bytes"):
        RemoteReward.Config(url="http://127.0.0.1:1/", max_response_bytes=0)
