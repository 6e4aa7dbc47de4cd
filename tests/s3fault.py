"""A faulty network path to the S3-compatible server, for the object-store fault tests: an HTTP
proxy on 127.0.0.1 that passes requests through to S3Proxy unchanged (the SigV4 signature covers
the Host header the client sent, which is passed on as it is) or answers some of them itself as a
throttling or failing S3 would: ``503 SlowDown``, ``500 InternalError``.

``policy(method, path, n)`` decides for the n-th request (from 1): ``None`` passes it through, a
status code is answered with S3's error body for it, ``0`` cuts the connection without an answer
(the request never reaches the store), as a load balancer's reset or a network blip does. A negative one, ``-500``, is the ambiguous
answer: the request goes through to the store (a PUT lands) and the client gets the error instead
of the store's answer, as when a load balancer or the network loses the reply.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from s3server import S3Server

Policy = Callable[[str, str, int], int | None]

_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    403: ("AccessDenied", "Access Denied"),  # a bucket policy refusing a key: not retried by any client
}


def passthrough(method: str, path: str, n: int) -> int | None:
    return None


@dataclass
class FaultProxy:
    """The proxy in front of ``target``; :meth:`stop` ends it."""

    target: S3Server
    policy: Policy = passthrough
    # The policy sees only requests whose User-Agent holds this ("": every request): "aws-sdk-java"
    # is Hadoop's s3a in Apache Spark's JVM, not the driver's Python clients (pyarrow, delta-rs).
    agent: str = ""
    requests: int = 0
    faults: int = 0
    # (User-Agent, method, path, the policy's answer) of every request since :meth:`reset`.
    seen: list[tuple[str, str, str, int | None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The headers and the body go out in two writes: with Nagle's algorithm the body waits
            # for the client's delayed ACK of the headers (about 40 ms a request).
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = self._chunked()
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else b""
                agent = self.headers.get("User-Agent") or ""
                with proxy._lock:
                    proxy.requests += 1
                    n = proxy.requests
                status = proxy.policy(self.command, self.path, n) if proxy.agent in agent else None
                with proxy._lock:
                    proxy.seen.append((agent, self.command, self.path, status))
                    if status is not None:
                        proxy.faults += 1
                if status is not None:
                    if status == 0:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if status > 0:
                        self._error(status, n)
                        return
                self._forward(body, status, n)

            def _error(self, status: int, n: int) -> None:
                code, message = _ERRORS.get(status, ("ServiceUnavailable", "Unavailable."))
                payload = (
                    f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>fault-{n}</RequestId></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _forward(self, body: bytes, status: int | None, n: int) -> None:
                """The request to the store; its answer to the client, or (``status`` < 0) the error."""
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.target.port, timeout=60)
                try:
                    hop = ("connection", "keep-alive", "transfer-encoding", "content-length")
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                    if body or self.command in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                    if status is not None:
                        self._error(-status, n)
                        return
                    self.send_response(reply.status, reply.reason)
                    for k, v in reply.getheaders():
                        if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                            self.send_header(k, v)
                    # a HEAD's length is the object's, not its (empty) body's
                    length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            def _chunked(self) -> bytes:
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # type: ignore[method-assign] # a client gone (killed)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def reset(self) -> None:
        """Every request passed through again, from every client; :attr:`seen` emptied."""
        with self._lock:
            self.policy, self.agent = passthrough, ""
            self.seen.clear()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def env(self) -> dict[str, str]:
        """The target's client variables, with this proxy as the endpoint."""
        return {**self.target.env, "AWS_ENDPOINT_URL": self.endpoint}

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
