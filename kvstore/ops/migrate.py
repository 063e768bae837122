"""Copy objects between any two backends: verified, bounded, resumable.

Owns: the migration loop, its journal and its report.  Must not touch: backend
internals (only the public Backend API), printing (the CLI renders `MigrationReport`).

For each source object (listed, filtered by prefix / namespace / model):

1. done already?  Names in the journal whose object the destination still has are
   skipped without reading, except with `delete_source`: a source goes only once its
   copy is proven, so those are read as in 2 and checked as below.  A destination
   object not in the journal (a run killed between write and journal) is read whole
   and checked (checksum, key, the source's checksum, and without recoding the
   source's size) instead of being copied again; one that fails is copied again.
2. read the source frame and verify it (checksum).  A corrupt source object is
   reported and skipped, never copied (and never deleted).
3. optionally recode the payload (``raw`` ↔ ``cachegen``), keeping the key; the new
   frame records the source checksum in ``meta.source_csum``.
4. write, read back and verify the destination frame and append the name to the journal.
5. with `delete_source`, once every object has been through 1-4: make the copies of
   exactly those names durable (`Backend.make_durable`: an earlier run may have
   written them with syncing off), read the frame header of each back from the
   destination and the source again, and delete only the source objects whose
   destination copy is still there and still matches; one gone or changed is reported
   in ``lost`` and its source is kept; a source delete that failed (or is not known
   to have happened) is reported in ``not_deleted``.
   A destination that says it may drop what it holds (`Backend.retention_risks`: a byte
   budget, a TTL, an evicting Redis) is refused before anything is copied, and so is
   one that is the source under another URL (a path through a link, a host or a
   trailing slash spelled another way: :func:`same_store`), where every source object
   would be found "done" and deleted.

Memory stays bounded: at most `concurrency` objects and `max_inflight_bytes` bytes are
held at once (one object larger than that budget still passes, alone).  Destination
writes are atomic in every backend, so a kill at any point leaves each object either
absent or whole, and a rerun finishes the job writing each missing object once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore import codec as codecs
from kvstore.backends import Backend, ObjectInfo
from kvstore.backends.base import redact_url
from kvstore.buffers import BufferPool
from kvstore.frame import FrameError, FrameHeader, read_header
from kvstore.keys import PROBE_PREFIX, ChunkKey, InvalidKeyError, listing_prefix, printable_name
from kvstore.ops.inspect import delete_checked, read_headers
from kvstore.options import kvstore_home, option_int
from kvstore.tier import check_frame, transcode

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class MigrateOptions:
    prefix: str = ""
    namespace: str | None = None
    model: str | None = None
    recode: str | None = None
    recode_options: dict[str, Any] = field(default_factory=dict)
    delete_source: bool = False
    dry_run: bool = False
    concurrency: int = 4
    max_inflight_bytes: int = 512 * MiB
    verify_after_write: bool = True
    journal: Path | None = None
    fresh: bool = False

    def __post_init__(self) -> None:
        option_int("concurrency", self.concurrency)
        option_int("max_inflight_bytes", self.max_inflight_bytes)
        if self.delete_source and not self.verify_after_write:
            raise ValueError(
                "--delete-source needs each copy read back and checked before its source goes; "
                "drop --no-verify-after-write"
            )

    def listing_prefix(self) -> str:
        found = listing_prefix(self.prefix, self.namespace, self.model)
        return "\x00" if found is None else found  # (disjoint filters: nothing matches)

    def matches(self, name: str) -> bool:
        if not name.startswith(self.listing_prefix()):
            return False
        if self.model is not None and self.namespace is None:
            try:
                return ChunkKey.from_object_name(name).model == self.model
            except InvalidKeyError:
                return False
        return True


@dataclass(slots=True)
class MigrationReport:
    src: str
    dst: str
    dry_run: bool
    listed: int = 0
    listed_bytes: int = 0
    copied: int = 0
    copied_bytes: int = 0
    written_bytes: int = 0
    already_done: int = 0
    deleted: int = 0
    corrupt: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # written, then gone or changed in dst: source kept
    not_deleted: list[str] = field(default_factory=list)  # copy proven, but the source delete failed
    unlisted: list[tuple[str, str]] = field(default_factory=list)  # (what, why) not listed
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.lost and not self.not_deleted

    @property
    def mib_s(self) -> float:
        return self.copied_bytes / MiB / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mib_s"] = self.mib_s
        d["ok"] = self.ok
        return d


class _ByteBudget:
    """At most `limit` bytes held at once; a single oversize request passes alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.held == 0 or self.held + n <= self.limit)
            self.held += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.held -= n
            self._cond.notify_all()


