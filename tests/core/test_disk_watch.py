"""A disk tier's lookups answered from the kernel's file events (`ObjectWatch`), not a
`stat` per name: what another process publishes, overwrites, deletes or quarantines is
seen by the next lookup, with no wait; temp files, side files and folders are not
objects; lost events mean a new listing; a store moved or deleted under it, or a fork,
turns the watch off for good (its inotify instance closed) and lookups stat files again,
with the same answers.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import struct
import sys
from pathlib import Path

import pytest

from kvstore.backends import disk_watch
from kvstore.backends.disk import DiskBackend, encode_filename, shard_of
from kvstore.backends.disk_watch import IN_MOVED_TO, IN_Q_OVERFLOW, ObjectWatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")

N = [f"ns/m/f-1-0/{i}" for i in range(6)]


def _no_stats(be: DiskBackend) -> None:
    def refuse(name: str) -> int | None:
        raise AssertionError(f"stat of {name}: the watch should have answered")

    be._file_size = refuse  # type: ignore[method-assign]


async def _backend(root: Path, **kw) -> DiskBackend:
    be = DiskBackend(root, fsync=False, **kw)
    await be.ready()
    assert await be.watching() is kw.get("watch", True)
    return be


async def _until(cond, what: str, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within {seconds}s")


def _overflow(watch: ObjectWatch) -> None:
    with watch._lock:  # what the kernel sends when its queue overflowed
        watch._apply(struct.pack("iIII", -1, IN_Q_OVERFLOW, 0, 0))


async def test_what_another_process_publishes_or_deletes_is_seen_at_once(tmp_path: Path) -> None:
    ours = await _backend(tmp_path / "d")
    theirs = await _backend(tmp_path / "d")  # another process's view of the same folder
    assert await ours.put_many([(N[0], b"a")]) == [True]
    _no_stats(ours)
    assert ours.contains_now(N[:3]) == [True, False, False]
    assert await theirs.put_many([(N[1], b"b"), (N[2], b"c" * 100_000)]) == [True, True]
    assert ours.contains_now(N[:3]) == [True, True, True], "published before the lookup: seen, no wait"
    assert await theirs.put_many([(N[1], b"b2")]) == [True]  # renamed over the old file: no delete event
    assert await theirs.delete_many([N[0]]) == [True]
    await theirs.quarantine(N[2], "test")
    assert ours.contains_now(N[:3]) == [False, True, False]
    long_name = "ns/m/f-1-0/" + "x" * 300  # stored under a digest, with a side file
    assert await theirs.put_many([(long_name, b"l")]) == [True]
    assert ours.contains_now([long_name, N[3], "../escape", "", "ns/m/f-1-0/\udc00"]) == [True] + [False] * 4
    (ours.objects_dir / shard_of(N[4]) / encode_filename(N[4])).mkdir()  # a folder where an object would be
    assert ours.contains_now([N[4]]) == [False]
    assert ours.contains_now_most() > 64, "a long prompt's miss is answered here too"
    assert ours.stats().extra["lookups"] == "file events"
    await ours.close()
    await theirs.close()


async def test_temp_files_and_leftovers_are_not_objects(tmp_path: Path) -> None:
    be = await _backend(tmp_path / "d")
    shard = be.objects_dir / shard_of(N[4])
    (shard / f".{os.getpid()}-99.tmp").write_bytes(b"half")  # a write in progress
    (shard / (encode_filename(N[4]) + ".name")).write_bytes(b"x")
    _no_stats(be)
    assert be.contains_now([N[4]]) == [False]
    os.replace(shard / f".{os.getpid()}-99.tmp", shard / encode_filename(N[4]))  # published by rename
    assert be.contains_now([N[4]]) == [True]
    await be.close()


async def test_changes_to_a_folder_after_it_was_listed_are_not_lost(tmp_path: Path, monkeypatch) -> None:
    folders = [tmp_path / s for s in ("00", "01")]
    for f in folders:
        f.mkdir()
    (folders[0] / "before").write_bytes(b"")
    (folders[0] / "gone-later").write_bytes(b"")
    real = os.scandir

    class Listed:
        """The folder's entries as listed, then the folder changed behind the listing."""

        def __init__(self, path: str) -> None:
            with real(path) as it:
                self.entries = list(it)
            if path == str(folders[0]):
                (folders[0] / "gone-later").unlink()
                (folders[0] / "new-later").write_bytes(b"")

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(disk_watch.os, "scandir", Listed)
    watch = ObjectWatch.open(str(f) for f in folders)
    assert watch is not None
    assert watch.held(["before"]) is None, "no answer before the first listing"
    watch.scan()
    assert watch.held(["before", "gone-later", "new-later", "never"]) == [True, False, True, False]
    watch.close()
    assert watch.held(["before"]) is None and watch._fd == -1


