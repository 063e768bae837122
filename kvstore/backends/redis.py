"""Redis tier: ``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://`` on redis.asyncio.

Owns: the connection pool (one per backend), batching (pipelines for small operations,
bounded concurrent single commands for big values), multi-part values, TTLs, deadlines
and fault handling.  Must not touch: frames, codecs, tensors.  Key layout and the
manifest live in `kvstore.backends.redis_layout`.

URLs::

    redis://[[user]:password@]host:port[/db][?options]
    rediss://...                         TLS (ssl_ca_certs, ssl_certfile, ssl_keyfile,
                                         ssl_cert_reqs, ssl_check_hostname pass to redis-py)
    unix://[[user]:password@]/path/to/redis.sock[?db=0&options]
    redis+cluster://host:port,host:port,...[?options]    (rediss+cluster:// for TLS)

Options: ``prefix`` (key prefix, default ``kv:``), ``ttl`` (seconds, every namespace),
``ttl.<namespace>`` (seconds, one namespace; 0 = no expiry), ``part_size`` (largest
single Redis value, default 512MiB, Redis's bulk limit), ``pipeline_max`` (values up to
this size are pipelined, default 64KiB; bigger ones go as concurrent single commands,
which measured faster here from 1 MiB up), ``inflight`` (big values in flight at once,
default 4), ``timeout`` (seconds per batch, default 5, plus 1 s per 64 MiB moved),
``connect_timeout`` (default 1), ``max_connections`` (default 32), ``inline_timeout``
(seconds a lookup may take on the caller's thread, connecting included, default 0.005;
0 sends every lookup through the event loop; see `contains_now`).  Credentials come
from the URL or from ``KVSTORE_REDIS_USERNAME`` / ``KVSTORE_REDIS_PASSWORD``; they are
never logged (`stats().url` is redacted).

Big unsealed frames (`kvstore.frame.UnsealedFrame`) on plain TCP / unix sockets are
hashed as they are sent, under a temporary key, and published by a short script (see
`kvstore.backends.redis_stream`): the user needs ``EVAL`` (ACL ``+@scripting``) and the
temporary keys (all keys under the prefix: ``~P*``, see `kvstore.backends.redis_layout`);
without them they are checksummed before they are sent, after one warning.

Faults (refused, reset, killed server, timeouts, errors from Redis) never escape: a
failed put is False plus ``put_errors``, a failed get is None plus ``get_errors``.  The
pool reconnects on the next call once the server is back.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError, WatchError

from kvstore import checksum
from kvstore.backends import redis_layout as layout
from kvstore.backends.base import (
    DEFAULT_MAX_OBJECT,
    MAX_OBJECT_OPTION,
    Alloc,
    Backend,
    BackendStats,
    BackendUnavailableError,
    Capabilities,
    Defect,
    ObjectInfo,
    Value,
    as_parts,
    bytearray_alloc,
    parts_len,
    redact_url,
)
from kvstore.backends.inline_gate import InlineGate
from kvstore.backends.redis_probe import RespProbe
from kvstore.backends.redis_stream import Address, Login, Manifest, PatchRefused, RespStreams
from kvstore.backends.redis_wire import Gathered, gathering
from kvstore.backends.stream import StreamSink, stream_from_buffer
from kvstore.deadlines import within
from kvstore.frame import UnsealedFrame, seal_frames
from kvstore.keys import InvalidKeyError, check_object_name, is_object_name, printable_name
from kvstore.options import option_float, option_int, option_size
from kvstore.redact import redact_text

log = logging.getLogger(__name__)

#: Faults that become counted errors.  Anything else is a programming error and raises.
FAULTS = (RedisError, OSError, asyncio.TimeoutError, ConnectionError, EOFError)

_OPTIONS = {
    "prefix",
    "ttl",
    "part_size",
    "pipeline_max",
    "inflight",
    "timeout",
    "connect_timeout",
    "max_connections",
    "inline_timeout",
    MAX_OBJECT_OPTION,
}
_REDIS_PY_OPTIONS = {
    "db",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
}
MIB = 1 << 20
SLOW_PROBE_SHARE = 0.2  # a lookup's round trip on the caller's thread over this share of inline_timeout is slow
TEMP_TTL_MIN = 60.0  # seconds a temporary key outlives a writer that died before publishing it
CLOCK_REFRESH_S = 600.0  # seconds between asks for the server's clock (generations are stamped with it)
GC_GRACE_MIN = 3600.0  # seconds a multi-part write's parts are safe from collect_garbage, at least
#: the first ARGV[2] bytes of hash field ARGV[1] of KEYS[1] (a multi-part value's first
#: part): a header read moves a few KiB over the wire, not a part of up to 512 MiB
HEAD_OF_PART = (
    "local v = redis.call('HGET', KEYS[1], ARGV[1]) "
    "if not v then return false end "
    "return string.sub(v, 1, tonumber(ARGV[2]))"
)


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """Tunables of one Redis backend (see the module docstring for their URL spelling)."""

    prefix: str = layout.DEFAULT_PREFIX
    ttl: float | None = None
    ttl_by_namespace: tuple[tuple[str, float], ...] = ()
    part_size: int = layout.REDIS_BULK_LIMIT
    pipeline_max: int = 64 * 1024
    inflight: int = 4
    timeout: float = 5.0
    seconds_per_64mib: float = 1.0
    connect_timeout: float = 1.0
    max_connections: int = 32
    inline_timeout: float = 0.005
    max_object: int = DEFAULT_MAX_OBJECT

    def deadline(self, nbytes: int) -> float:
        """Seconds a batch moving `nbytes` may take before it is abandoned."""
        return self.timeout + self.seconds_per_64mib * nbytes / (64 * MIB)


def _flat(view: memoryview) -> memoryview:
    """A caller's buffer as flat bytes (tensors' views come as '<B' or multi-dimensional)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _WholeValue:
    """A `StreamSink` that takes a whole value into one buffer from `alloc` (no checks:
    the caller verifies the frame)."""

    head = 4096

    def __init__(self, alloc: Alloc | None, max_size: int) -> None:
        self.alloc = alloc or bytearray_alloc
        self.max_size = max_size
        self.oversized = 0
        self.buf: memoryview | None = None

    def body(self, head: memoryview, size: int) -> tuple[memoryview, int] | None:
        if size > self.max_size:
            self.oversized = size
            return None
        self.buf = _flat(self.alloc(size))[:size]
        return self.buf, 0

    def feed(self, block: memoryview) -> None:
        return None

    def feed_from(self, block: memoryview, src: memoryview) -> None:
        block[:] = src

    def hash(self, block: memoryview, value: int = 0) -> int:
        return 0

    def feed_hashed(self, nbytes: int, value: int) -> None:
        return None

    def feed_pread(self, fd: int, block: memoryview, offset: int, *, mapped: bool = False) -> int:
        raise NotImplementedError("a Redis value is not read from a file")

    def finish(self) -> memoryview | None:
        return self.buf