class Journal:
    """Names already copied, one JSON line each, append-only: a string for a copy read
    back and checked, ``{"unverified": name}`` for one written with the read-back off
    (`verified=False`), which only runs without the read-back may skip."""

    def __init__(self, path: Path, *, fresh: bool = False, verified: bool = True) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and path.exists():
            path.unlink()
        self.verified = verified
        self.done: set[str] = set()
        text = path.read_text("utf-8") if path.exists() else ""
        if text:
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if isinstance(entry, str):
                    self.done.add(entry)
                elif isinstance(entry, dict) and not verified and isinstance(entry.get("unverified"), str):
                    self.done.add(entry["unverified"])
        self._fh = path.open("a", encoding="utf-8")
        if text and not text.endswith("\n"):
            self._fh.write("\n")  # a line a kill cut short ends here, not glued to the next

    def add(self, name: str) -> None:
        self._fh.write(json.dumps(name if self.verified else {"unverified": name}) + "\n")
        self._fh.flush()
        self.done.add(name)

    def close(self) -> None:
        self._fh.close()


def journal_path(src: Backend, dst: Backend, opts: MigrateOptions) -> Path:
    # "v2": journals before unverified runs were told apart hold their names as checked
    ident = ["v2", redact_url(src.url), redact_url(dst.url), opts.listing_prefix(), opts.model, opts.recode]
    if not opts.verify_after_write:  # its names were never read back: a checked run may not skip them
        ident.append("unverified")
    ident_text = json.dumps(ident)
    digest = hashlib.blake2b(ident_text.encode(), digest_size=12).hexdigest()
    return kvstore_home() / "migrations" / f"{digest}.jsonl"


def nested_stores(src: Backend, dst: Backend) -> bool:
    """Whether `src` and `dst` keep their keys in one space with prefixes that contain
    one another (``s3://b`` and ``s3://b/p``): the source's listing then holds the
    destination's objects, copied into themselves and deleted."""
    a, b = src.key_space(), dst.key_space()
    return a is not None and b is not None and a[0] == b[0] and (a[1].startswith(b[1]) or b[1].startswith(a[1]))


async def same_store(src: Backend, dst: Backend) -> bool:
    """Whether `src` and `dst` are one store under two URLs: a probe object of random
    bytes written to `dst` reads back from `src` (then it is deleted). URLs cannot tell:
    a path through a symbolic link, ``redis://h/0`` and ``redis://h:6379/0``, an S3
    prefix with and without its slash all name one store. An answer that cannot be
    trusted (the destination does not read its own probe back, the source's read
    failed rather than found nothing) raises: the caller must not go on as if they
    were two stores."""
    name = PROBE_PREFIX + secrets.token_hex(12)
    payload = secrets.token_bytes(64)
    where = f"{redact_url(src.url)} and {redact_url(dst.url)}"
    (ok,) = await dst.put_many([(name, payload)])
    if not ok:
        raise ValueError(
            f"--delete-source refused: {redact_url(dst.url)} did not take a 64-byte probe object "
            f"({name}), so it cannot be told apart from the source; check the destination is writable"
        )
    try:
        (back,) = await dst.get_many([name])
        if back is None or bytes(back) != payload:
            raise ValueError(
                f"--delete-source refused: {redact_url(dst.url)} does not read back the probe object it "
                f"was just given, so whether {where} are one store cannot be told; retry, or drop --delete-source"
            )
        errors = src.counters.get_errors
        (seen,) = await src.get_many([name])
        if seen is None and src.counters.get_errors != errors:
            raise ValueError(
                f"--delete-source refused: the source's read of the probe object failed, so whether {where} "
                "are one store cannot be told; retry when the source answers, or drop --delete-source"
            )
        return seen is not None and bytes(seen) == payload
    finally:
        await dst.delete_many([name])


def _matches_source(dst: FrameHeader, src: FrameHeader, recode: str | None) -> bool:
    target = codecs.parse_spec(recode)[0] if recode is not None else None
    if target is None or target == src.codec:
        return dst.csum == src.csum and dst.plen == src.plen
    return dst.codec == target and dst.meta.get("source_csum") == src.csum