async def test_lost_events_mean_a_new_listing_and_stats_meanwhile(tmp_path: Path) -> None:
    be = await _backend(tmp_path / "d")
    assert await be.put_many([(N[5], b"x")]) == [True]
    watch = be._watch
    assert watch is not None and watch.ready
    _overflow(watch)
    assert not watch.ready and watch.failed is None
    assert be.contains_now([N[5], N[0]]) == [True, False], "stats answer meanwhile, the same"
    assert await be.put_many([(N[0], b"y")]) == [True]  # published while it lists again
    await _until(lambda: watch.ready, "listed again")
    _no_stats(be)
    assert be.contains_now([N[5], N[0], N[1]]) == [True, True, False]
    for _ in range(disk_watch.MAX_LISTINGS):  # overflowing again and again: it gives up
        _overflow(watch)
        await _until(lambda: watch.ready or watch.failed, "listed again or gave up")
    assert watch.failed and "overflowed" in watch.failed and watch._fd == -1
    await be.close()


async def test_a_listing_after_lost_events_trusts_only_what_follows_it(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "00"
    folder.mkdir()
    (folder / "kept").write_bytes(b"")
    watch = ObjectWatch.open([str(folder)])
    assert watch is not None
    watch.scan()
    with watch._lock:  # dropped events, then one that came before the drop ended: "x" never stayed
        watch._apply(struct.pack("iIII", -1, IN_Q_OVERFLOW, 0, 0) + struct.pack("iIII", 1, IN_MOVED_TO, 0, 4) + b"x\0\0\0")
    assert watch.held(["kept"]) is None, "not answering until listed again"
    watch.scan()
    assert watch.held(["kept", "x"]) == [True, False]

    real = os.scandir

    def overflowing(path: str):  # the kernel drops events while the folder is listed
        _overflow(watch)
        return real(path)

    monkeypatch.setattr(disk_watch.os, "scandir", overflowing)
    _overflow(watch)
    watch.scan()
    assert not watch.ready, "a listing that overlapped lost events is not trusted"
    monkeypatch.setattr(disk_watch.os, "scandir", real)
    watch.scan()
    assert watch.held(["kept", "x"]) == [True, False]
    watch.close()


@pytest.mark.parametrize("how", ["shard folder removed", "store moved", "store deleted"])
async def test_a_store_moved_or_deleted_under_it_stops_the_watch_for_good(tmp_path: Path, how: str) -> None:
    be = await _backend(tmp_path / "d", capacity=None)
    assert await be.put_many([(N[0], b"x")]) == [True]
    watch = be._watch
    assert watch is not None
    if how == "shard folder removed":
        os.rmdir(be.objects_dir / ("ab" if shard_of(N[0]) != "ab" else "ac"))
    elif how == "store moved":
        os.rename(tmp_path / "d", tmp_path / "moved")
    else:
        import shutil

        shutil.rmtree(tmp_path / "d")
    await _until(lambda: watch.failed is not None, "the watch saw it")
    assert watch._fd == -1, "its inotify instance is given back"
    assert not be._watching()
    assert be.stats().extra["lookups"].startswith("stat (") and watch.failed in be.stats().extra["lookups"]
    await be.close()


async def test_watch_false_and_names_with_events_of_their_own(tmp_path: Path) -> None:
    off = await _backend(tmp_path / "d", watch=False)
    assert off._watch is None and off.contains_now([N[0]]) == [False]
    assert off.contains_now_most() == 64
    await off.close()
    folder = tmp_path / "f"
    folder.mkdir()
    watch = ObjectWatch.open([str(folder)])
    assert watch is not None
    watch.scan()
    with watch._lock:  # a name in an event is NUL-padded to a multiple of 4 bytes
        watch._apply(struct.pack("iIII", 1, IN_MOVED_TO, 0, 8) + b"abc\0\0\0\0\0")
    assert watch.held(["abc"]) == [True]
    watch.close()


def _child_sees(wid: int, watch_failed) -> None:  # runs in a forked child
    from kvstore.backends.disk_watch import _LIVE

    watch_failed.put([w.failed for w in _LIVE if id(w) == wid])


async def test_a_forked_child_does_not_take_the_parents_events(tmp_path: Path) -> None:
    be = await _backend(tmp_path / "d")
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_sees, args=(id(be._watch), q))
    p.start()
    seen = q.get(timeout=10)
    p.join(10)
    assert len(seen) == 1 and seen[0] and "forked" in seen[0]
    assert be._watching(), "the parent's watch goes on"
    assert await be.put_many([(N[1], b"x")]) == [True]
    _no_stats(be)
    assert be.contains_now([N[1]]) == [True]
    await be.close()


def test_disk_urls_take_the_watch_option_and_read_only_opens_create_nothing(tmp_path: Path) -> None:
    be = DiskBackend.from_url(f"file://{tmp_path}/d?watch=false")
    assert be._watched.done() and be._watch is None
    assert list((tmp_path / "d" / "objects").iterdir()) == [], "unwatched: shard folders come with writes"
    asyncio.run(be.close())
    existing = DiskBackend.open_existing(f"file://{tmp_path}/d")  # what `kvstore ls` / `stat` open
    assert existing._watch is None and list((tmp_path / "d" / "objects").iterdir()) == []
    asyncio.run(existing.close())
    with pytest.raises(ValueError):
        DiskBackend.from_url(f"file://{tmp_path}/d?watch=maybe")
