"""Look after a store: what is in it, is it intact, and bring it under a budget.

Owns: `stat_store` (objects and bytes by namespace, model, codec, age), `verify_store`
(every frame checked, optionally quarantined) and `gc_store` (delete by age /
namespace / down to a byte budget, oldest first).  Must not touch: backend internals
or printing.  Frame headers are read with `Backend.read_heads`, so `stat` does not
read payloads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.backends import Backend, ObjectInfo
from kvstore.backends.base import Defect, redact_url
from kvstore.frame import (
    MAGIC,
    PREFIX,
    PREFIX_LEN,
    BadMagicError,
    FrameError,
    FrameHeader,
    LengthMismatchError,
    decode_frame,
    read_header,
)
from kvstore.keys import PROBE_PREFIX, ChunkKey, InvalidKeyError, listing_prefix
from kvstore.options import option_int

HEAD_BYTES = 4096
AGE_BUCKETS = ((3600, "<1h"), (86400, "<1d"), (7 * 86400, "<7d"), (30 * 86400, "<30d"))


def describe(name: str) -> tuple[str, str]:
    """(namespace, model) of an object name, or ("?", "?") for foreign names."""
    try:
        key = ChunkKey.from_object_name(name)
    except InvalidKeyError:
        return ("?", "?")
    return (key.namespace, key.model)


def age_bucket(age_s: float) -> str:
    for limit, label in AGE_BUCKETS:
        if age_s < limit:
            return label
    return ">=30d"


async def list_objects(backend: Backend, prefix: str = "", namespace: str | None = None) -> list[ObjectInfo]:
    """The objects under `prefix`; what the listing could not read is left in
    ``backend.unlisted`` (cleared first), for the caller to report."""
    backend.unlisted.clear()
    found = listing_prefix(prefix, namespace)
    if found is None:  # a prefix outside the namespace: nothing is in both
        return []
    return [i async for i in backend.list(found) if not i.name.startswith(PROBE_PREFIX)]


def _header_cut(head: memoryview) -> bool:
    """Whether `head` is a frame prefix whose header runs past the bytes read."""
    if len(head) < HEAD_BYTES or len(head) < PREFIX_LEN:
        return False
    magic, _v, _f, _r, hlen, _crc = PREFIX.unpack_from(head, 0)
    return magic == MAGIC and PREFIX_LEN + hlen > len(head)


async def read_headers(
    backend: Backend, names: Sequence[str], batch: int = 64, sizes: Sequence[int] | None = None
) -> list[FrameHeader | None]:
    """Frame headers by ranged reads; None for missing or unreadable objects.

    A header is unreadable too when it was written for another name, or (given the
    listed `sizes`) when the object's size is not what its header says.
    """
    out: list[FrameHeader | None] = []

    def parse(buf: memoryview, name: str, size: int | None) -> FrameHeader:
        header, off = read_header(buf, key=name)
        if size is not None and off + header.plen != size:
            raise LengthMismatchError(f"object is {size} bytes, its header says {off + header.plen}")
        return header

    for start in range(0, len(names), batch):
        chunk = list(names[start : start + batch])
        chunk_sizes = list(sizes[start : start + batch]) if sizes is not None else [None] * len(chunk)
        heads = await backend.read_heads(chunk, HEAD_BYTES)
        for name, size, head in zip(chunk, chunk_sizes, heads):
            header: FrameHeader | None = None
            if head is not None:
                try:
                    header = parse(head, name, size)
                except FrameError:
                    if _header_cut(head):  # a header longer than HEAD_BYTES: read the object whole
                        full = (await backend.get_many([name]))[0]
                        try:
                            header = parse(full, name, size) if full is not None else None
                        except FrameError:
                            header = None
            out.append(header)
    return out


@dataclass(slots=True)
class Group:
    objects: int = 0
    bytes: int = 0


@dataclass(slots=True)
class StoreStats:
    url: str
    objects: int = 0
    bytes: int = 0
    by_namespace: dict[str, Group] = field(default_factory=dict)
    by_model: dict[str, Group] = field(default_factory=dict)
    by_codec: dict[str, Group] = field(default_factory=dict)
    by_age: dict[str, Group] = field(default_factory=dict)
    unreadable: int = 0
    unlisted: list[tuple[str, str]] = field(default_factory=list)  # (what, why) not listed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def stat_store(backend: Backend, prefix: str = "", namespace: str | None = None) -> StoreStats:
    objects = await list_objects(backend, prefix, namespace)
    headers = await read_headers(backend, [o.name for o in objects], sizes=[o.size for o in objects])
    now = time.time()
    st = StoreStats(url=redact_url(backend.url), unlisted=list(backend.unlisted))
    for info, header in zip(objects, headers):
        ns, model = describe(info.name)
        codec = header.codec if header is not None else "unreadable"
        st.unreadable += header is None
        created = header.ctime if header is not None and header.ctime else info.mtime
        for group in (
            st.by_namespace.setdefault(ns, Group()),
            st.by_model.setdefault(f"{ns}/{model}", Group()),
            st.by_codec.setdefault(codec, Group()),
            st.by_age.setdefault(age_bucket(now - created), Group()),
        ):
            group.objects += 1
            group.bytes += info.size
        st.objects += 1
        st.bytes += info.size
    return st


@dataclass(slots=True)
class VerifyReport:
    url: str
    checked: int = 0
    ok: int = 0
    bad: dict[str, str] = field(default_factory=dict)
    missing: int = 0  # listed, then gone before it was read (deleted or evicted meanwhile)
    unreadable: list[str] = field(default_factory=list)  # still there, but its read failed
    foreign: list[str] = field(default_factory=list)  # not a kvstore frame: left as it is
    quarantined: int = 0
    not_quarantined: list[str] = field(default_factory=list)  # changed since it was read (or not deletable)
    unlisted: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def verify_store(
    backend: Backend,
    prefix: str = "",
    *,
    quarantine: bool = False,
    concurrency: int = 4,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Read and check every frame under `prefix`; with `quarantine`, move bad ones aside."""
    option_int("concurrency", concurrency)
    objects = await list_objects(backend, prefix)
    report = VerifyReport(url=redact_url(backend.url), unlisted=list(backend.unlisted))
    queue: asyncio.Queue[ObjectInfo] = asyncio.Queue()
    for o in objects:
        queue.put_nowait(o)

    async def bad(name: str, why: str, *, proven: bool = True, read: memoryview | None = None) -> None:
        report.bad[name] = why
        if quarantine and proven:  # only what was read and found defective is moved aside,
            # and only while it still is: a copy written since the read (a repair, a
            # rewrite by an engine) stays in service
            if await backend.quarantine(name, why, Defect(read=read, absent=read is None)):
                report.quarantined += 1
            else:
                report.not_quarantined.append(name)

    async def check(info: ObjectInfo) -> None:
        if info.size > backend.max_object_bytes:  # never read into memory, so never quarantined
            await bad(
                info.name,
                f"TooLarge: {info.size} bytes, over max_object_size={backend.max_object_bytes} (not read: "
                "raise max_object_size in the URL to check it)",
                proven=False,
            )
            return
        errors = backend.counters.get_errors
        (raw,) = await backend.get_many([info.name])
        if raw is None and backend.counters.get_errors == errors:
            # read as absent with no error: maybe an overwrite swapped it under the read
            # (a Redis multi-part value's old parts go): one more read before calling it bad
            (raw,) = await backend.get_many([info.name])
        if raw is None:
            if not (await backend.contains_many([info.name]))[0]:
                report.missing += 1  # deleted or evicted since the listing
            elif backend.counters.get_errors != errors:
                report.unreadable.append(info.name)  # the read failed: a fault, rerun to check it
            else:  # there, yet the backend's own checks read it as absent (a part lost)
                await bad(info.name, "Incomplete: listed, but reads as absent (a part or its manifest is lost)")
            return
        try:
            decode_frame(raw, key=info.name)
            report.ok += 1
        except BadMagicError:
            report.foreign.append(info.name)  # another program's object under the prefix: not ours to move
        except FrameError as exc:
            await bad(info.name, f"{type(exc).__name__}: {exc}", read=raw)

    async def worker() -> None:
        while not queue.empty():
            info = queue.get_nowait()
            report.checked += 1
            await check(info)
            if progress:
                progress(info.size)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return report


