"""The S3 backend: objects in an S3-compatible bucket through one aiobotocore client.

Owns: ``s3://bucket/prefix?...`` storage (AWS S3, MinIO, SeaweedFS, Ceph RGW): batched
put/get/contains/delete/list with bounded concurrency, multipart uploads with parts in
parallel, parallel ranged GETs into one preallocated buffer, DeleteObjects batches,
paginated listings, the open-time bucket/credentials check, the per-operation deadline
and the circuit breaker.  Must not touch: frames, codecs, tensors, placement policy;
retry timing (botocore's ``standard``/``adaptive`` retry modes do that per request).

Settings are URL options, see `kvstore.backends.s3_options`.  Credentials come from the
standard AWS chain (environment, profile, config files, instance role).

Faults: every failed object operation (after botocore's retries, or past the
``timeout`` deadline, or refused by an open breaker) is counted in ``stats()`` and is a
False / None for the caller; nothing raises out of put/get/contains/delete.  `open()`
(also run on first use) raises `S3OpenError` with the fix for a missing bucket, rejected
credentials or an unreachable endpoint; on first use the same message is logged once.
`list()` raises `S3OpenError`/`S3ListError` (both `BackendUnavailableError`s, so the
command line exits 3 with the message): a listing silently cut short would make
migration or garbage collection act on half the objects.

Multipart uploads never outlive their put: a part that fails, a deadline that passes or a
cancellation cancels the other parts (the put returns once none sends from the caller's
buffers), then aborts the upload (and aborts again while ListParts still finds it, as S3
allows a part in flight to land after an abort) in a task of its own, in the background
so the put keeps its deadline; `close()` waits for it.  An upload a killed process left
behind is removed by `abort_stale_uploads` (``kvstore gc``).

Integrity: each frame carries its own CRC32C checksum, so by default botocore's own
request checksums are off (``checksum=when_required``); ``checksum=when_supported``
turns CRC32 on for every request (about 40% fewer PUT MiB/s on this machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import os
import secrets
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import aiohttp
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvstore.backends.base import (
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
    redact_url,
)
from kvstore.backends.breaker import CircuitBreaker
from kvstore.backends.s3_body import PartsBody, ShortBody, read_into, slice_parts
from kvstore.backends.s3_options import S3Options
from kvstore.backends.s3_stream import Op, Opened, S3Streams, Settled, Stopped
from kvstore.backends.stream import StreamSink, wait_out
from kvstore.keys import PROBE_PREFIX, InvalidKeyError, check_object_name, printable_name
from kvstore.redact import redact_text

log = logging.getLogger(__name__)
T = TypeVar("T")

DELETE_BATCH = 1000  # the DeleteObjects maximum
PRESIGN_MIN, PRESIGN_MAX = 900, 604800  # seconds a presigned URL lives: skew margin; SigV4's limit
_FAILED = object()  # an operation that failed (counted); distinct from a miss (None)


class S3OpenError(BackendUnavailableError):
    """The bucket cannot be used as configured; the message says what to fix."""


class S3ListError(BackendUnavailableError):
    """A listing failed part way; the message names the cause and what to do."""


class _Missing(Exception):
    """The object does not exist (a miss, not a fault)."""


def error_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError, else ("", 0)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def error_kind(exc: BaseException) -> str:
    """A short, stable name for a failure, used as a counter key in `stats()`."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        if code in ("NoSuchKey", "NotFound", "404") or (status == 404 and code != "NoSuchBucket"):
            return "not_found"
        if code == "NoSuchBucket":
            return "no_bucket"
        if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded") or status == 429:
            return "throttled"
        if status >= 500:
            return "server_error"
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or status == 403:
            return "denied"
        if code == "PreconditionFailed" or status == 412:
            return "changed"
        return "client_error"
    if isinstance(exc, NoCredentialsError):
        return "no_credentials"
    if isinstance(exc, ShortBody):
        return "short_body"
    if isinstance(exc, (OSError, aiohttp.ClientError, BotoCoreError, http.client.HTTPException)):
        return "connection"  # refused, reset, DNS, read timeouts, broken streams
    return "other"


def explain_open_error(exc: BaseException, options: S3Options) -> str:
    """What went wrong opening the bucket, and what to do about it."""
    where = redact_url(options.endpoint_url) if options.endpoint_url else "AWS S3"
    bucket = options.bucket
    kind = error_kind(exc)
    code, status = error_code(exc)
    if kind == "no_bucket":
        return (
            f"bucket {bucket!r} does not exist at {where}; create it "
            f"(aws s3 mb s3://{bucket}{' --endpoint-url ' + where if options.endpoint_url else ''}) "
            "or fix the bucket name in the URL"
        )
    if kind == "denied":
        return (
            f"{where} rejected the credentials for bucket {bucket!r} ({code or status}); set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / profile=) to a key "
            "that may read, write and list this bucket"
        )
    if kind == "no_credentials":
        return (
            "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE / profile= in the URL"
        )
    if kind in ("connection", "timeout"):
        return (
            f"cannot reach {where} ({type(exc).__name__}: {redact_text(str(exc))}); check endpoint_url= in the URL "
            "and that the server is running"
        )
    return f"cannot use bucket {bucket!r} at {where}: {type(exc).__name__}: {redact_text(str(exc))}"


