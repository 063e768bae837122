"""A Redis lookup answered on the caller's thread: one blocking socket, one round trip.

Owns: `RespProbe`, a blocking RESP connection (TCP or unix socket, authenticated and on
the right database) that any thread may use, one at a time, to ask the ``TYPE`` of a
few keys in one round trip, within `timeout` for the whole call (connecting and logging
in included).  A lookup that misses the store's books asks the tier (someone else may
have stored the chunk); on LMCache's thread that ask costs two thread hops and the
event loop's layers, several times the round trip itself.  Must not touch: key layout
(the backend passes keys), the event loop's sockets (`kvstore.backends.redis_stream`),
when to ask (the backend's `InlineGate`).

A host name is never resolved here (a DNS lookup has no timeout a socket can set): the
backend resolves it on its event loop (`resolve`) and the probe answers None until it
has; a failed call forgets the address, so the loop resolves it again.  A socket whose
reply was not read whole (an error, the deadline) is closed, never reused; an idle one
the server closed (a restart, its idle ``timeout``) is replaced before use, and one that
turns out closed when used, before any reply came, is replaced once within the call.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstore.backends.redis_stream import NO_LOGIN, Address, Login, RespError, pack


class _Stale(RespError):
    """A reused socket the server had closed before it answered anything: try a fresh one."""


class RespProbe:
    """Short commands on one blocking socket from any thread; a busy probe says so (None)."""

    def __init__(self, address: Address, login: Login = NO_LOGIN, *, timeout: float = 0.005) -> None:
        self.address = address
        self.login = login
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._target: tuple[int, Any] | None = None  # (family, sockaddr) to connect to
        if address.path:
            self._target = (socket.AF_UNIX, address.path)
        elif _numeric(address.host):
            self._target = (address.family(), (address.host, address.port))
        self._fixed = self._target is not None  # nothing to resolve, ever

    @property
    def resolved(self) -> bool:
        return self._target is not None

    async def resolve(self) -> None:
        """Find the host's address on the running loop (its resolver runs on a worker
        thread); the first one that resolves is used.  Raises `OSError` if none does."""
        if self._target is not None or self._closed:
            return
        a = self.address
        infos = await asyncio.get_running_loop().getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"{a.host} did not resolve")
        family, _, _, _, sockaddr = infos[0]
        self._target = (family, sockaddr)

    def types(self, keys: Sequence[bytes]) -> list[bytes] | None:
        """``TYPE`` of each key (``b"string"``, ``b"none"``, ...) in one round trip, or None
        when another thread is using the probe, it is closed, or its host is not resolved
        yet.  Raises `OSError` (``TimeoutError`` past `timeout`; `RespError` when the
        server answers an error or breaks the protocol); the socket is dropped then, and
        the address forgotten."""
        if not keys:
            return []
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed or self._target is None:
                return None
            deadline = time.monotonic() + self.timeout
            request = b"".join(pack(b"TYPE", k) for k in keys)
            idle, self._sock = self._sock, None  # it comes back only with its reply read whole
            sock = self._usable(idle)
            try:
                try:
                    lines = self._ask(sock, request, len(keys), deadline) if sock is not None else None
                except _Stale:
                    lines = None
                if lines is None:
                    sock = self._connect(deadline)
                    lines = self._ask(sock, request, len(keys), deadline)
            except OSError:
                if not self._fixed:
                    self._target = None  # the loop resolves the host again (it may have moved)
                raise
            assert sock is not None
            self._sock = sock
            return [line[1:] for line in lines]
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the socket, after the call in flight (at most `timeout`); not reopened."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # -- under the lock ----------------------------------------------------------------
    def _ask(self, sock: socket.socket, request: bytes, n: int, deadline: float) -> list[bytes]:
        """Send `request`, read its `n` one-line replies; the socket is closed on any fault
        (`_Stale` when a reused socket was found closed before any reply byte)."""
        try:
            _send(sock, request, deadline)
            lines = _read_lines(sock, n, deadline)
        except (ConnectionResetError, BrokenPipeError, _Stale):
            sock.close()
            raise _Stale("the server had closed the socket") from None
        except BaseException:
            sock.close()
            raise
        bad = next((line for line in lines if not line.startswith(b"+")), None)
        if bad is not None:  # the server may be closing the socket after an error
            sock.close()
            raise RespError(f"Redis answered TYPE with {bad[:80]!r}")
        return lines

    def _connect(self, deadline: float) -> socket.socket:
        assert self._target is not None
        family, sockaddr = self._target
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_left(deadline))
            sock.connect(sockaddr)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            setup = self.login.hello()
            if setup:
                _send(sock, b"".join(setup), deadline)
                for line in _read_lines(sock, len(setup), deadline):
                    if not line.startswith(b"+"):
                        raise RespError(f"Redis refused the connection setup: {line[:80]!r}")
        except _Stale:
            sock.close()
            raise RespError("Redis closed a new connection") from None
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    def _usable(sock: socket.socket | None) -> socket.socket | None:
        """`sock` if it is open and quiet (nothing to read, as an idle socket must be), else
        None (closed by the server, reset, or holding bytes nobody asked for; closed here)."""
        if sock is None:
            return None
        try:
            sock.settimeout(0)  # with a timeout set, even a MSG_DONTWAIT recv would wait for it
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return sock
        except OSError:
            pass
        sock.close()
        return None


def _numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the lookup's time on the caller's thread ran out")
    return left


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    sock.sendall(data)


def _read_lines(sock: socket.socket, n: int, deadline: float) -> list[bytes]:
    """The next `n` one-line replies, read in blocks before `deadline`; anything past them
    breaks the protocol.  `_Stale` when the server closed the socket before any byte."""
    buf = b""
    lines: list[bytes] = []
    got = 0
    while len(lines) < n:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise (_Stale if not got else RespError)("Redis closed the connection")
        got += len(chunk)
        *done, buf = (buf + chunk).split(b"\r\n")
        lines += done
    if buf or len(lines) != n:
        raise RespError("Redis sent more than the replies asked for")
    return lines


__all__ = ["RespProbe"]
