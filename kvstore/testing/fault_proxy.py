"""A loopback HTTP/1.1 proxy that injects faults between a client and a real server.

Owns: one listening socket on 127.0.0.1 that relays each HTTP request of a client
connection to the upstream server, unless a fault is scheduled for it: an S3-style
``503 SlowDown``, a ``500 InternalError``, a TCP reset, or a stall (no answer at all).
Must not touch: the client or the server; the client talks to a real socket, so its
retries, timeouts and connection pool are exercised as they would be in production.

Usage::

    with FaultProxy(("127.0.0.1", s3.ports.s3)) as proxy:
        url = proxy.url                      # http://127.0.0.1:PORT, give it as endpoint_url
        proxy.inject(Fault.SLOWDOWN, count=2)  # the next two requests get 503 SlowDown
        proxy.set_mode(Fault.RESET)          # every request is reset until set_mode(None)
        proxy.requests, proxy.injected       # counters
        proxy.peak_active                    # most requests relayed at once

    FaultProxy(upstream, rate=100 * 2**20, latency=0.02)  # a WAN-like link: per-connection
                                                          # bandwidth cap and added latency

As a separate process (so its relaying does not share the caller's GIL), e.g. in
benchmarks: ``python -m kvstore.testing.fault_proxy UPSTREAM_PORT [--rate MiB/s]
[--latency SECONDS]`` prints the port it listens on and runs until killed.

Blocking threads (one per client connection), so it works for sync and async clients
alike and outlives any event loop.  Requests are framed by Content-Length (S3 clients
send no chunked request bodies unless asked; ``Expect: 100-continue`` is answered by the
proxy itself); responses by Content-Length or chunked
encoding, with no body for HEAD, 1xx, 204 and 304.
"""

from __future__ import annotations

import collections
import enum
import socket
import struct
import threading
import time

HOST = "127.0.0.1"


class Fault(str, enum.Enum):
    SLOWDOWN = "slowdown"  # 503 <Code>SlowDown</Code>: throttling, retried by botocore
    ERROR_500 = "error_500"  # 500 <Code>InternalError</Code>
    RESET = "reset"  # TCP RST instead of an answer
    STALL = "stall"  # read the request, never answer (until the proxy closes)
    PRECONDITION = "precondition"  # 412 <Code>PreconditionFailed</Code>: an object changed under a read


