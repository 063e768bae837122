"""S3 GETs read straight into their destination, PUTs sent straight from the caller's
buffers, on worker threads.

Owns: `S3Streams`, keep-alive HTTP/1.1 connections (``http.client``, TLS included) to
an S3 endpoint, and the blocking steps of a streamed GET of a presigned URL:
`S3Streams.begin` (request the object's first bytes, read its head, ask the `StreamSink`
where the payload goes), `S3Streams.finish_first` (the rest of that response into the
sink's buffer, block by block, each block hashed while it is still in cache) and
`S3Streams.read_range` (one further range of a large object, hashed on its own thread;
the caller hands the results to the sink in order); `S3Streams.put`, a PUT of a presigned
PutObject / UploadPart URL whose body is the caller's buffers as they are.  aiobotocore
hands a body over as Python ``bytes`` read on the event loop, which a read then copies
into the caller's buffer, and hashes a PUT's body with SHA-256 on the event loop (SigV4
over ``http://``); here each block lands once, from the socket, outside the GIL, and a
presigned PUT is signed ``UNSIGNED-PAYLOAD`` (the frame's own CRC32C covers the bytes).  Must not touch:
signing and credentials (the backend presigns every URL with its aiobotocore client),
keys, frames (the sink), counters and the breaker (the backend's), the event loop.

Faults raise, for the backend to count: a botocore ``ClientError`` built from the
answer's status and S3 error code (so 404, 403, 412, SlowDown classify as they do for
aiobotocore's requests), `ShortBody` for a body that ended early or a range answered with
the wrong length, ``OSError`` / ``TimeoutError`` / ``http.client.HTTPException`` for the
network.  A request that fails before any byte of the body is read (a keep-alive
connection the server had closed, a 5xx, throttling, a reset) is sent again, with
exponential backoff, up to ``max_attempts`` attempts in all; once bytes land in the
caller's buffer a fault ends the read.  A connection whose answer was not read to the
end is closed, never reused.  Each socket read or send of a block waits at most
``read_timeout``.  Every step runs for an `Op`: the caller aborts it (its deadline
passed, or the read was cancelled) from the event loop, which shuts down the op's
sockets so a blocked read or send returns at once; the step then raises `TimeoutError`
or `Stopped` and writes nothing more into the caller's buffer.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from botocore.exceptions import ClientError

from kvstore.backends.s3_body import ShortBody
from kvstore.backends.stream import StreamSink

BLOCK = 256 << 10  # bytes per socket read: hashed while the block is still in L2
DRAIN_MAX = 1 << 20  # an unwanted rest up to this size is read off to keep the connection
ERROR_BODY_MAX = 64 << 10
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,512})</Message>")
_RANGE_TOTAL = re.compile(r"bytes \d+-\d+/(\d+)")


class Stopped(Exception):
    """The caller gave the transfer up (a cancelled read); its connection is closed."""


class Op:
    """One object's transfers, which the caller may abort from another thread.

    `abort` records why (``"deadline"`` or ``"cancelled"``) and shuts down every socket
    the op is using, so a worker blocked in a read or send returns at once; `check`
    raises `TimeoutError` / `Stopped` once aborted (or once `deadline` has passed)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.reason: str | None = None
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._event = threading.Event()

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            socks = list(self._socks)
        self._event.set()
        for sock in socks:
            _shut(sock)

    def check(self) -> None:
        if self.reason is None and time.monotonic() > self.deadline:
            self.reason = "deadline"
        if self.reason == "deadline":
            raise TimeoutError("S3 transfer passed its deadline (the timeout URL option)")
        if self.reason is not None:
            raise Stopped(self.reason)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)
            aborted = self.reason is not None
        if aborted:
            _shut(sock)

    def unwatch(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._socks.discard(sock)  # type: ignore[arg-type]

    def sleep(self, seconds: float) -> None:
        """Wait `seconds` (a backoff), or less if the op is aborted meanwhile."""
        self._event.wait(max(0.0, min(seconds, self.deadline - time.monotonic())))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


@dataclass(slots=True)
class Opened:
    """An object's GET whose headers and head arrived and whose sink named a buffer."""

    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    sock: socket.socket
    pool_key: str
    total: int  # bytes in the object
    length: int  # bytes this answer carries (from byte 0)
    etag: str | None
    dst: memoryview  # the payload's destination (object bytes [offset, offset + len(dst)))
    offset: int
    done: int  # payload bytes already in `dst` (and fed to the sink)


@dataclass(slots=True)
class Settled:
    """The GET ended before the payload: a miss (``missing``) or the sink's verdict."""

    missing: bool
    verdict: object = None
    oversized: int = 0  # the object's size, when it is over the caller's limit (a miss)


class S3Streams:
    """Pooled HTTP connections for streamed GETs; at most `size` idle ones per host."""

    def __init__(
        self,
        *,
        size: int = 16,
        connect_timeout: float = 3.0,
        read_timeout: float = 10.0,
        max_attempts: int = 4,
        ca_bundle: str | None = None,
    ) -> None:
        self.size = size
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_attempts = max(1, max_attempts)
        self._ca_bundle = ca_bundle
        self._tls: ssl.SSLContext | None = None
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.requests = 0  # sent, retries included (for tests and stats)
        self.retries = 0

    # -- connections -----------------------------------------------------------------
    def _take(self, u: SplitResult) -> tuple[str, http.client.HTTPConnection, bool]:
        key = f"{u.scheme}://{u.netloc}"
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return key, idle.pop(), True
        host, port = u.hostname or "", u.port
        conn: http.client.HTTPConnection
        if u.scheme == "https":
            if self._tls is None:
                from botocore.httpsession import where  # botocore's bundle, as aiobotocore trusts

                self._tls = ssl.create_default_context(cafile=self._ca_bundle or where())
            conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout, context=self._tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
        return key, conn, False

    def _give(self, key: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.size and not self._closed:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; a worker still running closes its own when done."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()

    # -- one request -----------------------------------------------------------------
    def _count(self, retry: bool = False) -> None:
        with self._lock:
            self.requests += not retry
            self.retries += retry

    def _send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        op: Op,
        body: Sequence[memoryview] = (),
    ) -> tuple[str, http.client.HTTPConnection, http.client.HTTPResponse, socket.socket]:
        """Send `method` `url` (with `body`, the caller's buffers sent as they are, in
        `BLOCK` slices) until an answer of 200/206 (returned, its body unread, its socket
        watched by `op`: the caller unwatches it) or a final error (raised); see the
        module docstring for what is sent again."""
        u = urlsplit(url)
        target = f"{u.path or '/'}?{u.query}" if u.query else (u.path or "/")
        sent = dict(headers)  # Host: http.client's (lower-case, port unless default) is what botocore signs
        if method == "PUT":
            sent["Content-Length"] = str(sum(v.nbytes for v in body))
        attempt = 0
        while True:
            op.check()
            key, conn, reused = self._take(u)
            self._count()
            sock: socket.socket | None = None
            try:
                if conn.sock is None:
                    # within connect_timeout, and not past the op's deadline (a connect in
                    # progress has no socket `abort` could shut yet)
                    conn.timeout = max(0.01, min(self.connect_timeout, op.deadline - time.monotonic()))
                    conn.connect()
                sock = conn.sock
                sock.settimeout(self.read_timeout)  # from here: per block sent or read
                op.watch(sock)
                conn.request(method, target, body=_slices(body, op) if body else None, headers=sent)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                op.unwatch(sock)
                conn.close()
                op.check()  # aborted: no retry
                if reused and isinstance(exc, (http.client.RemoteDisconnected, ConnectionError)):
                    self._count(retry=True)  # the server may have closed an idle keep-alive
                    continue  # connection: sent again at once on a new one, not an attempt
                attempt += 1
                if attempt >= self.max_attempts:
                    raise
                self._backoff(attempt, op)
                continue
            if resp.status in (200, 206):
                return key, conn, resp, sock
            op.unwatch(sock)
            err = _error(resp, "GetObject" if method == "GET" else "PutObject")
            if resp.isclosed():
                self._give(key, conn)
            else:
                conn.close()
            attempt += 1
            if resp.status not in RETRY_STATUS or attempt >= self.max_attempts:
                raise err
            self._backoff(attempt, op)

    def _backoff(self, attempt: int, op: Op) -> None:
        self._count(retry=True)
        op.sleep(random.uniform(0, 0.05 * 2**attempt))

    def _done(self, op: Op, key: str, conn: http.client.HTTPConnection, sock: socket.socket, whole: bool) -> None:
        """An answer is over: its connection back to the pool if it was read to the end
        (and the op not aborted meanwhile), else closed."""
        op.unwatch(sock)
        if whole and op.reason is None:
            self._give(key, conn)
        else:
            conn.close()

    # -- a streamed PUT ----------------------------------------------------------------
    def put(self, url: str, body: Sequence[memoryview], op: Op) -> str | None:
        """PUT `body` (the buffers as they are, never joined) to a presigned PutObject or
        UploadPart URL; the answer's ETag.  Sent again whole on the faults `_send` retries
        (a PUT of the same bytes is idempotent)."""
        key, conn, resp, sock = self._send("PUT", url, {}, op, body)
        whole = False
        try:
            etag = resp.getheader("ETag")
            resp.read(ERROR_BODY_MAX)
            whole = resp.isclosed()
            return etag
        finally:
            self._done(op, key, conn, sock, whole)

    # -- a streamed GET ----------------------------------------------------------------
    def begin(self, url: str, sink: StreamSink, first: int, op: Op, max_size: int) -> Opened | Settled:
        """GET bytes [0, `first`) of the object (all of it when smaller), read its head
        and let `sink` name the payload's buffer.  `Settled` when the object is missing,
        over `max_size`, or the sink declined (its verdict then); else the open answer,
        the payload bytes that came with the head already placed and fed."""
        try:
            key, conn, resp, sock = self._send("GET", url, {"Range": f"bytes=0-{first - 1}"}, op)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            if status == 404 and code != "NoSuchBucket":
                return Settled(missing=True)
            if status != 416:
                raise
            key, conn, resp, sock = self._send("GET", url, {}, op)  # an empty object has no byte 0
        state = "close"  # what becomes of the connection: "close", "give" back, or "opened"
        try:
            length = resp.length if resp.length is not None else -1
            if length < 0:
                raise ShortBody("answer without a Content-Length")
            total = length
            if resp.status == 206:
                m = _RANGE_TOTAL.fullmatch(resp.getheader("Content-Range") or "")
                if m is None:
                    raise ShortBody(f"unreadable Content-Range {resp.getheader('Content-Range')!r}")
                total = int(m.group(1))
            if total > max_size:
                return Settled(missing=True, oversized=total)
            head = memoryview(bytearray(min(length, sink.head)))
            _read_exact(resp, head, op)
            where = sink.body(head, total)
            if where is None:
                rest = length - len(head)
                if rest <= DRAIN_MAX and _drain(resp, rest, op):
                    state = "give"
                return Settled(missing=False, verdict=sink.finish())
            dst, offset = where
            dst = dst if dst.format == "B" and dst.ndim == 1 else dst.cast("B")
            if offset > len(head):
                raise ShortBody("payload starts past the head the sink read")
            done = min(len(head), offset + len(dst)) - offset
            if done > 0:
                sink.feed_from(dst[:done], head[offset : offset + done])
            opened = Opened(conn, resp, sock, key, total, length, resp.getheader("ETag"), dst, offset, max(0, done))
            state = "opened"
            return opened
        except Exception:
            op.check()  # aborted: say so rather than what the shut socket did
            raise
        finally:
            if state != "opened":
                self._done(op, key, conn, sock, state == "give")

    def finish_first(self, opened: Opened, sink: StreamSink, op: Op) -> None:
        """The rest of the first answer into ``opened.dst``, each block fed to `sink`."""
        o = opened
        end = min(o.length - o.offset, len(o.dst))
        whole = False
        try:
            pos = o.done
            while pos < end:
                op.check()
                block = o.dst[pos : min(end, pos + BLOCK)]
                _read_exact(o.resp, block, op)
                sink.feed(block)
                pos += len(block)
            o.done = pos
            whole = _drain(o.resp, o.resp.length or 0, op)
        except Exception:
            op.check()
            raise
        finally:
            self._done(op, o.pool_key, o.conn, o.sock, whole)

    def release(self, opened: Opened, op: Op) -> None:
        """An opened answer that will not be read: its connection closed."""
        self._done(op, opened.pool_key, opened.conn, opened.sock, False)

    def read_range(self, url: str, etag: str | None, into: memoryview, lo: int, sink: StreamSink, op: Op) -> int:
        """Object bytes [lo, lo + len(into)) into `into` (the same object: ``If-Match``
        its ETag); the sink's hash of them from 0."""
        headers = {"Range": f"bytes={lo}-{lo + len(into) - 1}"}
        if etag:
            headers["If-Match"] = etag
        key, conn, resp, sock = self._send("GET", url, headers, op)
        whole = False
        try:
            if resp.status != 206 or resp.length != len(into):
                raise ShortBody(f"range of {len(into)} bytes answered with {resp.status}, {resp.length} bytes")
            value, pos = 0, 0
            while pos < len(into):
                op.check()
                block = into[pos : pos + BLOCK]
                _read_exact(resp, block, op)
                value = sink.hash(block, value)
                pos += len(block)
            whole = _drain(resp, 0, op)
            return value
        except Exception:
            op.check()
            raise
        finally:
            self._done(op, key, conn, sock, whole)


def _slices(body: Sequence[memoryview], op: Op) -> Iterator[memoryview]:
    """The body in `BLOCK` slices (views, no copies): each is one ``sendall`` bounded by
    the socket's ``read_timeout``, and an aborted op stops between them."""
    for view in body:
        for lo in range(0, view.nbytes, BLOCK):
            op.check()
            yield view[lo : lo + BLOCK]


def _read_exact(resp: http.client.HTTPResponse, into: memoryview, op: Op) -> None:
    pos = 0
    while pos < len(into):
        n = resp.readinto(into[pos:])
        if not n:
            op.check()  # a socket shut by an abort reads as the end of the body
            raise ShortBody(f"body ended {len(into) - pos} bytes early")
        pos += n


def _drain(resp: http.client.HTTPResponse, n: int, op: Op) -> bool:
    """Read off `n` unwanted bytes; True when the answer ended there (connection reusable)."""
    if n > 0:
        scratch = memoryview(bytearray(min(n, BLOCK)))
        while n > 0:
            op.check()
            got = resp.readinto(scratch[: min(n, len(scratch))])
            if not got:
                return False
            n -= got
    if resp.length == 0 and not resp.isclosed():
        resp.read(0)  # an empty rest: http.client marks the answer over only when asked
    return resp.isclosed()


def _error(resp: http.client.HTTPResponse, operation: str) -> ClientError:
    """A botocore ``ClientError`` for an error answer (its body read, up to a limit)."""
    body = resp.read(ERROR_BODY_MAX) if resp.length is None or resp.length <= ERROR_BODY_MAX else b""
    code_m, msg_m = _CODE.search(body), _MESSAGE.search(body)
    code = code_m.group(1).decode("utf-8", "replace") if code_m else str(resp.status)
    message = msg_m.group(1).decode("utf-8", "replace") if msg_m else resp.reason
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": resp.status}},
        operation,
    )


__all__ = ["BLOCK", "Op", "Opened", "S3Streams", "Settled", "Stopped"]
