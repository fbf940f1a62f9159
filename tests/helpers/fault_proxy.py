"""A loopback HTTP proxy in front of an S3 server that injects one fault kind into chosen requests.

``with FaultProxy(upstream_url, Fault("reset_after", "PUT", r"/c\\.0$")) as proxy:`` then point
``s3_endpoint_url`` at ``proxy.url``. Every request is forwarded unchanged except those a
``Fault`` matches (HTTP method, a regex searched in the request's ``/bucket/key`` path, or in
each ``/bucket/key`` a ``DeleteObjects`` (``POST``) names; at most ``times`` hits per key), which
get the fault's kind:

=====================  =======================================================================
kind                   what the client sees (and whether the server applied the request)
=====================  =======================================================================
``reset_before``       connection reset, request never forwarded (not applied)
``reset_after``        forwarded (applied), then connection reset instead of the answer
``500_after``          forwarded (applied), then ``500 InternalError``
``slowdown``           ``503 SlowDown``, not forwarded
``conflict``           ``409 ConditionalRequestConflict``, not forwarded
``delay``              no answer for ``delay_s`` (past the client's timeout), then forwarded
``short_body``         forwarded; the answer's ``Content-Length`` is whole, its body half, then reset
``cut_body``           forwarded; the answer holds the first half of the body, its ``Content-Length`` says
                       so (a cut no length check sees: only a checksum or the reader's own sizes can)
``404``                ``404 NoSuchKey``, not forwarded
``denied``             ``403 AccessDenied`` (permanent), not forwarded
``refuse_delete``      a ``DeleteObjects`` answered ``400 MissingContentMD5``, not forwarded
``key_error``          in a ``DeleteObjects``: the matching keys are reported as errors (``code``), the
                       others deleted (the proxy deletes them one by one with its own client)
=====================  =======================================================================

``hits`` counts the faults injected per kind; ``requests`` logs every request as
``(method, key, fault kind or None)``.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import boto3

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
_ERRORS = {
    "500_after": (500, "InternalError", "We encountered an internal error. Please try again."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "conflict": (409, "ConditionalRequestConflict", "A conflicting conditional operation is in progress."),
    "404": (404, "NoSuchKey", "The specified key does not exist."),
    "denied": (403, "AccessDenied", "Access Denied"),
    "refuse_delete": (400, "MissingContentMD5", "Missing required header for this request: Content-MD5."),
}
_REQUEST_KINDS = ("reset_before", "reset_after", "500_after", "slowdown", "conflict", "delay", "short_body", "cut_body",
                  "404", "denied")
KINDS = (*_REQUEST_KINDS, "refuse_delete", "key_error")


@dataclass
class Fault:
    """Inject ``kind`` into requests of ``method`` whose object key matches ``key`` and whose query string matches
    ``query`` (``re.search``; the query tells a multipart upload's requests apart: ``uploads``, ``partNumber=2&...``,
    ``uploadId=...`` for the completion).

    ``times``: hits per key (None: every matching request). ``code``: the per-key error code of
    ``key_error``. ``delay_s``: how long ``delay`` holds the request.
    """

    kind: str
    method: str
    key: str = ""
    query: str = ""
    times: int | None = 1
    code: str = "InternalError"
    delay_s: float = 2.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {KINDS}")


def _deleted_keys(body: bytes) -> list[str]:
    """The object keys a ``DeleteObjects`` request body names."""
    return [el.text or "" for el in ET.fromstring(body).iter() if el.tag.endswith("Key")]


def _error_xml(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>proxy</RequestId></Error>").encode()


class FaultProxy:
    """See the module docstring. ``faults`` may be changed while the proxy runs (``add``, ``clear``)."""

    def __init__(self, upstream_url: str, *faults: Fault):
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname, parts.port)
        self.upstream_url = upstream_url
        self.faults = list(faults)
        self.hits: Counter[str] = Counter()
        self.requests: list[tuple[str, str, str | None]] = []
        self._seen: Counter[tuple[int, str]] = Counter()
        self._lock = threading.Lock()
        self._held = 0
        self._released = threading.Condition(self._lock)
        self._client = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FaultProxy":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def clear(self) -> None:
        """Stop injecting: every later request is forwarded unchanged."""
        with self._lock:
            self.faults.clear()

    def match(self, method: str, key: str, kinds: tuple[str, ...] | None = None, query: str = "") -> Fault | None:
        """The first fault that applies to this request (counting the hit), or None."""
        with self._lock:
            for i, fault in enumerate(self.faults):
                if (fault.method != method or not re.search(fault.key, key) or not re.search(fault.query, query)
                        or (kinds and fault.kind not in kinds)):
                    continue
                if fault.times is not None and self._seen[(i, key)] >= fault.times:
                    continue
                self._seen[(i, key)] += 1
                self.hits[fault.kind] += 1
                return fault
        return None

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until every request a ``delay`` fault held has been forwarded (the server's state is final)."""
        with self._released:
            if not self._released.wait_for(lambda: self._held == 0, timeout_s):
                raise TimeoutError(f"{self._held} held request(s) not forwarded after {timeout_s} s")

    def _hold(self, delta: int) -> None:
        with self._released:
            self._held += delta
            self._released.notify_all()

    def log(self, method: str, key: str, kind: str | None) -> None:
        with self._lock:
            self.requests.append((method, key, kind))

    def upstream_client(self):
        """A boto3 client of the upstream server (``key_error`` deletes the other keys with it)."""
        with self._lock:
            if self._client is None:
                self._client = boto3.client("s3", endpoint_url=self.upstream_url, region_name="us-east-1")
            return self._client

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path, _, query = self.path.partition("?")
                key = unquote(path)
                is_delete_objects = self.command == "POST" and "delete" in query.split("&")
                keys = [f"{key}/{k}" for k in _deleted_keys(body)] if is_delete_objects else [key]
                fault = next((f for k in keys if (f := proxy.match(self.command, k, _REQUEST_KINDS, query))), None)
                if fault is None and is_delete_objects:
                    return self._delete_objects(key, keys, body)
                proxy.log(self.command, key, fault and fault.kind)
                kind = fault.kind if fault else None
                if kind == "reset_before":
                    return self._reset()
                if kind in ("slowdown", "conflict", "404", "denied"):
                    return self._error(kind)
                if kind == "delay":
                    proxy._hold(1)
                    time.sleep(fault.delay_s)
                try:
                    status, headers, data = self._forward(body)
                finally:
                    if kind == "delay":
                        proxy._hold(-1)
                if kind == "reset_after":
                    return self._reset()
                if kind == "500_after":
                    return self._error(kind)
                self._reply(status, headers, data[: len(data) // 2] if kind == "cut_body" else data,
                            short=kind == "short_body")

            def _delete_objects(self, bucket_path: str, paths: list[str], body: bytes):
                """``DeleteObjects`` without a request-level fault: refused whole, per-key errors, or forwarded."""
                refused = any(proxy.match("POST", p, ("refuse_delete",)) for p in paths)
                failing = {} if refused else {p: f for p in paths if (f := proxy.match("POST", p, ("key_error",)))}
                proxy.log("POST", bucket_path, "refuse_delete" if refused else ("key_error" if failing else None))
                if refused:
                    return self._error("refuse_delete")
                if not failing:
                    return self._reply(*self._forward(body))
                bucket = bucket_path.strip("/").partition("/")[0]
                errors = []
                for p in paths:
                    k = p[len(bucket_path) + 1:]
                    if p in failing:
                        errors.append(f"<Error><Key>{k}</Key><Code>{failing[p].code}</Code>"
                                      f"<Message>injected</Message></Error>")
                    else:
                        proxy.upstream_client().delete_object(Bucket=bucket, Key=k)
                xml = ('<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult xmlns="http://s3.amazonaws.com/doc/'
                       f'2006-03-01/">{"".join(errors)}</DeleteResult>').encode()
                self._reply(200, [("Content-Type", "application/xml")], xml)

            def _forward(self, body: bytes):
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS | {"expect"}}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    drop = _HOP_HEADERS if self.command == "HEAD" else _HOP_HEADERS | {"content-length"}
                    return resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in drop], data
                finally:
                    conn.close()

            def _error(self, kind: str):
                status, code, message = _ERRORS[kind]
                self._reply(status, [("Content-Type", "application/xml")], _error_xml(code, message))

            def _reply(self, status, headers, data, short: bool = False):
                try:
                    self.send_response(status)
                    for k, v in headers:
                        self.send_header(k, v)
                    if self.command != "HEAD":
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data[: len(data) // 2] if short else data)
                    if short:
                        self.wfile.flush()
                        self._reset()
                except OSError:
                    self.close_connection = True  # the client gave up (a timeout): nobody to answer

            def _reset(self):
                """Close the connection with a TCP RST (SO_LINGER 0), no answer."""
                self.close_connection = True
                try:
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()  # the fd closes (RST) once the handler's files are closed
                except OSError:
                    pass

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