_BODIES = {
    Fault.SLOWDOWN: (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    Fault.ERROR_500: (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    Fault.PRECONDITION: (412, "Precondition Failed", "PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
}


class _Closed(Exception):
    pass


class _Pace:
    """Per-connection bandwidth cap for response bodies (None: unlimited)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.sent = 0

    def chunk(self) -> int:
        return 1 << 20 if self.rate is None else 1 << 16

    def account(self, n: int) -> None:
        if self.rate is None:
            return
        self.sent += n
        ahead = self.sent / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def _recv_until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while True:
        i = buf.find(marker)
        if i >= 0:
            return i
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise _Closed
        buf += chunk


def _recv_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(max(1 << 16, n - len(buf)))
        if not chunk:
            raise _Closed
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_head(sock: socket.socket, buf: bytearray) -> tuple[bytes, dict[str, str]]:
    end = _recv_until(sock, buf, b"\r\n\r\n")
    head = bytes(buf[: end + 4])
    del buf[: end + 4]
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return head, headers


def _relay_body(
    src: socket.socket, buf: bytearray, dst: socket.socket, headers: dict[str, str], pace: _Pace
) -> None:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            end = _recv_until(src, buf, b"\r\n")
            size = int(bytes(buf[:end]).split(b";")[0], 16)
            dst.sendall(_recv_exact(src, buf, end + 2))
            if size == 0:
                # trailers end with an empty line
                end = _recv_until(src, buf, b"\r\n\r\n") if not buf.startswith(b"\r\n") else 0
                dst.sendall(_recv_exact(src, buf, end + (2 if end == 0 else 4)))
                return
            dst.sendall(_recv_exact(src, buf, size + 2))
    left = int(headers.get("content-length", "0") or 0)
    if buf and left:
        take = bytes(buf[:left])
        del buf[: len(take)]
        dst.sendall(take)
        left -= len(take)
    while left > 0:
        chunk = src.recv(min(left, pace.chunk()))
        if not chunk:
            raise _Closed
        dst.sendall(chunk)
        pace.account(len(chunk))
        left -= len(chunk)


class FaultProxy:
    """See the module docstring."""

    def __init__(
        self,
        upstream: tuple[str, int],
        port: int = 0,
        *,
        rate: float | None = None,
        latency: float = 0.0,
    ) -> None:
        self.upstream = upstream
        self.rate = rate  # bytes/s per connection for response bodies, as a WAN link would allow
        self.latency = latency  # seconds added before each relayed response
        self._listener = socket.create_server((HOST, port))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._queue: collections.deque[Fault] = collections.deque()
        self._mode: Fault | None = None
        self._socks: set[socket.socket] = set()
        self._stop = threading.Event()
        self.requests = 0
        self.active = 0  # requests being relayed right now
        self.peak_active = 0  # the most relayed at once (how parallel the client really is)
        self.injected: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    # -- fault schedule ------------------------------------------------------------------

    def inject(self, fault: Fault, count: int = 1) -> None:
        """The next `count` requests (on any connection) get `fault`."""
        with self._lock:
            self._queue.extend([fault] * count)

    def set_mode(self, fault: Fault | None) -> None:
        """Every request gets `fault` until `set_mode(None)`; None also ends stalls."""
        with self._lock:
            self._mode = fault
            self._queue.clear()
        if fault is None:
            self.drop_connections()

    def drop_connections(self) -> None:
        """Reset every open client and upstream connection (a network blip)."""
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            _reset(s)

    def _next_fault(self) -> Fault | None:
        with self._lock:
            self.requests += 1
            fault = self._queue.popleft() if self._queue else self._mode
            if fault is not None:
                self.injected[fault.value] += 1
            return fault

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        self.drop_connections()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            (self._socks.add if add else self._socks.discard)(sock)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._track(client, True)
        upstream: socket.socket | None = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while not self._stop.is_set():
                head, headers = _read_head(client, cbuf)
                if headers.get("expect", "").lower() == "100-continue":
                    # answer it here and forward the request without it: the body follows
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"\r\n".join(
                        line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:")
                    )
                body = _recv_exact(client, cbuf, int(headers.get("content-length", "0") or 0))
                fault = self._next_fault()
                if fault is Fault.RESET:
                    _reset(client)
                    return
                if fault is Fault.STALL:
                    while not self._stop.is_set() and self._mode is Fault.STALL:
                        time.sleep(0.05)
                    _reset(client)
                    return
                if fault is not None:
                    client.sendall(_error_response(fault, head_only=head.startswith(b"HEAD ")))
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    self._track(upstream, True)
                with self._lock:
                    self.active += 1
                    self.peak_active = max(self.peak_active, self.active)
                try:
                    if self.latency:
                        time.sleep(self.latency)
                    upstream.sendall(head + body)
                    rhead, rheaders = _read_head(upstream, ubuf)
                    client.sendall(rhead)
                    status = int(rhead.split(b" ", 2)[1])
                    method = head.split(b" ", 1)[0]
                    if method != b"HEAD" and status not in (204, 304) and status >= 200:
                        _relay_body(upstream, ubuf, client, rheaders, _Pace(self.rate))
                finally:
                    with self._lock:
                        self.active -= 1
                if rheaders.get("connection", "").lower() == "close":
                    return
        except (_Closed, OSError, ValueError, IndexError):
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    self._track(s, False)
                    s.close()


def _error_response(fault: Fault, head_only: bool = False) -> bytes:
    status, reason, code, message = _BODIES[fault]
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    ).encode()
    return head if head_only else head + body  # a HEAD answer carries no body


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer sees ECONNRESET, not a clean end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="loopback HTTP fault / WAN-emulation proxy")
    ap.add_argument("upstream_port", type=int)
    ap.add_argument("--rate", type=float, help="MiB/s per connection for response bodies")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added before each response")
    args = ap.parse_args()
    rate = args.rate * (1 << 20) if args.rate else None
    proxy = FaultProxy((HOST, args.upstream_port), rate=rate, latency=args.latency).start()
    print(proxy.port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