@dataclass(slots=True)
class GcReport:
    url: str
    dry_run: bool
    before_objects: int = 0
    before_bytes: int = 0
    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    after_bytes: int = 0
    leftovers_removed: int = 0
    uploads_aborted: int = 0  # unfinished multipart uploads (S3) aborted, or would be with dry_run
    uploads_not_aborted: list[str] = field(default_factory=list)
    unlisted: list[tuple[str, str]] = field(default_factory=list)
    not_deleted: list[str] = field(default_factory=list)  # chosen, but still there after delete
    foreign: list[str] = field(default_factory=list)  # not kvstore frames (another program's keys): left
    unreadable: list[str] = field(default_factory=list)  # listed and there, but nothing of it read back: left
    vanished: int = 0  # listed, then gone before its header was read

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def gc_store(
    backend: Backend,
    *,
    prefix: str = "",
    namespace: str | None = None,
    older_than_s: float | None = None,
    max_bytes: int | None = None,
    stale_uploads_s: float | None = None,
    dry_run: bool = False,
) -> GcReport:
    """Delete objects older than `older_than_s`, then oldest first until ≤ `max_bytes`;
    then let the backend drop its own leftovers of writes started more than
    `stale_uploads_s` ago and never finished (a Redis backend's value parts no manifest
    names, an S3 backend's multipart uploads, whose parts the server keeps until they
    are aborted; None: an hour, for Redis at least twice a put's deadline).

    With `namespace`, only that namespace is considered and `max_bytes` is its budget.
    Age is the frame's creation time where readable, else the object's mtime. Objects
    that are not kvstore frames (no frame magic) are reported in ``foreign`` and left, as
    are objects of which nothing could be read (``unreadable``: their age is unknown).
    """
    listed = await list_objects(backend, prefix, namespace)
    report = GcReport(url=redact_url(backend.url), dry_run=dry_run, unlisted=list(backend.unlisted))
    headers = await read_headers(backend, [o.name for o in listed], sizes=[o.size for o in listed])
    # An object whose header cannot be read is ours when it starts with the frame magic
    # (a damaged frame: collectable); without it, another program's key under the prefix,
    # never deleted here and left out of the budget.
    unknown = [o for o, h in zip(listed, headers) if h is None]
    heads = list(await backend.read_heads([o.name for o in unknown], len(MAGIC))) if unknown else []
    for k, o in enumerate(unknown):
        if heads[k] is None:  # once more, alone (a Redis multi-part value caught mid-overwrite reads as absent)
            (heads[k],) = await backend.read_heads([o.name], len(MAGIC))
    blank = [o.name for o, head in zip(unknown, heads) if head is None]
    if blank:
        # nothing of it could be read: a failed read, a value caught mid-overwrite twice,
        # or a multi-part value that lost parts. Its age is unknown (a Redis listing has no
        # mtime) and it may be a good object or another program's, so it is left (verify
        # tells an incomplete one apart); one no longer there is simply gone
        there = await backend.contains_many(blank)
        report.unreadable = [n for n, t in zip(blank, there) if t]
        report.vanished = sum(not t for t in there)
    report.foreign = [o.name for o, head in zip(unknown, heads) if head is not None and bytes(head[: len(MAGIC)]) != MAGIC]
    left = set(report.foreign) | set(blank)
    objects = [o for o in listed if o.name not in left]
    created = {o.name: (h.ctime if h is not None and h.ctime else o.mtime) for o, h in zip(listed, headers)}
    report.before_objects = len(objects)
    report.before_bytes = sum(o.size for o in objects)
    now = time.time()
    oldest_first = sorted(objects, key=lambda o: created[o.name])
    doomed: list[ObjectInfo] = []
    if older_than_s is not None:
        doomed = [o for o in oldest_first if now - created[o.name] > older_than_s]
    remaining = report.before_bytes - sum(o.size for o in doomed)
    if max_bytes is not None:
        chosen = {o.name for o in doomed}
        for o in oldest_first:
            if remaining <= max_bytes:
                break
            if o.name not in chosen:
                doomed.append(o)
                remaining -= o.size
    if not dry_run:
        kept: set[str] = set()
        for start in range(0, len(doomed), 500):
            batch = [o.name for o in doomed[start : start + 500]]
            gone = await backend.delete_many(batch)
            missed = [n for n, g in zip(batch, gone) if not g]  # absent already, or not deletable?
            if missed:
                kept.update(n for n, there in zip(missed, await backend.contains_many(missed)) if there)
        report.not_deleted = [o.name for o in doomed if o.name in kept]
        doomed = [o for o in doomed if o.name not in kept]
    collect = getattr(backend, "collect_garbage", None)  # backend-internal leftovers (Redis parts)
    if collect is not None and not dry_run:
        report.leftovers_removed = await collect(grace_s=stale_uploads_s)
    abort_stale = getattr(backend, "abort_stale_uploads", None)  # S3: uploads killed writers left
    if abort_stale is not None:
        backend.unlisted.clear()
        report.uploads_aborted, report.uploads_not_aborted = await abort_stale(
            3600.0 if stale_uploads_s is None else stale_uploads_s, dry_run=dry_run
        )
        report.unlisted.extend(backend.unlisted)
    report.deleted = [o.name for o in doomed]
    report.deleted_bytes = sum(o.size for o in doomed)
    report.after_bytes = report.before_bytes - report.deleted_bytes
    return report
