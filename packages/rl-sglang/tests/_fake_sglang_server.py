"""A stand-in for an SGLang server's HTTP control surface (stdlib only), for tests that check
which server gets which call: ``python _fake_sglang_server.py PORT LOG``. Every request is
appended to LOG as ``[method, path, body]``; every call answers 200 ``{"success": true}``
(``/get_server_info``: a one-GPU server). ``python _fake_sglang_server.py PORT LOG FAIL_PATH``:
POSTs to FAIL_PATH answer 400 ``{"success": false}`` as SGLang does on a failed load."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, LOG = int(sys.argv[1]), sys.argv[2]
FAIL = sys.argv[3] if len(sys.argv) > 3 else None


class Handler(BaseHTTPRequestHandler):
    """Log the request, answer success."""

    def do_GET(self) -> None:
        """Health probes and server info."""
        self._log(None)
        self._reply({"tp_size": 1} if "server_info" in self.path else {"success": True})

    def do_POST(self) -> None:
        """Control calls."""
        n = int(self.headers.get("Content-Length") or 0)
        self._log(json.loads(self.rfile.read(n) or b"null"))
        if self.path == FAIL:
            self._reply({"success": False, "message": "Failed to get weights iterator"}, 400)
        else:
            self._reply({"success": True})

    def _log(self, body: object) -> None:
        with open(LOG, "a") as f:
            f.write(json.dumps([self.command, self.path, body]) + "\n")

    def _reply(self, body: object, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        """Quiet."""


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