class S3Backend(Backend):
    """Objects under ``prefix/`` in one bucket; see the module docstring."""

    schemes = ("s3",)
    capabilities = Capabilities(ranged_reads=True, streamed_reads=True, cancels_cleanly=True)

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        super().__init__(url)
        self.options = options or S3Options.from_url(url)
        o = self.options
        # streamed GETs and PUTs speak HTTP themselves: no proxies, no botocore checksums
        if not o.stream or o.checksum == "when_supported" or _proxied(o):
            self.capabilities = Capabilities(ranged_reads=True)
        self.max_object_bytes = o.max_object_size
        self.breaker = CircuitBreaker(
            failure_threshold=o.breaker_failures,
            reset_after=o.breaker_reset,
            max_reset_after=max(30.0, o.breaker_reset),
        )
        self.errors: Counter[str] = Counter()
        self.last_open_error: str | None = None
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._sem: asyncio.Semaphore | None = None
        self._verified = False
        self._closed = False
        self._cleanups: set[asyncio.Task[None]] = set()  # multipart aborts still running
        self._streams: S3Streams | None = None  # streamed GETs (`read_streamed`)
        self._threads: ThreadPoolExecutor | None = None
        self._ca_bundle: str | None = None
        self._conditional_delete: bool | None = None  # does the server honour If-Match on DELETE?
        self._probe_lock: asyncio.Lock | None = None

    @classmethod
    def from_url(cls, url: str) -> S3Backend:
        return cls(url)

    # -- client lifecycle ------------------------------------------------------------

    async def _get_client(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._client is not None and self._loop is loop:
            return self._client
        if self._closed:
            raise RuntimeError("S3Backend is closed")
        if self._lock is None or self._loop is not loop:
            # first use, or a new event loop: a client belongs to the loop it was opened in
            self._lock, self._loop, self._client, self._verified = asyncio.Lock(), loop, None, False
            self._probe_lock = None  # (a lock belongs to its loop)
        async with self._lock:
            if self._client is None:
                from aiobotocore.session import get_session

                o = self.options
                session = get_session()
                if o.profile:
                    session.set_config_variable("profile", o.profile)
                self._ca_bundle = session.get_config_variable("ca_bundle")
                stack = contextlib.AsyncExitStack()
                self._client = await stack.enter_async_context(
                    session.create_client(
                        "s3", endpoint_url=o.endpoint_url, region_name=o.region, config=o.botocore_config()
                    )
                )
                self._stack = stack
                self._sem = asyncio.Semaphore(o.concurrency)
                endpoint = getattr(getattr(self._client, "meta", None), "endpoint_url", None)
                if self.capabilities.streamed_reads and endpoint and _proxied_endpoint(endpoint):
                    # the endpoint botocore resolved (a profile's) is reached through a proxy,
                    # which streamed requests do not speak: botocore's requests only
                    self.capabilities = Capabilities(ranged_reads=True)
        return self._client

    async def open(self) -> S3Backend:
        """Open the client and check the bucket; raise `S3OpenError` saying what to fix."""
        if self._closed:
            raise RuntimeError("S3Backend is closed")
        o = self.options
        try:
            client = await self._get_client()
            await asyncio.wait_for(
                client.list_objects_v2(Bucket=o.bucket, Prefix=o.key(""), MaxKeys=1), o.timeout
            )
        except Exception as exc:
            raise S3OpenError(explain_open_error(exc, o)) from exc
        self._verified = True
        self.last_open_error = None
        return self

    async def __aenter__(self) -> S3Backend:
        return await self.open()

    async def check(self) -> None:
        await self.open()

    async def read_heads(self, names: Sequence[str], nbytes: int) -> list[memoryview | None]:
        """First `nbytes` of each object by one ranged GET each (frame headers for ls/stat/gc)."""
        if not names or not await self._ready():
            return [None] * len(names)
        client, o = self._client, self.options

        async def one(name: str) -> memoryview | None:
            assert self._sem is not None  # set by _ready()
            try:
                async with self._sem:
                    resp = await asyncio.wait_for(
                        client.get_object(Bucket=o.bucket, Key=o.key(name), Range=f"bytes=0-{nbytes - 1}"),
                        o.timeout,
                    )
                    async with resp["Body"] as body:
                        return memoryview(await asyncio.wait_for(body.read(), o.timeout))
            except Exception:
                return None

        return list(await asyncio.gather(*(one(n) for n in names)))

    async def _ready(self) -> bool:
        """First-use check; False (logged once per distinct cause) when the bucket is unusable."""
        if self._verified and self._loop is asyncio.get_running_loop():
            return True
        if not self.breaker.allow():
            self.errors["breaker_open"] += 1
            return False
        ok = False
        try:
            await self.open()
            ok = True
        except S3OpenError as exc:
            if str(exc) != self.last_open_error:
                log.error("S3 backend %s: %s", redact_url(self.url), exc)
            self.last_open_error = str(exc)
            self.errors[error_kind(exc.__cause__ or exc)] += 1
        finally:
            self.breaker.record(ok)
        return ok

    async def close(self) -> None:
        self._closed = True
        if self._cleanups and self._loop is asyncio.get_running_loop():
            await asyncio.wait(set(self._cleanups), timeout=2 * self.options.timeout)
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None and self._loop is asyncio.get_running_loop():
            await stack.aclose()
        if self._threads is not None:
            self._threads.shutdown(wait=False)
        if self._streams is not None:
            self._streams.close()

    # -- guarded operations ----------------------------------------------------------

    async def _request(self, fn: Callable[..., Awaitable[T]], **kw: Any) -> T:
        """One S3 request inside the concurrency limit (botocore retries it)."""
        assert self._sem is not None
        async with self._sem:
            return await fn(**kw)

    async def _guarded(self, op: Callable[[], Awaitable[T]]) -> T | object | None:
        """Run one object operation under the breaker and the deadline.

        Returns its value, None for a missing object, or `_FAILED` (counted by kind).
        """
        if not self.breaker.allow():
            self.errors["breaker_open"] += 1
            return _FAILED
        ok = False
        stopped = False
        try:
            value = await asyncio.wait_for(op(), self.options.timeout)
            ok = True
            return value
        except asyncio.CancelledError:  # the caller stopped waiting: no word on the server
            stopped = True
            raise
        except _Missing:
            ok = True
            return None
        except Exception as exc:
            kind = error_kind(exc)
            if kind == "not_found":
                ok = True
                return None
            self.errors[kind] += 1
            ok = kind == "changed"  # (412: rewritten under a read: the server answered, a miss, no fault)
            if kind == "other":  # not a server or network fault: most likely a bug, show it
                log.warning("S3 operation failed unexpectedly", exc_info=exc)
            else:
                log.debug("S3 operation failed (%s): %r", kind, exc)
            return _FAILED
        finally:
            if not stopped:
                self.breaker.record(ok)

    # -- put ---------------------------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]:
        out = [False] * len(items)
        jobs: list[tuple[int, str, list[memoryview]]] = []
        for i, (name, value) in enumerate(items):
            try:
                key = self.options.key(check_object_name(name))
            except InvalidKeyError:
                self.counters.put_errors += 1
                continue
            parts = as_parts(value)
            if self.too_large(name, sum(p.nbytes for p in parts)):
                self.counters.rejected += 1
                self.counters.put_errors += 1
                continue
            jobs.append((i, key, parts))
        if not jobs:
            return out
        if not await self._ready():
            self.counters.put_errors += len(jobs)
            return out
        results = await asyncio.gather(*(self._guarded(partial(self._put_one, k, p)) for _, k, p in jobs))
        for (i, _, parts), res in zip(jobs, results):
            if res is True:
                out[i] = True
                self.counters.puts += 1
                self.counters.put_bytes += sum(p.nbytes for p in parts)
            else:
                self.counters.put_errors += 1
        return out

    async def _put_one(self, key: str, parts: list[memoryview]) -> bool:
        o, client = self.options, self._client
        size = sum(p.nbytes for p in parts)
        streamed = self.capabilities.streamed_reads  # the `stream` option: reads and writes
        if size <= o.multipart_threshold:
            if streamed:
                await self._put_streamed(key, parts, "put_object", {})
            else:
                await self._request(client.put_object, Bucket=o.bucket, Key=key, Body=PartsBody(parts))
            return True
        upload = await self._request(client.create_multipart_upload, Bucket=o.bucket, Key=key)
        upload_id = upload["UploadId"]
        bounds = part_bounds(size, o.part_size)

        async def part(number: int, lo: int, hi: int) -> dict[str, Any]:
            if streamed:
                body = slice_parts(parts, lo, hi)
                etag = await self._put_streamed(key, body, "upload_part", {"UploadId": upload_id, "PartNumber": number})
                return {"PartNumber": number, "ETag": etag}
            resp = await self._request(
                client.upload_part,
                Bucket=o.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=PartsBody(slice_parts(parts, lo, hi)),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        tasks = [asyncio.ensure_future(part(*b)) for b in bounds]
        try:
            done = await asyncio.gather(*tasks)
            await self._request(
                client.complete_multipart_upload,
                Bucket=o.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": list(done)},
            )
        except BaseException:
            # the upload must not outlive this put (its parts are stored, and billed, until
            # aborted): the other parts are stopped first, waited for through any further
            # cancellation (they send from the caller's buffers); the abort then runs on in
            # the background (up to three rounds of requests: the put keeps its deadline),
            # and close() waits for it
            stopping = self._spawn(self._stop_parts(tasks))
            await wait_out(stopping)
            self._spawn(self._abort_quietly(client, key, upload_id))
            raise
        return True

    async def _put_streamed(self, key: str, body: list[memoryview], operation: str, params: dict[str, Any]) -> str:
        """PUT `body` through a presigned `operation` URL on a worker thread (see
        `kvstore.backends.s3_stream`); its ETag.  A cancelled caller (the deadline, or a
        failed sibling part) stops the send and waits for the thread (it sends from the
        caller's buffers)."""
        o = self.options
        streams, threads = self._stream_pool()
        loop = asyncio.get_running_loop()
        op = Op(time.monotonic() + o.timeout)
        assert self._sem is not None
        async with self._sem:
            url = await self._presign(operation, {"Bucket": o.bucket, "Key": key, **params})
            (done,) = await _settled([loop.run_in_executor(threads, streams.put, url, body, op)], op)
        etag = _value(done)
        if not etag:
            raise ShortBody(f"{operation} answered without an ETag")
        return cast(str, etag)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _stop_parts(self, parts: Sequence[asyncio.Future[Any]]) -> None:
        """Cancel a multipart put's part requests and wait until none is sending."""
        for t in parts:
            t.cancel()
        await asyncio.wait(parts)  # no part request may still be sending once the abort goes
        for t in parts:
            if not t.cancelled():
                t.exception()  # retrieved: the put raises its own failure

    async def _abort_quietly(self, client: Any, key: str, upload_id: str) -> None:
        await self._abort(client, key, upload_id)

    async def _abort(self, client: Any, key: str, upload_id: str) -> bool:
        """Abort one multipart upload and see it gone (ListParts: NoSuchUpload); True if it
        is.  S3 may keep a part that was in flight during an abort, so abort again while
        ListParts still answers.  A failure is counted (``upload_abort_failed``) and logged;
        ``kvstore gc`` removes what stays."""
        o = self.options
        ids = {"Bucket": o.bucket, "Key": key, "UploadId": upload_id}
        why = "still listed after three aborts"
        for _ in range(3):
            try:
                await asyncio.wait_for(client.abort_multipart_upload(**ids), o.timeout)
            except Exception as exc:
                if error_kind(exc) != "not_found":
                    why = f"{type(exc).__name__}: {redact_text(str(exc))}"
                    break
            try:
                await asyncio.wait_for(client.list_parts(**ids, MaxParts=1), o.timeout)
            except Exception as exc:
                if error_kind(exc) == "not_found":
                    return True
                why = f"{type(exc).__name__}: {redact_text(str(exc))}"
                break
        self.errors["upload_abort_failed"] += 1
        log.warning(
            "S3 multipart upload %s of %s could not be aborted (%s); kvstore gc removes it later",
            upload_id,
            printable_name(o.name(key)),
            why,
        )
        return False

    # -- retention ---------------------------------------------------------------------

    async def retention_risks(self) -> list[str]:
        """The bucket's lifecycle rules that expire objects under this backend's prefix, or
        move them to a storage class GET cannot read (GetBucketLifecycleConfiguration).
        A rule filtered on tags never matches (kvstore writes no tags); size filters are
        taken to match.  No configuration, or a server without lifecycle support, keeps
        everything; a bucket that will not say is a risk."""
        where = redact_url(self.url)
        if not await self._ready():
            return [f"cannot reach {where} to read its bucket's lifecycle rules ({self.last_open_error})"]
        o = self.options
        try:
            answer = await asyncio.wait_for(
                self._client.get_bucket_lifecycle_configuration(Bucket=o.bucket), o.timeout
            )
        except Exception as exc:
            code, status = error_code(exc)
            if code in ("NoSuchLifecycleConfiguration", "NotImplemented") or status == 501:
                return []
            return [
                f"cannot read the lifecycle rules of bucket {o.bucket!r} at {where} "
                f"({type(exc).__name__}: {redact_text(str(exc))}), which may expire objects; "
                "allow s3:GetLifecycleConfiguration"
            ]
        base = o.key("")
        risks = []
        for rule in answer.get("Rules", ()):
            if rule.get("Status") != "Enabled":
                continue
            flt = rule.get("Filter", {})
            scope = flt.get("And", flt)
            if scope.get("Tag") or scope.get("Tags"):
                continue
            prefix = str(scope.get("Prefix", rule.get("Prefix", "")) or "")
            if not (base.startswith(prefix) or prefix.startswith(base)):
                continue
            what = []
            expiry = rule.get("Expiration", {})
            if "Days" in expiry or "Date" in expiry:
                when = f"{expiry['Days']} days" if "Days" in expiry else f"{expiry['Date']}"
                what.append(f"expires objects after {when}")
            for move in rule.get("Transitions", ()):
                when = f"{move['Days']} days" if "Days" in move else f"{move.get('Date')}"
                what.append(f"moves objects to {move.get('StorageClass')} after {when}")
            if what:
                risks.append(
                    f"lifecycle rule {str(rule.get('ID', '?'))!r} of bucket {o.bucket!r} (prefix {prefix!r}) "
                    f"{' and '.join(what)}; remove it or narrow it to a prefix outside {base or 'the bucket'!r}"
                )
        return risks

    # -- incomplete uploads ------------------------------------------------------------

    async def abort_stale_uploads(
        self, older_than_s: float, *, dry_run: bool = False
    ) -> tuple[int, list[str]]:
        """Abort the multipart uploads under this backend's prefix that started more than
        `older_than_s` seconds ago (by the server's clock): those of writers killed or cut
        off mid-upload, whose parts the server keeps until aborted.  Returns how many were
        aborted (with `dry_run`: would be) and the names of those that could not be.
        Uploads still running are younger than any sensible threshold: a multipart put
        ends, or is aborted, within its ``timeout``.  A listing that fails is recorded in
        ``unlisted``."""
        if not await self._ready():
            self.unlisted.append((f"multipart uploads in {redact_url(self.url)}", "bucket not reachable"))
            return 0, []
        o, client = self.options, self._client
        kw: dict[str, Any] = {"Bucket": o.bucket, "Prefix": o.key("")}
        uploads: list[tuple[str, str]] = []
        try:
            while True:
                page = await asyncio.wait_for(self._request(client.list_multipart_uploads, **kw), o.timeout)
                now = _server_time(page)
                for up in page.get("Uploads", ()):
                    if now - up["Initiated"].timestamp() > older_than_s:
                        uploads.append((up["Key"], up["UploadId"]))
                if not page.get("IsTruncated"):
                    break
                kw["KeyMarker"] = page.get("NextKeyMarker", "")
                kw["UploadIdMarker"] = page.get("NextUploadIdMarker", "")
        except Exception as exc:
            self.errors[error_kind(exc)] += 1
            self.unlisted.append(
                (
                    f"multipart uploads in {redact_url(self.url)}",
                    f"{type(exc).__name__}: {redact_text(str(exc))}",
                )
            )
        if dry_run:
            return len(uploads), []

        async def abort(key: str, upload_id: str) -> bool:
            assert self._sem is not None
            async with self._sem:
                return await self._abort(client, key, upload_id)

        results = await asyncio.gather(*(abort(k, u) for k, u in uploads))
        stale = [o.name(k) for (k, _), ok in zip(uploads, results) if not ok]
        return sum(results), stale

    # -- get ---------------------------------------------------------------------------

    async def get_many(self, names: Sequence[str], alloc: Alloc | None = None) -> list[memoryview | None]:
        jobs = await self._get_jobs(names)
        allocate = alloc or bytearray_alloc
        results = await asyncio.gather(*(self._guarded(partial(self._get_one, k, allocate)) for _, k in jobs))
        got = [(r, r.nbytes) if isinstance(r, memoryview) else (r, 0) for r in results]
        return cast(list[memoryview | None], self._count_gets(len(names), jobs, got))

    async def _get_jobs(self, names: Sequence[str]) -> list[tuple[int, str]]:
        """Count a get of every name; (index, key) of those to read.  An invalid name, or
        every name while the bucket is unusable, is a counted error and miss."""
        self.counters.gets += len(names)
        jobs: list[tuple[int, str]] = []
        for i, name in enumerate(names):
            try:
                jobs.append((i, self.options.key(check_object_name(name))))
            except InvalidKeyError:
                self.counters.get_errors += 1
                self.counters.misses += 1
        if jobs and not await self._ready():
            self.counters.get_errors += len(jobs)
            self.counters.misses += len(jobs)
            return []
        return jobs

    def _count_gets(self, n: int, jobs: list[tuple[int, str]], results: list[tuple[object, int]]) -> list[object | None]:
        """Each job's (result, payload bytes) at its index: `_FAILED` a counted error and
        miss, None a miss, anything else a hit."""
        out: list[object | None] = [None] * n
        for (i, _), (res, nbytes) in zip(jobs, results):
            if res is _FAILED:
                self.counters.get_errors += 1
                self.counters.misses += 1
            elif res is None:
                self.counters.misses += 1
            else:
                out[i] = res
                self.counters.hits += 1
                self.counters.get_bytes += nbytes
        return out

    def _first_bytes(self, head: int = 0) -> int:
        """Bytes the first GET of an object asks for: all of an object up to
        ``range_threshold``; a larger one's rest comes in ``range_size`` ranges."""
        o = self.options
        return max(o.range_threshold, o.range_size, head)

    async def _get_one(self, key: str, alloc: Alloc) -> memoryview | None:
        """GET the first `_first_bytes`; the rest in parallel ranges into the same buffer."""
        o, client = self.options, self._client
        assert self._sem is not None
        tasks: list[asyncio.Task] = []
        try:
            async with self._sem:
                try:
                    resp = await client.get_object(
                        Bucket=o.bucket, Key=key, Range=f"bytes=0-{self._first_bytes() - 1}"
                    )
                except Exception as exc:
                    if error_code(exc)[1] != 416:  # 416: empty object, a range cannot start at 0
                        raise
                    resp = await client.get_object(Bucket=o.bucket, Key=key)
                first = int(resp["ContentLength"])
                total = _total_size(resp.get("ContentRange"), first)
                if self.too_large(self.options.name(key), total):  # never written here: a miss
                    resp["Body"].close()
                    self.counters.rejected += 1
                    return None
                view = alloc(total)[:total]
                if view.nbytes != total:
                    resp["Body"].close()
                    raise ValueError(f"alloc({total}) returned a buffer of {view.nbytes} bytes")
                etag = resp.get("ETag")
                for lo in range(first, total, o.range_size):
                    hi = min(total, lo + o.range_size)
                    tasks.append(asyncio.ensure_future(self._get_range(key, etag, view[lo:hi], lo)))
                await read_into(resp["Body"], view[:first])
            if tasks:
                await asyncio.gather(*tasks)
            return view
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def _get_range(self, key: str, etag: str | None, into: memoryview, lo: int) -> None:
        o = self.options
        extra = {"IfMatch": etag} if etag else {}
        assert self._sem is not None  # set by _ready()
        async with self._sem:
            resp = await self._client.get_object(
                Bucket=o.bucket, Key=key, Range=f"bytes={lo}-{lo + into.nbytes - 1}", **extra
            )
            if int(resp["ContentLength"]) != into.nbytes:
                resp["Body"].close()
                raise ShortBody(f"range of {into.nbytes} bytes answered with {resp['ContentLength']}")
            await read_into(resp["Body"], into)

    # -- streamed get --------------------------------------------------------------------

    async def read_streamed(
        self, names: Sequence[str], open_sink: Callable[[str], StreamSink]
    ) -> list[object | None]:
        """Each object straight into the buffer its sink names (`kvstore.backends.stream`):
        a presigned GET per object on a worker thread, the body read from the socket into
        the sink's buffer block by block; an object past ``range_threshold`` reads its
        other ranges in parallel on other workers.  Counted as `get_many` counts."""
        sinks = [open_sink(n) for n in names]
        jobs = await self._get_jobs(names)
        results = await asyncio.gather(*(self._stream_one(k, sinks[i]) for i, k in jobs))
        return self._count_gets(len(names), jobs, list(results))

    def _stream_pool(self) -> tuple[S3Streams, ThreadPoolExecutor]:
        o = self.options
        if self._streams is None:
            self._streams = S3Streams(
                size=o.concurrency,
                connect_timeout=o.connect_timeout,
                read_timeout=o.read_timeout,
                max_attempts=o.max_attempts,
                ca_bundle=self._ca_bundle,
            )
        if self._threads is None:
            self._threads = ThreadPoolExecutor(o.concurrency, thread_name_prefix="kvstore-s3")
        return self._streams, self._threads

    async def _stream_one(self, key: str, sink: StreamSink) -> tuple[object, int]:
        """(the sink's verdict | None for a miss | `_FAILED`, payload bytes read).  Every
        worker job of the object has ended before this returns, cancelled or not: they
        write into the caller's buffer.  The ``timeout`` deadline or a cancel aborts the
        object's transfers at once (their sockets are shut down)."""
        if not self.breaker.allow():
            self.errors["breaker_open"] += 1
            return _FAILED, 0
        o = self.options
        streams, threads = self._stream_pool()
        loop = asyncio.get_running_loop()
        op = Op(time.monotonic() + o.timeout)
        timer = loop.call_later(o.timeout, op.abort, "deadline")
        ok = stopped = False
        assert self._sem is not None  # set by _ready()
        try:
            async with self._sem:
                url = await self._presign("get_object", {"Bucket": o.bucket, "Key": key})
                first = self._first_bytes(sink.head)
                max_size = self.max_object_bytes
                begin = loop.run_in_executor(threads, streams.begin, url, sink, first, op, max_size)
                try:
                    (begun,) = await _settled([begin], op)
                except asyncio.CancelledError:  # an answer opened meanwhile is not read
                    late = None if begin.cancelled() or begin.exception() else begin.result()
                    if isinstance(late, Opened):
                        streams.release(late, op)
                    raise
                opened = _value(begun)
                if isinstance(opened, Settled):
                    ok = True
                    if opened.oversized:
                        self.too_large(self.options.name(key), opened.oversized)  # logged
                        self.counters.rejected += 1
                    return (None if opened.missing else opened.verdict), 0
                assert isinstance(opened, Opened)
                spans = [(lo, min(opened.total, lo + o.range_size)) for lo in range(opened.length, opened.total, o.range_size)]
                parts: list[asyncio.Future[Any]] = [loop.run_in_executor(threads, streams.finish_first, opened, sink, op)]
                for lo, hi in spans:
                    into = opened.dst[lo - opened.offset : hi - opened.offset]
                    parts.append(loop.run_in_executor(threads, streams.read_range, url, opened.etag, into, lo, sink, op))
                done = await _settled(parts, op)
                for part in done:
                    _value(part)
                for (lo, hi), value in zip(spans, done[1:]):
                    sink.feed_hashed(hi - lo, cast(int, value))
                ok = True
                return sink.finish(), len(opened.dst)
        except asyncio.CancelledError:  # the caller stopped waiting: no word on the server
            stopped = True
            raise
        except Stopped:  # the caller gave the read up: a miss, no fault of the server's
            ok = True
            return None, 0
        except Exception as exc:
            kind = error_kind(exc)
            if kind == "not_found":  # deleted between the first GET and a range
                ok = True
                return None, 0
            self.errors[kind] += 1
            ok = kind == "changed"  # (412: rewritten between the first GET and a range: no fault)
            if kind == "other":
                log.warning("S3 streamed read failed unexpectedly", exc_info=exc)
            else:
                log.debug("S3 streamed read failed (%s): %r", kind, exc)
            return _FAILED, 0
        finally:
            timer.cancel()
            if not stopped:
                self.breaker.record(ok)

    async def _presign(self, operation: str, params: dict[str, Any]) -> str:
        """A presigned URL for one streamed request (it never leaves this process).  Valid
        for the operation's deadline plus a margin for clock skew, as header-signed
        requests tolerate (AWS: 15 minutes), and never past SigV4's 7-day limit."""
        expires = int(min(PRESIGN_MAX, max(PRESIGN_MIN, self.options.timeout + 60)))
        return cast(str, await self._client.generate_presigned_url(operation, Params=params, ExpiresIn=expires))

    # -- contains ------------------------------------------------------------------------

    async def contains_many(self, names: Sequence[str]) -> list[bool]:
        return [there is True for there in await self._exists(names)]

    async def _exists(self, names: Sequence[str]) -> list[bool | None]:
        """Whether each object is there; None where that could not be learnt (a failed
        listing or HEAD, the bucket unusable: counted by kind in ``errors``)."""
        out: list[bool | None] = [False] * len(names)
        jobs: list[tuple[int, str]] = []
        for i, name in enumerate(names):
            with contextlib.suppress(InvalidKeyError):
                jobs.append((i, self.options.key(check_object_name(name))))
        if not jobs:
            return out
        if not await self._ready():
            for i, _ in jobs:
                out[i] = None
            return out
        mode = self.options.contains
        heads = jobs
        if mode == "list" or (mode == "auto" and len(jobs) >= self.options.contains_list_min):
            # auto: one listing page (up to 1000 keys) per contains_list_min keys asked, then
            # HEAD whatever the listing did not reach (a crowded prefix costs no more than HEADs)
            pages = None if mode == "list" else max(1, len(jobs) // self.options.contains_list_min)
            listed = await self._guarded(lambda: self._keys_between([k for _, k in jobs], pages))
            if listed is _FAILED or listed is None:
                for i, _ in jobs:
                    out[i] = None
                return out
            found, reached = cast("tuple[set[str], str | None]", listed)
            for i, k in jobs:
                out[i] = k in found
            heads = [(i, k) for i, k in jobs if reached is not None and k > reached]
        results = await asyncio.gather(*(self._guarded(partial(self._head, k)) for _, k in heads))
        for (i, _), res in zip(heads, results):
            out[i] = None if res is _FAILED else res is True
        return out

    async def _head(self, key: str) -> bool:
        await self._request(self._client.head_object, Bucket=self.options.bucket, Key=key)
        return True

    async def _keys_between(self, keys: list[str], max_pages: int | None) -> tuple[set[str], str | None]:
        """The existing keys among `keys` from a listing of their common prefix and span.

        Returns (found, reached): `reached` is None when the listing covered every key,
        else the last key listed once `max_pages` pages were read (keys after it unknown).
        """
        lo, hi = min(keys), max(keys)
        prefix = _common_prefix(lo, hi)
        found: set[str] = set()
        wanted = set(keys)
        kw: dict[str, Any] = {"Bucket": self.options.bucket, "Prefix": prefix}
        if len(lo) > len(prefix):
            kw["StartAfter"] = lo[:-1]  # exclusive, and sorts before `lo`
        pages = 0
        while True:
            page = await self._request(self._client.list_objects_v2, **kw)
            pages += 1
            contents = page.get("Contents", ())
            for item in contents:
                k = item["Key"]
                if k > hi:
                    return found, None
                if k in wanted:
                    found.add(k)
            if not page.get("IsTruncated"):
                return found, None
            if max_pages is not None and pages >= max_pages and contents:
                return found, contents[-1]["Key"]
            kw["ContinuationToken"] = page["NextContinuationToken"]
            kw.pop("StartAfter", None)

    # -- delete ------------------------------------------------------------------------

    async def delete_many(self, names: Sequence[str]) -> list[bool]:
        """Delete; True where the object existed (and is now gone). An object whose
        existence check or delete failed is False and counted in ``delete_errors``: no
        caller may take it for one that was not there."""
        existed = await self._exists(names)
        out = [False] * len(names)
        self.counters.delete_errors += sum(e is None for e in existed)
        present = [(i, self.options.key(names[i])) for i, e in enumerate(existed) if e]
        for start in range(0, len(present), DELETE_BATCH):
            batch = present[start : start + DELETE_BATCH]
            res = await self._guarded(partial(self._delete_batch, [k for _, k in batch]))
            if not isinstance(res, set):  # failed (counted by kind)
                self.counters.delete_errors += len(batch)
                continue
            for i, k in batch:
                if k not in res:
                    out[i] = True
                    self.counters.deletes += 1
                else:
                    self.counters.delete_errors += 1
        return out

    async def quarantine(self, name: str, reason: str, found: Defect | None = None) -> bool:
        """Delete a corrupt object; with ``found.read``, only while it still holds those
        bytes (with ``found.fails``, only while it still fails that check): the object
        is read again and compared, then deleted with ``If-Match`` on the ETag of that
        read, so a copy written in between (a repair, a rewrite) is answered 412 and
        stays.  A server that refuses conditional deletes, or deletes
        regardless of ``If-Match`` (asked on a probe object), quarantines nothing.  With
        ``found.absent``: only while a read still finds nothing; ``found.since`` tells
        nothing here."""
        if found is None or (found.read is None and found.fails is None):
            return await super().quarantine(name, reason, found)
        honoured = await self._deletes_conditionally()
        if not honoured:
            why = (
                "could not ask whether it honours If-Match on DELETE (a probe object under the prefix "
                "could not be written and deleted; see -v)"
                if honoured is None
                else "does not honour If-Match on DELETE (a copy written since the read could go with it)"
            )
            log.warning(
                "S3 at %s %s, so %s is not quarantined; delete it by hand if it is still bad",
                redact_url(self.url),
                why,
                printable_name(name),
            )
            return False
        o = self.options
        key = o.key(name)

        async def compare_and_delete() -> bool:
            resp = await self._request(self._client.get_object, Bucket=o.bucket, Key=key)
            try:
                body = await resp["Body"].read()
            finally:
                resp["Body"].close()
            etag = resp.get("ETag")
            if not etag or not await asyncio.to_thread(found.matches, body):  # (may checksum it all)
                return False
            try:
                await self._request(self._client.delete_object, Bucket=o.bucket, Key=key, IfMatch=etag)
            except ClientError as exc:
                code, status = error_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False  # written since it was read: the new copy stays
                raise
            return True

        if await self._guarded(compare_and_delete) is not True:
            return False
        self.counters.deletes += 1
        self.counters.quarantined += 1
        log.warning("S3: quarantined (deleted) %s: %s", printable_name(name), reason)
        return True

    async def _deletes_conditionally(self) -> bool | None:
        """Whether DELETE honours If-Match here: a probe object under the prefix is deleted
        with an ETag it does not have; the server must answer 412 and keep it.  The answer
        is kept; None (not kept) when the probe itself failed (a fault, a read-only
        prefix).  Concurrent callers share one probe."""
        if self._conditional_delete is not None:
            return self._conditional_delete
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            if self._conditional_delete is not None:
                return self._conditional_delete
            o = self.options
            key = o.key(PROBE_PREFIX + secrets.token_hex(12))

            version: dict[str, str] = {}

            async def probe() -> bool:
                put = await self._request(self._client.put_object, Bucket=o.bucket, Key=key, Body=b"probe")
                if put.get("VersionId"):
                    version["VersionId"] = put["VersionId"]
                try:
                    await self._request(
                        self._client.delete_object, Bucket=o.bucket, Key=key, IfMatch='"0123456789abcdef0123456789abcdef"'
                    )
                except ClientError as exc:
                    code, status = error_code(exc)
                    if status == 412 or code == "PreconditionFailed":
                        return True
                    if status == 501 or code in ("NotImplemented", "InvalidArgument", "InvalidRequest"):
                        return False  # the server refuses conditional deletes
                    raise  # a fault: no answer
                return False  # deleted (or claimed so) despite a wrong ETag

            answer = await self._guarded(probe)
            await self._remove_probe(key, version)
            if isinstance(answer, bool):
                self._conditional_delete = answer
                return answer
            return None

    async def _remove_probe(self, key: str, version: dict[str, str]) -> None:
        """Best effort, under the deadline: a probe left behind is only a few bytes, and
        listings leave probes out."""
        o = self.options
        for extra in ([version, {}] if version else [{}]):  # (a role may not delete versions)
            try:
                await asyncio.wait_for(
                    self._request(self._client.delete_object, Bucket=o.bucket, Key=key, **extra), o.timeout
                )
                return
            except Exception as exc:
                log.debug("S3: could not remove the probe %s: %r", key, exc)

    async def _delete_batch(self, keys: list[str]) -> set[str]:
        """DeleteObjects for ≤ 1000 keys; returns the keys the server failed to delete."""
        resp = await self._request(
            self._client.delete_objects,
            Bucket=self.options.bucket,
            Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
        )
        failed = {e["Key"] for e in resp.get("Errors", ())}
        if failed:
            self.errors["delete_error"] += len(failed)
        return failed

    # -- list --------------------------------------------------------------------------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        o = self.options
        client = await self._get_client()
        if not self._verified:
            await self.open()
        base = o.key("")
        kw: dict[str, Any] = {"Bucket": o.bucket, "Prefix": base + prefix}
        while True:
            try:
                page = await asyncio.wait_for(self._request(client.list_objects_v2, **kw), o.timeout)
            except Exception as exc:
                self.errors[error_kind(exc)] += 1
                raise S3ListError(
                    f"listing s3://{o.bucket}/{base}{prefix} at {redact_url(self.url)} failed part way "
                    f"({type(exc).__name__}: {redact_text(str(exc))}), so nothing was done with it; check that "
                    "the endpoint answers (and the credentials may list the bucket), then rerun"
                ) from exc
            for item in page.get("Contents", ()):
                yield ObjectInfo(o.name(item["Key"]), int(item["Size"]), item["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return
            kw["ContinuationToken"] = page["NextContinuationToken"]

    # -- stats -------------------------------------------------------------------------

    def key_space(self) -> tuple[str, str]:
        """(endpoint and bucket, ``prefix/``): AWS bucket names are global, so any AWS
        endpoint is one space; others by scheme, host and port, normalised."""
        o = self.options
        endpoint = "aws"
        if o.endpoint_url:
            u = urlsplit(o.endpoint_url if "://" in o.endpoint_url else f"https://{o.endpoint_url}")
            host = (u.hostname or "").lower()
            if not (host == "amazonaws.com" or host.endswith(".amazonaws.com")):
                scheme = (u.scheme or "https").lower()
                port = u.port or (443 if scheme == "https" else 80)
                endpoint = f"{scheme}://{host}:{port}"
        return f"s3:{endpoint}/{o.bucket}", f"{o.prefix}/" if o.prefix else ""

    def stats(self) -> BackendStats:
        o = self.options
        return BackendStats(
            url=redact_url(self.url),
            counters=self.counters,
            extra={
                "errors": dict(self.errors),
                "breaker": self.breaker.snapshot(),
                "last_open_error": self.last_open_error,
                "concurrency": o.concurrency,
                "checksum": o.checksum,
                "retry_mode": o.retry_mode,
            },
        )


def part_bounds(size: int, part_size: int) -> list[tuple[int, int, int]]:
    """(part number, start, end) of a multipart upload of `size` bytes: ``size //
    part_size`` parts (at least one) of equal size, each at least `part_size` (so S3's
    5 MiB minimum holds), the last one up to a part shorter: a frame a header's length
    past a multiple of `part_size` makes each part a few bytes longer, not one more
    request of a few hundred bytes."""
    step = -(-size // max(1, size // part_size))
    return [(k + 1, lo, min(size, lo + step)) for k, lo in enumerate(range(0, size, step))]


async def _settled(futures: list[asyncio.Future[Any]], op: Op) -> list[Any]:
    """Each worker job's result or exception, once all have ended.  A cancelled caller
    aborts `op` (the jobs stop at once) and still waits for them, through any further
    cancellation (they write into or read from the caller's buffers), then is cancelled."""
    together = asyncio.gather(*futures, return_exceptions=True)
    try:
        return await asyncio.shield(together)
    except asyncio.CancelledError:
        op.abort("cancelled")
        await wait_out(together)
        raise


def _value(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result


def _proxied(o: S3Options) -> bool:
    """Whether the environment sends requests to this endpoint through a proxy: the URL's
    ``endpoint_url``, else the one botocore takes from ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL``, else AWS's (a profile's ``endpoint_url`` is checked once the
    client exists: `_proxied_endpoint`)."""
    endpoint = o.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return _proxied_endpoint(endpoint or "https://s3.amazonaws.com")


def _proxied_endpoint(endpoint: str) -> bool:
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    proxies = urllib.request.getproxies()
    return bool(proxies.get(u.scheme)) and not urllib.request.proxy_bypass(u.hostname or "")


def _server_time(response: dict[str, Any]) -> float:
    """The server's clock from a response's Date header (our own clock without one)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date).timestamp() if date else time.time()
    except (TypeError, ValueError):
        return time.time()


def _total_size(content_range: str | None, length: int) -> int:
    """Object size from ``Content-Range: bytes 0-99/1234`` (or the length if unranged)."""
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1].strip()
        if total.isdigit():
            return int(total)
    return length


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
