"""A disk tier's lookups answered from the kernel's file events (`ObjectWatch`), not a
`stat` per name: what another process publishes or deletes is seen by the next lookup,
with no wait; temp and side files are not objects; a watch that lost events or its
folders stops answering and lookups stat files again, with the same answers.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
from pathlib import Path

import pytest

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
    return be


async def test_what_another_process_publishes_or_deletes_is_seen_at_once(tmp_path: Path) -> None:
    ours = await _backend(tmp_path / "d")
    theirs = await _backend(tmp_path / "d")  # another process's view of the same folder
    assert ours._watching(), "a local file system is watched once the store is ready"
    assert await ours.put_many([(N[0], b"a")]) == [True]
    _no_stats(ours)
    assert ours.contains_now(N[:3]) == [True, False, False]
    assert await theirs.put_many([(N[1], b"b"), (N[2], b"c" * 100_000)]) == [True, True]
    assert ours.contains_now(N[:3]) == [True, True, True], "published before the lookup: seen, no wait"
    assert await theirs.delete_many([N[0]]) == [True]
    assert ours.contains_now(N[:3]) == [False, True, True]
    long_name = "ns/m/f-1-0/" + "x" * 300  # stored under a digest, with a side file
    assert await theirs.put_many([(long_name, b"l")]) == [True]
    assert ours.contains_now([long_name, N[3], "../escape", ""]) == [True, False, False, False]
    assert ours.contains_now_most() >= 128, "a long prompt's miss is answered here too"
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


async def test_the_listing_and_the_events_during_it_agree(tmp_path: Path) -> None:
    folders = [tmp_path / s for s in ("00", "01")]
    for f in folders:
        f.mkdir()
    (folders[0] / "before").write_bytes(b"")
    (folders[1] / "gone-soon").write_bytes(b"")
    watch = ObjectWatch.open(str(f) for f in folders)
    assert watch is not None
    assert watch.held(["before"]) is None, "no answer before the first listing"
    (folders[1] / "gone-soon").unlink()  # after the watch, before the listing
    (folders[0] / "during").write_bytes(b"")
    watch.drain()  # events read while not ready are kept for the listing
    watch.scan()
    assert watch.held(["before", "gone-soon", "during", "never"]) == [True, False, True, False]
    watch.close()
    assert watch.held(["before"]) is None


async def test_lost_events_or_a_removed_folder_turn_the_watch_off_and_stats_answer(tmp_path: Path) -> None:
    be = await _backend(tmp_path / "d")
    assert await be.put_many([(N[5], b"x")]) == [True]
    watch = be._watch
    assert watch is not None and watch.ready
    with watch._lock:  # what the kernel sends when its queue overflowed
        watch._apply(struct.pack("iIII", -1, IN_Q_OVERFLOW, 0, 0))
    assert watch.failed and "overflowed" in watch.failed
    assert not be._watching() and be.contains_now_most() == 64
    assert be.contains_now([N[5], N[0]]) == [True, False], "stats answer, the same"
    await be.close()

    other = await _backend(tmp_path / "e")
    assert other._watch is not None
    os.rmdir(other.objects_dir / "ab")  # a shard folder removed under the store
    for _ in range(100):
        if other._watch.failed:
            break
        await asyncio.sleep(0.01)
    assert other._watch.failed and "removed" in other._watch.failed
    assert other.contains_now([N[0]]) == [False]
    await other.close()


async def test_watch_false_and_names_with_events_of_their_own(tmp_path: Path) -> None:
    off = await _backend(tmp_path / "d", watch=False)
    assert off._watch is None and off.contains_now([N[0]]) == [False]
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


def test_disk_urls_take_the_watch_option(tmp_path: Path) -> None:
    be = DiskBackend.from_url(f"file://{tmp_path}/d?watch=false")
    assert be._watched.done() and be._watch is None
    asyncio.run(be.close())
    with pytest.raises(ValueError):
        DiskBackend.from_url(f"file://{tmp_path}/d?watch=maybe")
