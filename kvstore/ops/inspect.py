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


@dataclass(frozen=True, slots=True)
class Head:
    """What reading one object's frame header found: the `header`, or else the bytes
    read and refused (`refused`: damage, or another program's object), or neither:
    nothing came back (the object is gone, or the read failed: no proof of anything)."""

    header: FrameHeader | None = None
    refused: memoryview | None = None


async def read_heads_checked(
    backend: Backend, names: Sequence[str], batch: int = 64, sizes: Sequence[int] | None = None
) -> list[Head]:
    """Frame headers by ranged reads (`Backend.read_heads`), each with what was read.

    A header is refused too when it was written for another name, or (given the
    listed `sizes`) when the object's size is not what its header says.
    """
    out: list[Head] = []

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
            if head is None:
                out.append(Head())
                continue
            try:
                out.append(Head(header=parse(head, name, size)))
                continue
            except FrameError:
                if not _header_cut(head):
                    out.append(Head(refused=head))
                    continue
            # a header longer than HEAD_BYTES: read the object whole
            full = (await backend.get_many([name]))[0]
            if full is None:
                out.append(Head())  # (the read failed, or it went: no proof either way)
                continue
            try:
                out.append(Head(header=parse(full, name, size)))
            except FrameError:
                out.append(Head(refused=full[:HEAD_BYTES]))
    return out


async def read_headers(
    backend: Backend, names: Sequence[str], batch: int = 64, sizes: Sequence[int] | None = None
) -> list[FrameHeader | None]:
    """Frame headers by ranged reads; None for missing, unreadable or refused objects
    (see `read_heads_checked`)."""
    return [h.header for h in await read_heads_checked(backend, names, batch, sizes)]


def _error_marks(backend: Backend) -> tuple[int, int]:
    return backend.counters.get_errors, backend.counters.delete_errors


async def delete_checked(backend: Backend, names: Sequence[str]) -> tuple[list[bool], list[str]]:
    """Delete `names`; (`delete_many`'s answers, the names not deleted). A name answered
    False counts as absent already only on proof: no read or delete error counted while
    the delete and a lookup after it ran, and the lookup says it is not there. An answer
    given during a fault (a backend answers a failed lookup "not there") proves nothing:
    such a name is among those not deleted, never claimed."""
    marks = _error_marks(backend)
    done = await backend.delete_many(names)
    missed = [n for n, d in zip(names, done) if not d]
    if not missed:
        return done, []
    there = await backend.contains_many(missed)
    faulted = _error_marks(backend) != marks
    kept = {n for n, t in zip(missed, there) if t or faulted}
    return done, [n for n in names if n in kept]


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
            st.by_age.setdefault(age_bucket(now - created) if created else "unknown", Group()),
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

    async def too_large(name: str, size: str) -> None:  # never read into memory, so never quarantined
        await bad(
            name,
            f"TooLarge: {size}, over max_object_size={backend.max_object_bytes} (not read: "
            "raise max_object_size in the URL to check it)",
            proven=False,
        )

    async def check(info: ObjectInfo) -> None:
        if info.size > backend.max_object_bytes:
            await too_large(info.name, f"{info.size} bytes")
            return
        errors, refused = backend.counters.get_errors, backend.counters.rejected
        (raw,) = await backend.get_many([info.name])
        if raw is None and backend.counters.get_errors == errors and backend.counters.rejected == refused:
            # read as absent with no error: maybe an overwrite swapped it under the read
            # (a Redis multi-part value's old parts go): one more read before calling it bad
            (raw,) = await backend.get_many([info.name])
        if raw is None:
            if backend.counters.rejected != refused:  # grown over the limit since it was listed
                await too_large(info.name, "grown since it was listed")
            elif not (await backend.contains_many([info.name]))[0]:
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
    not_deleted: list[str] = field(default_factory=list)  # chosen, but still there (or not known gone) after delete
    foreign: list[str] = field(default_factory=list)  # not kvstore frames (another program's keys): left
    unreadable: list[str] = field(default_factory=list)  # listed and there, but nothing of it read back: left
    undated: list[str] = field(default_factory=list)  # no time to age them by (damaged frames on Redis): kept by age
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
    that are not kvstore frames (bytes read without the frame magic) are reported in
    ``foreign`` and left, as are objects of which nothing could be read (``unreadable``:
    a failed read is no damage, and their age is unknown). A damaged frame (its bytes
    read, the magic there, the header refused) is collected by its mtime; one with none
    (a Redis listing has no time) is ``undated``: never taken by `older_than_s`, and
    last under `max_bytes` (an unknown age is not the oldest).
    """
    listed = await list_objects(backend, prefix, namespace)
    report = GcReport(url=redact_url(backend.url), dry_run=dry_run, unlisted=list(backend.unlisted))
    heads = await read_heads_checked(backend, [o.name for o in listed], sizes=[o.size for o in listed])
    for k, o in enumerate(listed):
        if heads[k].header is None and heads[k].refused is None:
            # nothing came back: once more, alone (a failed read, a Redis multi-part value
            # caught mid-overwrite, which reads as absent)
            (heads[k],) = await read_heads_checked(backend, [o.name], sizes=[o.size])
    blank = [o.name for o, h in zip(listed, heads) if h.header is None and h.refused is None]
    if blank:
        # still nothing: a failed read, a value caught mid-overwrite twice, or a
        # multi-part value that lost parts. It may be a good object or another program's
        # and its age is unknown, so it is left (verify tells an incomplete one apart);
        # one no longer there is simply gone
        there = await backend.contains_many(blank)
        report.unreadable = [n for n, t in zip(blank, there) if t]
        report.vanished = sum(not t for t in there)
    # bytes read and refused: ours (a damaged frame, collectable) when they start with
    # the frame magic; without it, another program's key under the prefix, never
    # deleted here and left out of the budget
    report.foreign = [
        o.name
        for o, h in zip(listed, heads)
        if h.refused is not None and bytes(h.refused[: len(MAGIC)]) != MAGIC
    ]
    left = set(report.foreign) | set(blank)
    objects = [o for o in listed if o.name not in left]
    created: dict[str, float | None] = {
        o.name: (h.header.ctime if h.header is not None and h.header.ctime else o.mtime or None)
        for o, h in zip(listed, heads)
    }
    report.undated = [o.name for o in objects if created[o.name] is None]
    report.before_objects = len(objects)
    report.before_bytes = sum(o.size for o in objects)
    now = time.time()
    made = {name: now if t is None else t for name, t in created.items()}  # undated: as if made now
    oldest_first = sorted(objects, key=lambda o: made[o.name])
    doomed: list[ObjectInfo] = []
    if older_than_s is not None:
        doomed = [o for o in oldest_first if created[o.name] is not None and now - made[o.name] > older_than_s]
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
            kept.update((await delete_checked(backend, [o.name for o in doomed[start : start + 500]]))[1])
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