@dataclass(slots=True)
class Budget:
    """Bytes a running batch moves; jobs add what they learn (multi-part totals)."""

    nbytes: int = 0


def parse_options(query: dict[str, str]) -> tuple[RedisOptions, dict[str, str]]:
    """Split a URL query into our `RedisOptions` and the options redis-py understands."""
    ours: dict[str, Any] = {}
    ttls: list[tuple[str, float]] = []
    passthrough: dict[str, str] = {}
    for k, v in query.items():
        if k.startswith("ttl."):
            ttls.append((k[4:], option_float(k, v, allow_zero=True)))
        elif k == "ttl":
            ours[k] = option_float(k, v, allow_zero=True) or None  # 0 = never expire
        elif k in ("timeout", "connect_timeout"):
            ours[k] = option_float(k, v)
        elif k == "inline_timeout":
            ours[k] = option_float(k, v, allow_zero=True)
        elif k in ("part_size", "pipeline_max"):
            ours[k] = option_size(k, v)
        elif k in ("inflight", "max_connections"):
            ours[k] = option_int(k, v)
        elif k == MAX_OBJECT_OPTION:
            ours["max_object"] = option_size(k, v, unbounded=False)
        elif k == "prefix":
            ours[k] = layout.check_prefix(v)
        elif k in _REDIS_PY_OPTIONS:
            passthrough[k] = v
        else:
            known = sorted(_OPTIONS | _REDIS_PY_OPTIONS | {"ttl.<namespace>"})
            raise ValueError(f"unknown Redis URL option {k!r}; known: {known}")
    part_size = ours.get("part_size") or layout.REDIS_BULK_LIMIT
    if part_size > layout.REDIS_BULK_LIMIT:
        raise ValueError(f"part_size {part_size} exceeds Redis's bulk limit of 512MiB")
    ours["part_size"] = part_size
    if ours.get("pipeline_max") is None:
        ours.pop("pipeline_max", None)
    return RedisOptions(ttl_by_namespace=tuple(ttls), **ours), passthrough


AOF_SYNC_WAIT_S = 2.0  # `appendfsync everysec` syncs once a second; twice that, to be sure
WAITAOF_TIMEOUT_S = 10.0


