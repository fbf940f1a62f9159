"""A loopback HTTP proxy in front of the moto S3 server that throttles chunk reads.

The first GET of every chunk object (a key ending in ``/c.0``) is answered ``503 SlowDown``
the way S3 throttles; every other request, and every later GET of that key, is forwarded
to moto unchanged. ``failures`` counts the 503s sent.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class SlowDownProxy:
    """``with SlowDownProxy(moto_url) as proxy:`` then point ``s3_endpoint_url`` at ``proxy.url``."""

    def __init__(self, upstream_url: str):
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname, parts.port)
        self.failures = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "SlowDownProxy":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def throttle(self, method: str, path: str) -> bool:
        """Whether to answer this request with 503 SlowDown (the first GET of each chunk key)."""
        key = path.split("?", 1)[0]
        if method != "GET" or not key.endswith("/c.0"):
            return False
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            self.failures += 1
            return True

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.throttle(self.command, self.path):
                    return self._reply(503, [("Content-Type", "application/xml")], _SLOWDOWN)
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS | {"expect"}}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    drop = _HOP_HEADERS if self.command == "HEAD" else _HOP_HEADERS | {"content-length"}
                    self._reply(resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in drop], data)
                finally:
                    conn.close()

            def _reply(self, status, headers, data):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