async def list_matching(src: Backend, opts: MigrateOptions) -> list[ObjectInfo]:
    """Matching source objects; what the listing could not read is left in ``src.unlisted``."""
    src.unlisted.clear()
    return [
        info
        async for info in src.list(opts.listing_prefix())
        if opts.matches(info.name) and not info.name.startswith(PROBE_PREFIX)
    ]


async def migrate(
    src: Backend,
    dst: Backend,
    opts: MigrateOptions,
    *,
    progress: Callable[[int, int], None] | None = None,
    objects: list[ObjectInfo] | None = None,
) -> MigrationReport:
    """Copy every matching object of `src` to `dst`; see the module docstring.

    `progress(objects_done, bytes_done)` is called after each object.
    """
    if opts.delete_source and not opts.dry_run:
        if nested_stores(src, dst):
            raise ValueError(
                f"--delete-source refused: {redact_url(src.url)} and {redact_url(dst.url)} keep their keys in "
                "one space with prefixes that contain one another, so the source's listing holds destination "
                "objects (each would be copied into itself and deleted). Give stores that do not overlap, "
                "or drop --delete-source"
            )
        risks = await dst.retention_risks()
        if risks:
            raise ValueError(
                f"--delete-source refused: {redact_url(dst.url)} may drop what it receives, so deleting "
                "the source could lose objects: " + "; ".join(risks) + ". Fix that, or drop --delete-source"
            )
        if await same_store(src, dst):
            raise ValueError(
                f"--delete-source refused: {redact_url(src.url)} and {redact_url(dst.url)} are one store "
                "(an object written to the destination reads back from the source), so each source object "
                "would count as copied and be deleted: its only copy. Give two different stores, or drop "
                "--delete-source"
            )
    t0 = time.perf_counter()
    deleting = opts.delete_source and not opts.dry_run
    report = MigrationReport(src=redact_url(src.url), dst=redact_url(dst.url), dry_run=opts.dry_run)
    if objects is None:
        objects = await list_matching(src, opts)
    report.listed = len(objects)
    report.unlisted = list(src.unlisted)
    report.listed_bytes = sum(o.size for o in objects)
    target = codecs.get(opts.recode, **opts.recode_options) if opts.recode else None
    journal = Journal(opts.journal or journal_path(src, dst, opts), fresh=opts.fresh, verified=opts.verify_after_write)
    budget = _ByteBudget(opts.max_inflight_bytes)
    tick = progress or (lambda n, b: None)

    # sources to delete once the run is over and their copies are checked again (step 5)
    settled: list[ObjectInfo] = []

    # names the journal says are done: skip those the destination still has (unless
    # their sources are to go: then each copy is read and proven first, in copy_object)
    todo = objects
    journaled = [] if deleting else [o for o in objects if o.name in journal.done]
    if journaled:
        present = await dst.contains_many([o.name for o in journaled])
        gone = {o.name for o, p in zip(journaled, present) if not p}
        todo = [o for o in objects if o.name not in journal.done or o.name in gone]
        for o in journaled:
            if o.name not in gone:
                report.already_done += 1
                settled.append(o)
                tick(1, o.size)

    queue: asyncio.Queue[ObjectInfo] = asyncio.Queue()
    for o in todo:
        queue.put_nowait(o)

    pool = BufferPool(max_bytes=opts.max_inflight_bytes)

    async def copy_one(info: ObjectInfo) -> None:
        if opts.dry_run:
            report.copied += 1
            report.copied_bytes += info.size
            return
        taken: list[bytearray] = []

        def alloc(n: int) -> memoryview:  # reused buffers: a fresh 32 MiB bytearray costs page faults
            taken.append(pool.take(n))
            return memoryview(taken[-1])

        try:
            await copy_object(info, alloc)
        finally:
            for buf in taken:
                pool.give(buf)

    async def copy_object(info: ObjectInfo, alloc: Callable[[int], memoryview]) -> None:
        name = info.name
        if info.size > src.max_object_bytes:  # not read into memory: corrupt, never deleted
            log.error(
                "kvstore migrate: source object %s is %d bytes, over max_object_size",
                printable_name(name),
                info.size,
            )
            report.corrupt.append(name)
            return
        (raw,) = await src.get_many([name], alloc)
        if raw is None:
            log.warning("kvstore migrate: %s vanished from the source", printable_name(name))
            report.failed.append(name)
            return
        try:
            frame = await check_frame(raw, name)
        except FrameError as exc:
            log.error(
                "kvstore migrate: source object %s is corrupt (%s); skipped, not copied",
                printable_name(name),
                exc,
            )
            report.corrupt.append(name)
            return
        if await _done_in_destination(name, frame.header, raw.nbytes, alloc):
            if name not in journal.done:
                journal.add(name)
            report.already_done += 1
            settled.append(info)
            return
        parts = transcode(frame, name, target) if target is not None else [raw]
        expect_csum = read_header(parts[0])[0].csum if target is not None else frame.header.csum
        (ok,) = await dst.put_many([(name, parts)])
        if not ok:
            report.failed.append(name)
            return
        if opts.verify_after_write and not await _verify_written(name, expect_csum, alloc):
            report.failed.append(name)
            return
        journal.add(name)
        report.copied += 1
        report.copied_bytes += info.size
        report.written_bytes += sum(memoryview(p).nbytes for p in parts)
        settled.append(info)

    async def _done_in_destination(
        name: str, src_header: FrameHeader, src_size: int, alloc: Callable[[int], memoryview]
    ) -> bool:
        """Whether the destination holds a proven copy of `name`: read whole, its frame
        checked (checksum, key), a copy of the source's (its checksum; without
        recoding, its size too). One that is not is logged and copied again."""
        (have,) = await dst.get_many([name], alloc)
        if have is None:
            return False
        try:
            header = (await check_frame(have, name)).header
        except FrameError as exc:
            why = f"corrupt ({type(exc).__name__}: {exc})"
        else:
            if not _matches_source(header, src_header, opts.recode):
                why = "not a copy of the source's (another checksum)"
            elif opts.recode is None and have.nbytes != src_size:
                why = f"{have.nbytes} bytes, the source's {src_size}"
            else:
                return True
        log.warning(
            "kvstore migrate: the destination's %s is %s; copying it again", printable_name(name), why
        )
        return False

    async def _verify_written(name: str, csum: int, alloc: Callable[[int], memoryview]) -> bool:
        (back,) = await dst.get_many([name], alloc)
        try:
            if back is not None and (await check_frame(back, name)).header.csum == csum:
                return True
        except FrameError as exc:
            log.error(
                "kvstore migrate: %s reads back corrupt from the destination: %s", printable_name(name), exc
            )
        return False

    async def delete_settled() -> None:
        """Step 5: delete the sources whose destination copies still match, batch by batch
        (at most `max_inflight_bytes` of objects, since some backends read heads whole)."""
        batch: list[str] = []
        held = 0
        for info in settled:
            if batch and (held + info.size > opts.max_inflight_bytes or len(batch) >= 256):
                await delete_batch(batch)
                batch, held = [], 0
            batch.append(info.name)
            held += info.size
        if batch:
            await delete_batch(batch)

    async def delete_batch(names: list[str]) -> None:
        there = await read_headers(dst, names, batch=len(names))
        sources = await read_headers(src, names, batch=len(names))
        keep: list[str] = []
        for name, have, was in zip(names, there, sources):
            if have is not None and was is not None and _matches_source(have, was, opts.recode):
                keep.append(name)
                continue
            why = "gone from the destination" if have is None else "no longer a copy of its source"
            log.error(
                "kvstore migrate: %s was written but is %s before its source was deleted; source kept",
                printable_name(name),
                why,
            )
            report.lost.append(name)
        if keep:
            done, stayed = await delete_checked(src, keep)
            report.deleted += sum(done)
            for name in stayed:
                log.error(
                    "kvstore migrate: the source's %s was not deleted (or is not known to be), though its copy "
                    "is proven; rerun to delete it",
                    printable_name(name),
                )
            report.not_deleted.extend(stayed)

    async def worker() -> None:
        while True:
            try:
                info = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await budget.acquire(info.size)
            try:
                await copy_one(info)
            finally:
                await budget.release(info.size)
            tick(1, info.size)

    try:
        await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
        if deleting:
            try:  # (a disk store's files and renames, Redis's append-only file: on the disk before any source goes)
                await dst.make_durable([o.name for o in settled])
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"--delete-source stopped before deleting anything: {redact_url(dst.url)} could not make "
                    f"what it was given durable ({type(exc).__name__}: {exc}); every source is kept and the copies "
                    "stay. Rerun once that is fixed, or drop --delete-source"
                ) from exc
            await delete_settled()
    finally:
        journal.close()
    report.seconds = time.perf_counter() - t0
    return report