async def _all_settled(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run `coros` together and wait until every one has ended, then raise the first
    error. A plain gather raises at the first error while the rest run on: a part fetch
    would then write into a buffer the caller has already given back to its pool (and
    another read taken), after that read's checksum passed; a part put would still be
    reading the caller's buffer."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


class RedisBackend(Backend):
    schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
    #: `read_streamed` writes into the caller's buffers only from the event loop, so
    #: cancelling it stops those writes at once (the disk backend's worker threads do not)
    capabilities = Capabilities(streamed_reads=True, streams_on_loop=True, server_ttl=True, ranged_reads=True)

    def __init__(
        self,
        url: str,
        client: Any,
        options: RedisOptions | None = None,
        streams: RespStreams | None = None,
        probe: RespProbe | None = None,
    ) -> None:
        """Use `from_url`; `client` is a redis.asyncio ``Redis`` or ``RedisCluster``;
        `streams` (plain TCP or unix socket servers) reads big values in one copy;
        `probe` (the same servers) answers lookups on the caller's thread."""
        super().__init__(url)
        self.client = client
        self.streams = streams
        self.probe = probe
        self._inline = InlineGate(closed=probe is None)
        self._resolving: asyncio.Future[None] | None = None
        self._clock = time.perf_counter
        if streams is not None:  # big values go out hashed as they are sent (off if refused)
            self.capabilities = dataclasses.replace(type(self).capabilities, seals_frames=True)
        self.patch_refusal: str | None = None  # why big values go out checksummed first
        self.options = options or RedisOptions()
        self.max_object_bytes = self.options.max_object
        self.cluster = isinstance(client, RedisCluster)
        self._clock_offset = 0.0  # the server's clock minus this host's (`_server_clock`)
        self._clock_asked: float | None = None
        self._ttls = dict(self.options.ttl_by_namespace)
        self._big = asyncio.Semaphore(self.options.inflight)
        self._lookups = asyncio.Semaphore(self.options.inflight)  # raw-socket TYPE pipelines at once
        self._failing = False
        self._server: dict[str, Any] = {}
        self._typical = 0  # size of the last single-part object moved: routes gets (see get_many)

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_url(cls, url: str, *, ttl_by_namespace: Mapping[str, float] | None = None) -> RedisBackend:
        """Open from a URL (see the module docstring).

        `ttl_by_namespace` is the configuration form of ``ttl.<namespace>=`` (seconds,
        0 = never expire); URL values win over it.
        """
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in cls.schemes:
            raise ValueError(f"{redact_url(url)!r}: RedisBackend serves {', '.join(cls.schemes)}")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        options, passthrough = parse_options(query)
        if ttl_by_namespace:
            merged = {**dict(ttl_by_namespace), **dict(options.ttl_by_namespace)}
            options = dataclasses.replace(options, ttl_by_namespace=tuple(merged.items()))
        username = unquote(parts.username) if parts.username else os.environ.get("KVSTORE_REDIS_USERNAME")
        password = unquote(parts.password) if parts.password else os.environ.get("KVSTORE_REDIS_PASSWORD")
        common: dict[str, Any] = dict(
            username=username or None,
            password=password or None,
            socket_timeout=options.timeout,
            socket_connect_timeout=options.connect_timeout,
            max_connections=options.max_connections,
            retry=Retry(NoBackoff(), 1),
        )
        if scheme.endswith("+cluster"):
            hosts = parts.netloc.rsplit("@", 1)[-1]
            nodes = []
            for hp in hosts.split(","):
                host, _, port = hp.strip().rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"{redact_url(url)}: cluster nodes must be host:port,host:port,...")
                nodes.append(ClusterNode(host.strip("[]"), int(port)))
            ssl = scheme.startswith("rediss")
            tls: dict[str, Any] = {k: v for k, v in passthrough.items() if k.startswith("ssl_")}
            if "ssl_check_hostname" in tls:
                tls["ssl_check_hostname"] = tls["ssl_check_hostname"].lower() in ("1", "true", "yes")
            client: Any = RedisCluster(startup_nodes=nodes, ssl=ssl, **tls, **common)
            # framed values unjoined on every node's connections, found now or later
            manager = client.nodes_manager
            gather_class = gathering(manager.connection_kwargs.get("connection_class", Connection))
            manager.connection_kwargs["connection_class"] = gather_class
            for node in manager.startup_nodes.values():
                node.connection_class = gather_class
        else:
            netloc = parts.netloc.rsplit("@", 1)[-1]  # credentials go as kwargs, never in a URL string
            plain = urlunsplit((scheme, netloc, parts.path, urlencode(passthrough), ""))
            pool = aioredis.ConnectionPool.from_url(plain, **common)
            pool.connection_class = gathering(cast(type, pool.connection_class))  # framed values unjoined
            client = aioredis.Redis(connection_pool=pool)
        streams = probe = None
        if scheme in ("redis", "unix"):  # TLS and Cluster stay on redis-py
            kw = pool.connection_kwargs
            address = (
                Address(path=kw["path"])
                if "path" in kw
                else Address(kw.get("host", "localhost"), kw.get("port", 6379))
            )
            login = Login(username or None, password or None, int(kw.get("db", 0) or 0))
            streams = RespStreams(address, login, size=options.inflight, connect_timeout=options.connect_timeout)
            probe = RespProbe(address, login, timeout=options.inline_timeout) if options.inline_timeout else None
        return cls(url, client, options, streams, probe)

    # -- fault plumbing ----------------------------------------------------------
    def _fault(self, op: str, exc: BaseException) -> None:
        if not self._failing:
            log.warning("redis %s failed on %s: %s: %s", op, redact_url(self.url), type(exc).__name__, exc)
            self._failing = True
        else:
            log.debug("redis %s failed: %s: %s", op, type(exc).__name__, exc)

    def _ok(self) -> None:
        if self._failing:
            log.warning("redis %s is answering again", redact_url(self.url))
            self._failing = False

    async def _run(self, op: str, jobs: Sequence[Awaitable[None]], nbytes: int | Budget) -> list[bool]:
        """Run the jobs of one batch concurrently under one deadline; say which failed.

        The deadline is `RedisOptions.deadline` of the bytes in `nbytes`; a `Budget`
        lets jobs add bytes they discover (a manifest's total) while they run.  Each job
        stores its own results; a job that fails or is still running at the deadline
        leaves its results at their failure default.  Faults are not raised.
        """
        if not jobs:
            return []
        if len(jobs) == 1 and not isinstance(nbytes, Budget):  # one job, a fixed deadline: no task of its own
            deadline = self.options.deadline(nbytes)
            try:
                await within(jobs[0], deadline)
            except asyncio.TimeoutError:
                self._fault(op, asyncio.TimeoutError(f"batch deadline of {deadline:.1f}s passed"))
                return [True]
            except FAULTS as fault:
                self._fault(op, fault)
                return [True]
            self._ok()
            return [False]
        budget = nbytes if isinstance(nbytes, Budget) else Budget(nbytes)
        tasks = [asyncio.ensure_future(j) for j in jobs]
        loop = asyncio.get_running_loop()
        start, pending = loop.time(), set(tasks)
        deadline = self.options.deadline(budget.nbytes)
        try:
            while pending:
                deadline = self.options.deadline(budget.nbytes)
                remaining = start + deadline - loop.time()
                if remaining <= 0:
                    break
                _, pending = await asyncio.wait(pending, timeout=remaining)
        except BaseException:  # the caller was cancelled: take the batch's commands with it
            for t in tasks:
                t.cancel()
            raise
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        failed = []
        first: BaseException | None = None
        bug: BaseException | None = None
        for t in tasks:
            if t in pending:
                failed.append(True)
                first = first or asyncio.TimeoutError(f"batch deadline of {deadline:.1f}s passed")
                continue
            exc = t.exception()  # retrieve every task's exception before raising any
            if exc is not None and not isinstance(exc, FAULTS):
                bug = bug or exc
            failed.append(exc is not None)
            first = first or exc
        if bug is not None:
            raise bug
        if first is not None:
            self._fault(op, first)
        else:
            self._ok()
        return failed

    # -- put ---------------------------------------------------------------------
    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        ok = [False] * len(items)
        sizes = [0] * len(items)
        small: list[tuple[int, str, Any, int | None]] = []
        jobs: list[Awaitable[None]] = []
        to_seal: list[UnsealedFrame] = []  # unsealed frames that go out whole (sealed first)
        for i, (name, value) in enumerate(items):
            try:
                check_object_name(name)
            except InvalidKeyError as exc:
                log.debug("redis put rejected %r: %s", name, exc)
                continue
            parts = as_parts(value)
            size = sizes[i] = parts_len(parts)
            if self.too_large(name, size):
                self.counters.rejected += 1
                sizes[i] = 0
                continue
            ttl = layout.ttl_ms_for(name, self._ttls, self.options.ttl)
            frame = value if isinstance(value, UnsealedFrame) and not value.sealed else None
            big = self.options.pipeline_max < size <= self.options.part_size
            if frame is not None and not (big and self.capabilities.seals_frames):
                to_seal.append(frame)
                frame = None
            if size > self.options.part_size:
                jobs.append(self._put_multi(i, name, parts, size, ttl, ok))
                continue
            data: Any = parts[0] if len(parts) == 1 else Gathered(parts)  # sent unjoined
            self._typical = size
            if size <= self.options.pipeline_max:
                small.append((i, name, data, ttl))
            else:
                jobs.append(self._put_big(i, name, data, ttl, ok, frame))
        if small:
            jobs.append(self._put_small(small, ok))
        await seal_frames(to_seal)
        await self._run("put", jobs, sum(sizes))
        for i in range(len(items)):
            if ok[i]:
                self.counters.puts += 1
                self.counters.put_bytes += sizes[i]
            else:
                self.counters.put_errors += 1
        return ok

    async def _put_small(self, small: list[tuple[int, str, Any, int | None]], ok: list[bool]) -> None:
        pfx = self.options.prefix
        pipe = self.client.pipeline(transaction=False)
        for _, name, data, ttl in small:
            pipe.set(layout.data_key(pfx, name), data, px=ttl)
        for _, name, _, _ in small:  # drop parts of an older multi-part value (free here)
            pipe.execute_command("UNLINK", layout.parts_key(pfx, name))
        replies = await pipe.execute(raise_on_error=False)
        for (i, _, _, _), r in zip(small, replies):
            ok[i] = r is True
        if any(isinstance(r, Exception) for r in replies):
            raise next(r for r in replies if isinstance(r, Exception))

    async def _put_big(
        self, i: int, name: str, data: Any, ttl: int | None, ok: list[bool], frame: UnsealedFrame | None = None
    ) -> None:
        """One big value; `frame` (the value, unsealed) is hashed as it is sent where it
        can be, else sealed first."""
        key = layout.data_key(self.options.prefix, name)
        async with self._big:
            if self.streams is not None:  # the parts go to the socket as they are
                parts = data.parts if isinstance(data, Gathered) else [data]
                bkey = key.encode("utf-8", "surrogateescape")
                if frame is not None:
                    sent = await self._put_sealing(bkey, name, frame, parts, ttl)
                    if sent is not None:
                        ok[i] = sent
                        return
                    await seal_frames([frame])
                ok[i] = await self.streams.stream_set(bkey, parts, ttl)
            else:
                ok[i] = bool(await self.client.set(key, data, px=ttl))

    async def _put_sealing(
        self, key: bytes, name: str, frame: UnsealedFrame, parts: list[memoryview], ttl: int | None
    ) -> bool | None:
        """Send `frame` with its payload hashed block by block as it goes out (one pass
        over it instead of two; `RespStreams.stream_set_patched`), sealed and published
        under `key` by the server at the end.  None: it must go sealed instead (another
        party computes its checksum, or the server runs no scripts for this client)."""
        assert self.streams is not None
        if not self.capabilities.seals_frames:
            return None
        if not checksum.ready():  # a first hash on the loop would wait for the kernels to compile
            checksum.warm_up()  # (off the loop; until then frames are sealed on worker threads)
            return None
        if not frame.claim():
            return None
        tmp = layout.temp_key(self.options.prefix, name, os.urandom(8).hex())
        tmp_px = self._temp_ttl_ms(parts_len(parts))
        try:
            if await self.streams.stream_set_patched(
                key, tmp.encode("utf-8", "surrogateescape"), parts, ttl, tmp_px, frame.seal
            ):
                return True
            outcome: bool | None = False
        except PatchRefused as exc:
            self._refused(exc)
            outcome = None
        finally:
            frame.release()  # a write cut short before the seal leaves the checksum to others
        try:
            await self.client.unlink(tmp)  # whatever of it the server holds
        except FAULTS:
            pass  # it expires by itself
        return outcome

    def _refused(self, exc: PatchRefused) -> None:
        """The server will not take values hashed as they are sent: seal them first."""
        self.capabilities = dataclasses.replace(self.capabilities, seals_frames=False)
        self.patch_refusal = str(exc)
        log.warning(
            "redis %s: %s; big values are checksummed before they are sent from now on",
            redact_url(self.url),
            exc,
        )

    async def check_publishing(self, name: str) -> str | None:
        """Send one small value under `name` the way big ones go (under a temporary key,
        published by the script), then delete it: None when that works or does not apply
        (TLS, Cluster), else why not (and big values are checksummed first from now on)."""
        if self.streams is None or not self.capabilities.seals_frames:
            return self.patch_refusal
        key = layout.data_key(self.options.prefix, name)
        tmp = layout.temp_key(self.options.prefix, name, os.urandom(8).hex())
        first = bytearray(8)
        parts = [memoryview(first), memoryview(b"kvstore publishing check")]

        def patch(crc: int) -> memoryview:
            first[:] = b"%08x" % crc
            return memoryview(first)

        try:
            ok = await self.streams.stream_set_patched(
                key.encode("utf-8", "surrogateescape"), tmp.encode("utf-8", "surrogateescape"), parts, None, 60_000, patch
            )
        except PatchRefused as exc:
            self._refused(exc)
            ok = True
        finally:
            try:
                await self.client.unlink(key, tmp)
            except FAULTS as exc:  # e.g. an ACL without the temporary keys: nothing was written there
                log.debug("redis publishing check: unlink failed: %s", exc)
        return self.patch_refusal if ok else "a small value under a temporary key was not published (see the log)"

    def _temp_ttl_ms(self, nbytes: int) -> int:
        """How long a value of `nbytes` under its temporary key may wait to be published:
        twice the put's deadline, at least `TEMP_TTL_MIN` seconds."""
        return int(1000 * max(TEMP_TTL_MIN, 2 * self.options.deadline(nbytes)))

    async def _put_multi(
        self, i: int, name: str, parts: list[memoryview], size: int, ttl: int | None, ok: list[bool]
    ) -> None:
        pfx = self.options.prefix
        manifest = layout.Manifest.new(size, self.options.part_size, now=await self._server_clock())
        hkey = layout.parts_key(pfx, name)
        pieces = layout.split_parts(parts, self.options.part_size)

        async def put_piece(field: str, piece: list[memoryview]) -> None:
            async with self._big:
                await self.client.hset(hkey, field, piece[0] if len(piece) == 1 else Gathered(piece))

        await _all_settled(put_piece(f, p) for f, p in zip(manifest.fields(), pieces))
        if ttl is not None:
            await self.client.pexpire(hkey, ttl)
        old = await self.client.set(layout.data_key(pfx, name), manifest.encode(), px=ttl, get=True)
        ok[i] = True
        stale = layout.decode_manifest(old)
        if stale is not None and stale.generation != manifest.generation:
            await self.client.hdel(hkey, *stale.fields())

    # -- get ---------------------------------------------------------------------
    async def get_many(self, names: Sequence[str], alloc: Alloc | None = None) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(names)
        valid = []
        for i, name in enumerate(names):
            try:
                check_object_name(name)
            except InvalidKeyError:
                log.debug("redis get of invalid name %r: miss", name)
                continue
            valid.append(i)
        errors = 0
        sizes: dict[int, int] = {}
        if self._typical > self.options.pipeline_max:
            # objects here are big (as the last one moved was): no size round trip, every
            # object as its own concurrent GET; the deadline assumes that typical size
            small, big = [], valid
            budget = Budget(self._typical * len(valid))
        else:
            # learn sizes first (one pipelined round trip): they route each object and set
            # the deadline.  STRLEN is 0 for absent keys and empty values alike: GET tells.
            if valid and (await self._run("get", [self._strlens(names, valid, sizes)], 0))[0]:
                errors += len(valid)
            small = [i for i in valid if i in sizes and sizes[i] <= self.options.pipeline_max]
            big = [i for i in valid if sizes.get(i, 0) > self.options.pipeline_max]
            budget = Budget(sum(sizes.values()))
        groups = ([small] if small else []) + [[i] for i in big]
        jobs = [self._get_small(names, small, alloc, out, budget)] if small else []
        jobs += [self._get_big(names, i, alloc, out, budget) for i in big]
        failed = await self._run("get", jobs, budget)
        errors += sum(len(g) for g, f in zip(groups, failed) if f)
        self.counters.gets += len(names)
        self.counters.get_errors += errors
        for v in out:
            if v is None:
                self.counters.misses += 1
            else:
                self.counters.hits += 1
                self.counters.get_bytes += v.nbytes
        return out

    async def read_heads(self, names: Sequence[str], nbytes: int) -> list[memoryview | None]:
        """The first `nbytes` of each value by GETRANGE; a multi-part value's through its
        manifest, from its first part (`HEAD_OF_PART`, a server-side script; HGET of the
        whole part where scripts are refused). None: absent, a key of another type or a
        part lost (a miss), or a read that failed (counted in ``get_errors``). Nothing
        is refused for its size and nothing is quarantined: no object comes into memory.
        """
        out: list[memoryview | None] = [None] * len(names)
        valid = [i for i, n in enumerate(names) if is_object_name(n)]
        if not valid:
            return out
        pfx = self.options.prefix
        want = max(nbytes, layout.MANIFEST_LEN + 1)  # (a value of exactly MANIFEST_LEN bytes may be a manifest)

        async def job() -> None:
            pipe = self.client.pipeline(transaction=False)
            for i in valid:
                pipe.getrange(layout.data_key(pfx, names[i]), 0, want - 1)
                pipe.exists(layout.data_key(pfx, names[i]))  # (GETRANGE of no key and of b"" are alike)
            replies = await pipe.execute(raise_on_error=False)
            manifests: list[tuple[int, layout.Manifest]] = []
            for k, i in enumerate(valid):
                head, there = replies[2 * k], replies[2 * k + 1]
                if isinstance(head, Exception) or isinstance(there, Exception):
                    self._foreign(names[i], head if isinstance(head, Exception) else there)
                    continue
                if not there:
                    continue
                manifest = layout.decode_manifest(head)
                if manifest is None:
                    out[i] = memoryview(head)[:nbytes]
                else:
                    manifests.append((i, manifest))
            await _all_settled(self._head_of_parts(names[i], m, nbytes, out, i) for i, m in manifests)

        if (await self._run("get", [job()], nbytes * len(valid)))[0]:
            self.counters.get_errors += len(valid)
            return [None] * len(names)
        return out

    async def _head_of_parts(
        self, name: str, manifest: layout.Manifest, nbytes: int, out: list[memoryview | None], i: int
    ) -> None:
        """`out[i]`: the first `nbytes` of the first part `manifest` names (None if lost)."""
        hkey = layout.parts_key(self.options.prefix, name)
        field = manifest.fields()[0]
        want = min(nbytes, manifest.part_len(0))
        async with self._big:
            try:
                piece = await self.client.eval(HEAD_OF_PART, 1, hkey, field, want)
            except ResponseError:  # scripts refused (ACL, disabled): the whole part
                try:
                    piece = await self.client.hget(hkey, field)
                except ResponseError as exc:  # a key of another type at the parts' key
                    self._foreign(name, exc)
                    return
        if piece is not None and len(piece) >= want:
            out[i] = memoryview(piece)[:want]

    async def read_streamed(
        self, names: Sequence[str], open_sink: Callable[[str], StreamSink]
    ) -> list[object | None]:
        """Each value straight into the buffer its sink names (see `kvstore.backends.stream`):
        one copy from the socket on plain TCP / unix sockets, redis-py's reply otherwise."""
        sinks = [open_sink(n) for n in names]
        out: list[object | None] = [None] * len(names)
        valid = []
        for i, name in enumerate(names):
            try:
                check_object_name(name)
                valid.append(i)
            except InvalidKeyError:
                log.debug("redis get of invalid name %r: miss", name)
        streams = self.streams
        if streams is None:
            raws = await self.get_many([names[i] for i in valid])
            for i, raw in zip(valid, raws):
                out[i] = None if raw is None else stream_from_buffer(raw, sinks[i])
            return out
        got_bytes = [0]

        async def one(i: int) -> None:
            name = names[i]
            key = layout.data_key(self.options.prefix, name).encode("utf-8", "surrogateescape")
            async with self._big:
                res = await streams.stream_get(key, sinks[i], layout.MANIFEST_LEN)
            if isinstance(res, Manifest):  # a multi-part value (or a tiny frame of that length)
                raw = await self._resolve(name, bytes(res), None, Budget(0))
                res = None if raw is None else stream_from_buffer(raw, sinks[i])
            if res is not None:
                header = getattr(sinks[i], "header", None)
                got_bytes[0] += getattr(header, "plen", 0)
                self._typical = max(self._typical, getattr(header, "plen", 0))
            out[i] = res

        failed = await self._run("get", [one(i) for i in valid], Budget(self._typical * len(valid)))
        self.counters.gets += len(names)
        self.counters.get_errors += sum(failed)
        hits = sum(r is not None for r in out)
        self.counters.hits += hits
        self.counters.misses += len(names) - hits
        self.counters.get_bytes += got_bytes[0]
        return out

    async def _strlens(self, names: Sequence[str], idx: list[int], sizes: dict[int, int]) -> None:
        """Sizes of the values at `idx`; a key of another type (an error reply for that key
        alone) or a value over this reader's ``max_object_size`` is that object's miss
        (`_refuse`: left stored)."""
        pipe = self.client.pipeline(transaction=False)
        for i in idx:
            pipe.strlen(layout.data_key(self.options.prefix, names[i]))
        for i, r in zip(idx, await pipe.execute(raise_on_error=False)):
            if isinstance(r, Exception):
                self._foreign(names[i], r)
            elif not self._refuse(names[i], int(r)):
                sizes[i] = int(r)

    def _refuse(self, name: str, size: int) -> bool:
        """Whether a value of `size` bytes is over this reader's ``max_object_size``: then
        it is a miss counted in ``rejected`` (logged, saying to raise the option) and is
        left stored, never deleted: a store with a larger limit may have written it."""
        if not self.too_large(name, size):
            return False
        self.counters.rejected += 1
        return True

    def _foreign(self, name: str, exc: BaseException) -> None:
        """A key of ours holding something kvstore never writes (e.g. WRONGTYPE): a miss,
        left alone (it is not a value of ours to quarantine)."""
        self.counters.get_errors += 1
        log.warning("redis: %s is not a kvstore value (%s); served as a miss", printable_name(name), exc)

    def _place(self, data: bytes, alloc: Alloc | None) -> memoryview:
        """The reply as the caller wants it: a view of hiredis's bytes (no copy, read-only)
        without `alloc`, else copied once into the caller's buffer."""
        self._typical = len(data)
        if alloc is None:
            return memoryview(data)
        buf = _flat(alloc(len(data)))[: len(data)]
        buf[:] = data
        return buf

    async def _resolve(
        self, name: str, data: bytes | None, alloc: Alloc | None, budget: Budget
    ) -> memoryview | None:
        if data is None:
            return None
        if len(data) == layout.MANIFEST_LEN:
            manifest = layout.decode_manifest(data)
            if manifest is not None:
                if self._refuse(name, manifest.total):  # before any buffer is allocated
                    return None
                budget.nbytes += manifest.total
                return await self._get_parts(name, manifest, alloc)
        if self._refuse(name, len(data)):  # (a route that learnt no size first: TLS, Cluster)
            return None
        return self._place(data, alloc)

    async def _get_small(
        self, names: Sequence[str], idx: list[int], alloc: Alloc | None, out: list, budget: Budget
    ) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in idx:
            pipe.get(layout.data_key(self.options.prefix, names[i]))
        for i, data in zip(idx, await pipe.execute(raise_on_error=False)):
            if isinstance(data, Exception):
                self._foreign(names[i], data)
                continue
            out[i] = await self._resolve(names[i], data, alloc, budget)

    async def _get_big(
        self, names: Sequence[str], i: int, alloc: Alloc | None, out: list, budget: Budget
    ) -> None:
        if self.streams is not None:  # straight from the socket into the caller's buffer
            key = layout.data_key(self.options.prefix, names[i]).encode("utf-8", "surrogateescape")
            sink = _WholeValue(alloc, self.max_object_bytes)
            async with self._big:
                res = await self.streams.stream_get(key, sink, layout.MANIFEST_LEN)
            if sink.oversized:
                self._refuse(names[i], sink.oversized)
            elif isinstance(res, Manifest):
                out[i] = await self._resolve(names[i], bytes(res), alloc, budget)
            elif isinstance(res, memoryview):
                self._typical = res.nbytes
                out[i] = res
            return
        async with self._big:
            try:
                data = await self.client.get(layout.data_key(self.options.prefix, names[i]))
            except ResponseError as exc:  # this key's own error (WRONGTYPE), not the server's
                self._foreign(names[i], exc)
                return
        out[i] = await self._resolve(names[i], data, alloc, budget)

    async def _get_parts(
        self, name: str, manifest: layout.Manifest, alloc: Alloc | None
    ) -> memoryview | None:
        """Assemble the parts straight into one buffer (the caller's, with `alloc`)."""
        hkey = layout.parts_key(self.options.prefix, name)
        buf = _flat((alloc or bytearray_alloc)(manifest.total))[: manifest.total]
        missing = [False]

        async def fetch(index: int, field: str) -> None:
            async with self._big:
                piece = await self.client.hget(hkey, field)
            want = manifest.part_len(index)
            if piece is None or len(piece) != want:
                missing[0] = True
                return
            off = index * manifest.part_size
            buf[off : off + want] = piece

        await _all_settled(fetch(k, f) for k, f in enumerate(manifest.fields()))
        if missing[0]:
            log.debug("redis object %r lost a part (evicted, expired or overwritten): miss", name)
            return None
        return buf

    # -- contains / delete ---------------------------------------------------------
    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        out = [False] * len(names)
        self._resolve_probe()

        async def job() -> None:
            pfx = self.options.prefix
            # TYPE, not EXISTS: a key of another type holds no object of ours
            if self.streams is not None:  # one packed round trip on a raw socket
                keys = self._data_keys(names)
                async with self._lookups:  # at most `inflight` sockets: the pool keeps that many
                    types = await self.streams.types(keys)
                for i, t in enumerate(types):
                    out[i] = t == b"string"
                return
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.execute_command("TYPE", layout.data_key(pfx, n))
            for i, r in enumerate(await pipe.execute()):
                out[i] = (r.decode() if isinstance(r, bytes) else str(r)) == "string"

        await self._run("contains", [job()] if names else [], 0)
        return out

    def contains_now(self, names: Sequence[str]) -> list[bool] | None:
        """`contains_many` in one round trip on the caller's thread (`RespProbe`), or None
        (the event loop asks): TLS, Cluster, ``inline_timeout=0``, a host name the loop has
        not resolved yet, the probe busy on another thread, the tier failing on the loop,
        or backing off (`InlineGate`): after a call that failed or ran out of
        `RedisOptions.inline_timeout` (connecting and logging in count), or after two in
        a row slower than `SLOW_PROBE_SHARE` of it, for a second, doubling while it goes
        on, at most a minute.  Counts nothing: the loop counts the faults it meets.

        The gate and `_failing` are read and written from the loop and callers' threads
        without a lock: a race can only lose a step of a slow streak or time a back-off
        from a slightly different moment, never change an answer."""
        probe = self.probe
        t0 = self._clock()
        if probe is None or self._failing or not probe.resolved or not self._inline.open(t0):
            return None
        try:
            keys = self._data_keys(names)
        except UnicodeError:  # not a name we could have stored: let the loop say so
            return None
        try:
            types = probe.types(keys)
        except OSError as exc:  # RespError and TimeoutError included
            backoff = self._inline.failed(self._clock())
            if backoff:
                log.info(
                    "redis lookup on the caller's thread failed on %s (%s: %s); lookups go through the event loop for %.0f s",
                    redact_url(self.url), type(exc).__name__, exc, backoff,
                )
            return None
        if types is None:
            return None
        t1 = self._clock()
        backoff = self._inline.answered(t0, t1, SLOW_PROBE_SHARE * self.options.inline_timeout)
        if backoff:
            log.info(
                "redis lookups on %s are slow (%.1f ms for %d); they go through the event loop for %.0f s",
                redact_url(self.url), (t1 - t0) * 1e3, len(names), backoff,
            )
        return [t == b"string" for t in types]

    def contains_now_batch(self) -> int:
        return 64  # one round trip for a long prompt's miss

    def _data_keys(self, names: Sequence[str]) -> list[bytes]:
        """The keys whose ``TYPE`` says whether each name is held, as sent on a raw socket."""
        pfx = self.options.prefix
        return [layout.data_key(pfx, n).encode("utf-8", "surrogateescape") for n in names]

    def _resolve_probe(self) -> None:
        """Have the loop resolve the probe's host, in the background (a lookup on the loop
        must not wait for DNS); a failure leaves lookups on the loop and is retried later."""
        probe = self.probe
        if probe is None or probe.resolved or (self._resolving is not None and not self._resolving.done()):
            return

        async def resolve() -> None:
            try:
                await probe.resolve()
            except OSError as exc:
                log.debug("redis %s: resolving for lookups on the caller's thread failed: %s", redact_url(self.url), exc)

        self._resolving = asyncio.ensure_future(resolve())

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        out = [False] * len(names)

        async def job() -> None:
            pfx = self.options.prefix
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.execute_command("UNLINK", layout.data_key(pfx, n))
                pipe.execute_command("UNLINK", layout.parts_key(pfx, n))
            replies = await pipe.execute()
            for i in range(len(names)):
                out[i] = bool(replies[2 * i])

        failed = await self._run("delete", [job()] if names else [], 0)
        if any(failed):  # not known to be gone: counted, so no caller takes False for "was not there"
            self.counters.delete_errors += len(names)
        self.counters.deletes += sum(out)
        return out

    async def quarantine(self, name: str, reason: str, found: Defect | None = None) -> bool:
        """Delete a corrupt object; with ``found.read``, only while it still holds those
        bytes, with ``found.fails``, only while it still fails that check, with
        ``found.absent``, only while it still reads as absent (a part lost);
        ``found.since`` tells nothing here (no change time to compare).

        The check and the delete are one optimistic transaction: the object's key is
        WATCHed, read and compared (a multi-part value: its parts, through the manifest),
        then UNLINKed with its generation's parts in MULTI/EXEC, which Redis refuses if
        any write reached the key in between (a repair, a rewrite: that copy stays).
        """
        if found is None or not found.conditional:
            return await super().quarantine(name, reason)
        pfx = self.options.prefix
        dkey, hkey = layout.data_key(pfx, name), layout.parts_key(pfx, name)

        async def compare_and_delete() -> bool:
            async with self.client.pipeline(transaction=True) as pipe:
                await pipe.watch(dkey)
                head = await pipe.execute_command("GET", dkey)
                if head is None:
                    return False
                manifest = layout.decode_manifest(head)
                if manifest is not None and manifest.total > self.max_object_bytes:
                    return False  # too large for this reader to read back: not proven to be what was found
                if not (found.matches(head) if manifest is None else await self._still(name, found)):
                    return False  # (a multi-part value: read through its parts)
                pipe.multi()
                pipe.execute_command("UNLINK", dkey)  # (a cluster pipeline's unlink() is a coroutine)
                if manifest is not None:
                    pipe.execute_command("HDEL", hkey, *manifest.fields())
                await pipe.execute()
                return True

        try:
            size = len(found.read) if found.read is not None else self.max_object_bytes  # (incomplete: what is left)
            done = await asyncio.wait_for(compare_and_delete(), self.options.deadline(size))
        except WatchError:
            return False  # written since it was read: the new copy stays
        except FAULTS as exc:
            self._fault("quarantine", exc)
            return False
        if not done:
            return False
        self.counters.deletes += 1
        self.counters.quarantined += 1
        log.warning("redis: quarantined (deleted) %s: %s", printable_name(name), reason)
        return True

    # -- listing / stats -------------------------------------------------------------
    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Objects whose name starts with `prefix`, with sizes (multi-part: total length).

        A server fault ends the listing early (logged and counted) and is recorded in
        ``unlisted``, so every command reports the listing incomplete; it does not raise.
        """
        pfx = self.options.prefix
        pattern = layout.scan_pattern(pfx, prefix)
        batch: builtins.list[str] = []
        try:
            async for raw in self.client.scan_iter(match=pattern, count=1000):
                key = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
                name = layout.name_of_key(pfx, key)
                if name is None or not name.startswith(prefix):
                    continue
                batch.append(name)
                if len(batch) >= 500:
                    for info in await self._sizes(batch):
                        yield info
                    batch = []
            for info in await self._sizes(batch):
                yield info
        except FAULTS as exc:
            self.counters.get_errors += 1
            self._fault("list", exc)
            where = redact_url(self.url) + (f" under {printable_name(prefix)!r}" if prefix else "")
            self.unlisted.append(
                (
                    f"the rest of the listing of {where}",
                    f"{type(exc).__name__}: {redact_text(str(exc))}; the listing stopped part way, so objects "
                    "after that point were not listed: rerun once Redis answers",
                )
            )

    async def _sizes(self, names: builtins.list[str]) -> builtins.list[ObjectInfo]:
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.getrange(layout.data_key(self.options.prefix, n), 0, layout.MANIFEST_LEN)
            pipe.strlen(layout.data_key(self.options.prefix, n))
        replies = await asyncio.wait_for(pipe.execute(raise_on_error=False), self.options.timeout)
        out = []
        for k, n in enumerate(names):
            head, size = replies[2 * k], replies[2 * k + 1]
            if isinstance(head, Exception) or isinstance(size, Exception):
                err = head if isinstance(head, Exception) else size
                self.unlisted.append((n, f"not a kvstore value: {err}"))
                continue
            size = int(size)
            if size == 0:
                continue  # expired or deleted since SCAN saw it
            manifest = layout.decode_manifest(head) if size == layout.MANIFEST_LEN else None
            out.append(ObjectInfo(n, manifest.total if manifest else size, 0.0))
        return out

    async def _server_clock(self, *, fresh: bool = False) -> float:
        """The server's clock (TIME), as this host's clock plus an offset asked for at most
        every `CLOCK_REFRESH_S` (or now, `fresh`): multi-part writes stamp their generation
        with it and garbage collection ages parts by it, so hosts' clocks need not agree.
        This host's clock where TIME is not allowed."""
        now = time.time()
        if fresh or self._clock_asked is None or now - self._clock_asked > CLOCK_REFRESH_S:
            try:
                sec, usec = await asyncio.wait_for(self.client.time(), self.options.timeout)
                self._clock_offset = sec + usec / 1e6 - time.time()
            except Exception as exc:  # a denied TIME, a fault: this host's clock will do
                log.warning("redis TIME failed on %s (%s); multi-part writes and gc use this host's clock",
                            redact_url(self.url), exc)
            self._clock_asked = now
        return now + self._clock_offset

    async def collect_garbage(self, grace_s: float | None = None) -> int:
        """Delete parts no manifest points at any more; return how many fields went.

        Orphans arise when a multi-part object is overwritten by a big single-part value
        (that put skips the extra round trip to drop old parts) or when a writer died
        between its parts and its manifest.  Safe beside writers in other processes: a
        part goes only when its generation is not the one the object's manifest names
        *and* its write began more than `grace_s` ago (default: twice the deadline of a
        put of the largest object, at least an hour), so a put between its parts and its
        manifest, or one that publishes while this runs, keeps its parts.  Parts written
        before generations carried their time count as old.
        """
        pfx = self.options.prefix
        removed = 0
        if grace_s is None:
            grace_s = max(GC_GRACE_MIN, 2 * self.options.deadline(self.max_object_bytes))
        pattern = layout.glob_escape(pfx + "{") + "*" + layout.glob_escape("}" + layout.PARTS_SUFFIX)
        now = await self._server_clock(fresh=True)  # (as the scan starts: later writes only look younger)
        try:
            async for raw in self.client.scan_iter(match=pattern, count=1000):
                hkey = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
                name = hkey[len(pfx) + 1 : -len("}" + layout.PARTS_SUFFIX)]
                # the manifest first, the fields after: a generation published after the
                # manifest was read is young, so kept below
                head = await self.client.getrange(layout.data_key(pfx, name), 0, layout.MANIFEST_LEN)
                manifest = layout.decode_manifest(head)
                live = manifest.generation.hex() if manifest is not None else None
                stale = []
                for f in await self.client.hkeys(hkey):
                    if layout.generation_hex(f) == live:
                        continue
                    age = layout.generation_age(f, now)
                    if age is None or age > grace_s:
                        stale.append(f)
                if stale:
                    removed += int(await self.client.hdel(hkey, *stale))
        except FAULTS as exc:
            self._fault("gc", exc)
        return removed

    async def retention_risks(self) -> builtins.list[str]:
        """Expiry this backend sets (``ttl=``, ``ttl.<namespace>=``), a server that keeps
        no append-only file (a restart loses what it held), and the server's own
        eviction: ``maxmemory-policy`` from CONFIG GET on every primary, or from INFO
        where CONFIG is not allowed (managed Redis).  ``volatile-*`` policies evict only
        keys with an expiry, which this backend sets only under a TTL; ``allkeys-*``
        policies evict anything once ``maxmemory`` is reached (or set later), so they
        count whatever ``maxmemory`` is now.  A server that answers neither is a risk too.
        """
        where = redact_url(self.url)
        risks: builtins.list[str] = []
        if self.options.ttl is not None:
            risks.append(
                f"{where} sets every object to expire after ttl={self.options.ttl:g}s; drop ?ttl= from the URL"
            )
        for ns, ttl in self.options.ttl_by_namespace:
            if ttl > 0:
                risks.append(
                    f"{where} sets objects of namespace {printable_name(ns)!r} to expire after "
                    f"ttl.{printable_name(ns)}={ttl:g}s; drop that option"
                )
        try:
            policies = await asyncio.wait_for(self._maxmemory_policies(), self.options.deadline(0))
        except Exception as exc:  # any failure to answer leaves the policy unknown: a risk
            return [
                *risks,
                f"cannot ask Redis at {where} for its maxmemory-policy (CONFIG GET and INFO failed: "
                f"{type(exc).__name__}: {exc}), so it may evict; allow CONFIG GET or INFO for this user",
            ]
        for node, (policy, maxmemory) in sorted(policies.items()):
            if policy.startswith("allkeys-"):
                label = f"at {where}" if node == "server" else f"node {node} of {where}"
                risks.append(
                    f"Redis {label} evicts any key when memory is full (maxmemory-policy {policy}, "
                    f"maxmemory {maxmemory}); set maxmemory-policy noeviction "
                    "(CONFIG SET maxmemory-policy noeviction, or in redis.conf)"
                )
        try:
            aof = await asyncio.wait_for(self._append_only(), self.options.deadline(0))
        except Exception as exc:
            return [
                *risks,
                f"cannot ask Redis at {where} whether it persists writes (INFO persistence failed: "
                f"{type(exc).__name__}: {exc}), so a restart may lose them; allow INFO for this user",
            ]
        for node, enabled in sorted(aof.items()):
            if not enabled:
                label = f"at {where}" if node == "server" else f"node {node} of {where}"
                risks.append(
                    f"Redis {label} keeps no append-only file (appendonly no), so a restart loses what "
                    "was written since its last snapshot, if any; set appendonly yes "
                    "(CONFIG SET appendonly yes, or in redis.conf), or, where the server cannot persist "
                    "(a managed cache), keep the source"
                )
        return risks

    async def make_durable(self, names: Sequence[str] | None = None) -> None:
        """Wait until what was written is in the server's append-only file on its disk:
        ``WAITAOF`` (Redis 7.2+) after one more write on the same connection, whose place
        in the file is past every earlier write's, `names` written by anyone before
        included (the file is one, synced whole). Where WAITAOF is not there (an older
        server, a cluster), wait out ``appendfsync everysec``, Redis's default, which
        syncs once a second."""
        if not self.cluster:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(f"{self.options.prefix}durable-barrier", repr(time.time()), px=60_000)
            pipe.execute_command("WAITAOF", 1, 0, int(WAITAOF_TIMEOUT_S * 1000))
            try:
                _, synced = await pipe.execute()
            except ResponseError:  # no WAITAOF before Redis 7.2
                await asyncio.sleep(AOF_SYNC_WAIT_S)
                return
            if int(synced[0]) < 1:
                raise ValueError(
                    f"Redis at {redact_url(self.url)} did not sync its append-only file within "
                    f"{WAITAOF_TIMEOUT_S:g}s (WAITAOF)"
                )
            return
        await asyncio.sleep(AOF_SYNC_WAIT_S)

    async def _append_only(self) -> dict[str, bool]:
        """{node: whether its append-only file is on} of every primary (INFO persistence)."""
        target = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        answer = await self.client.info("persistence", **target)
        if self.cluster and isinstance(answer, dict) and all(isinstance(v, dict) for v in answer.values()):
            nodes = {str(k.decode() if isinstance(k, bytes) else k): v for k, v in answer.items()}
        else:
            nodes = {"server": dict(answer)}
        return {node: str(info.get("aof_enabled", "0")) == "1" for node, info in nodes.items()}

    async def _maxmemory_policies(self) -> dict[str, tuple[str, str]]:
        """{node: (maxmemory-policy, maxmemory)} of every primary."""

        def text(v: Any) -> str:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)

        def per_node(answer: Any) -> dict[str, dict[str, Any]]:
            if (
                self.cluster
                and isinstance(answer, dict)
                and all(isinstance(v, dict) for v in answer.values())
            ):
                return {text(k): {text(a): b for a, b in v.items()} for k, v in answer.items()}
            return {"server": {text(a): b for a, b in dict(answer).items()}}

        target = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        out: dict[str, tuple[str, str]] = {}
        try:
            for node, conf in per_node(await self.client.config_get("maxmemory*", **target)).items():
                out[node] = (text(conf["maxmemory-policy"]), text(conf.get("maxmemory", "?")))
            return out
        except (ResponseError, KeyError):  # CONFIG renamed or denied: INFO memory says the same
            pass
        for node, info in per_node(await self.client.info("memory", **target)).items():
            out[node] = (text(info["maxmemory_policy"]), text(info.get("maxmemory", "?")))
        return out

    async def check(self) -> None:
        """PING within the connect deadline; raise `BackendUnavailableError` saying what to fix."""
        try:
            await asyncio.wait_for(self.client.ping(), self.options.deadline(0))
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            hint = (
                "check the password / ACL user (URL or KVSTORE_REDIS_USERNAME / KVSTORE_REDIS_PASSWORD)"
                if "auth" in detail.lower() or "password" in detail.lower()
                else "is redis-server running there, and is the host:port / socket path right?"
            )
            raise BackendUnavailableError(
                f"Redis at {redact_url(self.url)} is unusable ({detail}); {hint}"
            ) from exc

    async def refresh_stats(self) -> BackendStats:
        """Ask the server(s) for key count and memory use, then return `stats()`."""

        async def job() -> None:
            if self.cluster:
                sizes = await self.client.dbsize(target_nodes=RedisCluster.PRIMARIES)
                mems = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                keys = sum(sizes.values()) if isinstance(sizes, dict) else int(sizes)
                used = sum(m.get("used_memory", 0) for m in mems.values()) if isinstance(mems, dict) else 0
            else:
                keys = await self.client.dbsize()
                used = (await self.client.info("memory")).get("used_memory", 0)
            self._server = {"server_keys": int(keys), "server_used_memory": int(used)}

        await self._run("stats", [job()], 0)
        return self.stats()

    def key_space(self) -> tuple[str, str] | None:
        """The server (host and port or socket path, and database, as the client connects)
        and this store's keys' start there, ``PREFIX{``: keys are ``PREFIX{name}``, so
        ``x:`` and ``x:y:`` share none. None for a cluster (its seeds need not be the
        nodes; the probe object still tells one store under two URLs)."""
        if self.cluster:
            return None
        kw = self.client.connection_pool.connection_kwargs
        path = kw.get("path")
        where = f"unix:{path}" if path else f"{str(kw.get('host', 'localhost')).lower()}:{kw.get('port', 6379)}"
        return f"redis:{where}/{int(kw.get('db') or 0)}", self.options.prefix + "{"

    def stats(self) -> BackendStats:
        """Counters plus the server figures of the last `refresh_stats` (no I/O here).

        ``objects``/``bytes`` are not filled: counting them needs a SCAN of the keyspace;
        ``extra`` holds the server's key count (objects plus their parts hashes and any
        foreign keys) and memory use.
        """
        extra = {"cluster": self.cluster, "prefix": self.options.prefix, **self._server}
        return BackendStats(url=redact_url(self.url), counters=self.counters, extra=extra)

    async def close(self) -> None:
        if self.streams is not None:
            self.streams.close()
        if self.probe is not None:
            self.probe.close()
        if self._resolving is not None:
            self._resolving.cancel()
        try:
            if self.cluster:
                await self.client.aclose()
            else:
                await self.client.aclose(close_connection_pool=True)
        except FAULTS as exc:
            log.debug("redis close: %s", exc)


__all__ = ["RedisBackend", "RedisOptions", "parse_options"]
