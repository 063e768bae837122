"""The disk tier on the real file system: round trips, restarts, corruption, crashes, budget."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore.backends import open_backend
from kvstore.backends.base import Defect
from kvstore.backends.disk import DiskBackend
from kvstore.keys import ChunkKey
from kvstore.tier import Tier


def names(n: int, ns: str = "default") -> list[str]:
    return [ChunkKey("m", 1, 0, i - n // 2, namespace=ns).object_name() for i in range(n)]


def blob(i: int, size: int = 4096) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


async def test_round_trip_many_and_agreement(tmp_path: Path) -> None:
    be = open_backend(f"file://{tmp_path}")
    keys = names(40)
    assert await be.put_many([(k, blob(i)) for i, k in enumerate(keys)]) == [True] * 40
    got = await be.get_many([*keys, "default/m/vllm-1-0/ffff"])
    assert [bytes(g) for g in got[:40]] == [blob(i) for i in range(40)]
    assert got[40] is None
    assert await be.contains_many([*keys[:3], "nope/x"]) == [True, True, True, False]
    assert await be.delete_many([keys[0], keys[0]]) == [True, False]
    assert await be.contains_many([keys[0]]) == [False]
    listed = [info async for info in be.list("default/")]
    assert sorted(i.name for i in listed) == sorted(keys[1:])
    assert all(i.size == 4096 for i in listed)
    assert be.stats().objects == 39 and be.stats().bytes == 39 * 4096


async def test_get_into_caller_buffer(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path)
    await be.put("a/b", [b"head", b"-payload"])
    buf = bytearray(64)
    view = await be.get("a/b", alloc=lambda n: memoryview(buf))
    assert bytes(view) == b"head-payload"
    assert view.obj is buf


async def test_restart_finds_everything_in_a_new_process(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path)
    keys = names(10)
    await be.put_many([(k, blob(i)) for i, k in enumerate(keys)])
    script = (
        "import asyncio,sys; from kvstore.backends import open_backend\n"
        f"b = open_backend('file://{tmp_path}')\n"
        "print(b.stats().objects, b.stats().bytes)\n"
        f"got = asyncio.run(b.get_many({keys!r}))\n"
        "print(sum(g is not None for g in got))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        "python3", "-c", script, stdout=asyncio.subprocess.PIPE, env={**os.environ}
    )
    out, _ = await proc.communicate()
    assert out.decode().split() == ["10", "40960", "10"]


async def test_object_written_by_another_instance_after_open_is_found(tmp_path: Path) -> None:
    reader = DiskBackend(tmp_path)
    writer = DiskBackend(tmp_path)
    await writer.put("x/y", b"late")
    assert await reader.contains_many(["x/y"]) == [True]
    assert bytes(await reader.get("x/y")) == b"late"


async def test_quarantine_puts_back_a_file_renamed_into_place_after_its_compare(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Another process renames a new file into place between the quarantine's comparison
    and its rename: the file moved aside is not the one compared, so it goes back, and the
    object stays in service and on the books; nothing is left in quarantine/."""
    from kvstore.backends import disk

    be = DiskBackend(tmp_path, fsync=False)
    (name,) = names(1)
    bad, good = blob(1), blob(2)
    assert await be.put_many([(name, bad)]) == [True]
    path = be.path_of(name)
    real_holds = disk._holds

    def holds_then_replaced(f, size, expect):  # type: ignore[no-untyped-def]
        verdict = real_holds(f, size, expect)
        fresh = path.with_name(path.name + ".new")
        fresh.write_bytes(good)
        os.replace(fresh, path)  # as another process publishes a put
        return verdict

    monkeypatch.setattr(disk, "_holds", holds_then_replaced)
    assert await be.quarantine(name, "test", Defect(read=bad)) is False
    monkeypatch.undo()
    assert path.read_bytes() == good and await be.contains_many([name]) == [True]
    assert list((tmp_path / "quarantine").glob("*")) == []
    assert be.counters.quarantined == 0
    assert await be.quarantine(name, "test", Defect(read=bad)) is False  # holds the good bytes: left
    assert await be.quarantine(name, "test", Defect(read=good)) is True
    assert not path.exists() and await be.contains_many([name]) == [False]
    await be.close()


@pytest.mark.parametrize("path", ["frames", "streamed"])
async def test_a_read_of_a_corrupt_file_leaves_a_file_renamed_in_since(tmp_path: Path, path: str) -> None:
    """A read (a frame read, or the disk tier's mapped read into a target) finds a file
    corrupt; another process stores the chunk again before the quarantine: the read is
    a miss, and the new file (its change time after the read began) stays in service;
    with nothing written in between, the corrupt file is quarantined."""
    be = DiskBackend(tmp_path, fsync=False)
    tier = Tier(be)
    (name,) = names(1)
    value = torch.arange(4096, dtype=torch.float32)
    await tier.put_many([(name, value)])
    (raw,) = await be.get_many([name])
    good = bytes(raw)
    bad = bytearray(good)
    bad[-3] ^= 0x04
    method = "get_many" if path == "frames" else "read_streamed"
    for rewrite in (True, False):
        assert await be.put_many([(name, bytes(bad))]) == [True]
        await asyncio.sleep(0.1)  # (older than the change-time margin)
        real = getattr(be, method)

        async def then_rewrite(*args, real=real, rewrite=rewrite):  # type: ignore[no-untyped-def]
            got = await real(*args)
            if rewrite:
                assert await be.put_many([(name, good)]) == [True]  # lands after the read
            return got

        setattr(be, method, then_rewrite)
        if path == "frames":
            assert await tier.get_frames([name]) == [None]
        else:
            assert await tier.get_many([name], out=[torch.empty_like(value)]) == [None]
        setattr(be, method, real)
        if rewrite:
            assert be.counters.quarantined == 0
            (got,) = await tier.get_many([name])
            assert got is not None and torch.equal(got, value)
        else:
            assert be.counters.quarantined == 1 and await be.contains_many([name]) == [False]
    await tier.close()


async def test_corruption_is_a_quarantined_counted_miss(tmp_path: Path) -> None:
    tier = Tier(DiskBackend(tmp_path))
    keys = names(4)
    tensors = [torch.full((64, 64), float(i)) for i in range(4)]
    await tier.put_many(list(zip(keys, tensors)))
    be: DiskBackend = tier.backend  # type: ignore[assignment]
    flip, trunc, garbage = (be.path_of(k) for k in keys[:3])
    data = bytearray(flip.read_bytes())
    data[-100] ^= 0x01
    flip.write_bytes(bytes(data))
    trunc.write_bytes(trunc.read_bytes()[:-10])
    garbage.write_bytes(b"\x00garbage header" * 50)
    await asyncio.sleep(0.1)  # (bit rot keeps a file's change time; these writes do not: past the margin)
    got = await tier.get_many(keys)
    assert got[:3] == [None, None, None]
    assert got[3] is not None and torch.equal(got[3], tensors[3])
    assert tier.counters.corrupt == 3 and tier.counters.hits == 1
    assert be.counters.quarantined == 3
    assert len(list((tmp_path / "quarantine").glob("*.reason"))) == 3
    assert await be.contains_many(keys[:3]) == [False] * 3  # out of service, not served again


async def test_interrupted_write_is_invisible_and_cleaned(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path)
    await be.put("ns/whole", b"whole")
    torn = be.path_of("ns/torn").parent / ".999-1.tmp"  # what a crash mid-write leaves
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"half a frame")
    assert [i.name async for i in be.list()] == ["ns/whole"]
    assert await be.contains_many(["ns/torn"]) == [False]
    reopened = DiskBackend(tmp_path)  # the next open cleans up, in a thread of its own
    await reopened.ready()
    assert not torn.exists()
    assert reopened.stats().objects == 1


async def test_concurrent_writers_of_one_key_publish_a_whole_object(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    assert all(await be.put_many([("k/one", p) for p in payloads]))
    got = bytes(await be.get("k/one"))
    assert got in payloads
    assert be.stats().objects == 1 and be.stats().bytes == 200_000
    assert list((tmp_path / "objects").rglob(".*")) == []


@pytest.mark.parametrize(
    "hostile",
    ["../escape", "/etc/passwd", "a/../../b", "a\x00b", "x" * 1000, "./a", "a/./b", ""],
    ids=range(8),
)
async def test_hostile_names_cannot_escape_the_root(tmp_path: Path, hostile: str) -> None:
    root = tmp_path / "root"
    be = DiskBackend(root)
    assert await be.put_many([(hostile, b"x")]) == [False]
    assert be.counters.put_errors == 1
    assert await be.get_many([hostile]) == [None]
    outside = [p for p in tmp_path.rglob("*") if not str(p).startswith(str(root))]
    assert outside == []


async def test_odd_but_legal_names_stay_inside(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path / "root")
    odd = ["..a/b", "a/..b", "%2e%2e/x", "~x/y", "a" * 60 + "/" + "b" * 170]
    assert all(await be.put_many([(n, n.encode()) for n in odd]))
    for p in tmp_path.rglob("*"):
        assert p.resolve().is_relative_to((tmp_path / "root").resolve())
    reopened = DiskBackend(tmp_path / "root")
    assert sorted([i.name async for i in reopened.list()]) == sorted(odd)
    assert [bytes(v) for v in await reopened.get_many(odd)] == [n.encode() for n in odd]


async def test_budget_is_never_exceeded_and_eviction_is_lru(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=10 * 1000, fsync=False)
    keys = [f"ns/k{i}" for i in range(10)]
    for k in keys:
        assert await be.put(k, b"x" * 1000)
    await be.get("ns/k0")  # k0 is now the most recently used
    for i in range(10, 15):
        assert await be.put(f"ns/k{i}", b"y" * 1000)
        assert be.stats().bytes <= 10_000
    present = await be.contains_many(keys)
    assert present == [True, False, False, False, False, False, True, True, True, True]
    assert be.counters.evictions == 5
    assert sum(p.stat().st_size for p in (tmp_path / "objects").rglob("*") if p.is_file()) <= 10_000
    assert await be.put("ns/huge", b"z" * 20_000) is False  # larger than the whole budget


async def test_concurrent_puts_respect_the_budget(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=50_000, fsync=False, concurrency=8)
    ok = await be.put_many([(f"ns/c{i}", b"q" * 10_000) for i in range(20)])
    assert sum(ok) == 20
    assert be.stats().bytes <= 50_000
    on_disk = sum(p.stat().st_size for p in (tmp_path / "objects").rglob("*") if p.is_file())
    assert on_disk <= 50_000


async def test_lru_order_survives_a_restart(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=3000, fsync=False)
    for i in range(3):
        await be.put(f"ns/r{i}", b"x" * 1000)
        os.utime(be.path_of(f"ns/r{i}"), (1000 + i, 1000 + i))
    again = DiskBackend(tmp_path, capacity=3000, fsync=False)
    await again.put("ns/r3", b"x" * 1000)
    assert await again.contains_many([f"ns/r{i}" for i in range(4)]) == [False, True, True, True]


async def test_permission_denied_is_a_counted_error(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    await DiskBackend(tmp_path).put("a/b", b"x")
    for p in [tmp_path, *tmp_path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o600)  # readable and writable by root only
    code = (
        "import asyncio, os, concurrent.futures.thread  # imported before root-only paths go dark\n"
        "from kvstore.backends.disk import DiskBackend\n"
        f"b = DiskBackend({str(tmp_path)!r})\n"
        "os.setgid(65534); os.setuid(65534)  # now a stranger to the files\n"
        "ok = asyncio.run(b.put('a/c', b'y')); got = asyncio.run(b.get('a/b'))\n"
        "print(ok, got, b.counters.put_errors, b.counters.get_errors)\n"
    )
    proc = await asyncio.create_subprocess_exec(
        "python3", "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().split() == ["False", "None", "1", "1"]


async def test_unwritable_directory_is_a_counted_error(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path)
    shard = be.path_of("a/b").parent
    if shard.is_dir():  # made at open for the watch (which stops watching: a folder of it went away)
        shard.rmdir()
    shard.write_text("a file where a shard directory should be")  # every write there fails
    assert await be.put_many([("a/b", b"x")]) == [False]
    assert be.counters.put_errors == 1


async def test_disk_full_is_a_counted_error(tmp_path: Path) -> None:
    root = tmp_path / "small"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        be = DiskBackend(root, fsync=False)
        assert await be.put("a/small", b"s" * 1000)
        assert await be.put("a/big", b"x" * (1 << 20)) is False  # ENOSPC
        assert be.counters.put_errors == 1
        assert await be.contains_many(["a/big"]) == [False]
        assert list(root.rglob(".*")) == []  # the partial temp file is gone
        assert bytes(await be.get("a/small")) == b"s" * 1000
        await be.close()  # the index's files are open until then
    finally:
        subprocess.run(["umount", str(root)], check=False)


async def test_an_unsealed_frame_is_hashed_as_it_is_written(tmp_path: Path) -> None:
    """The disk tier computes an unsealed frame's checksum while it writes the payload:
    the file is the frame a sealed encode writes, and the frame object is sealed too."""
    from kvstore.frame import UnsealedFrame, decode_frame, encode_frame

    be = DiskBackend(tmp_path, fsync=False)
    payload = bytes(range(251)) * 12534  # 3 MiB; its CRC32C packs in 5 bytes, as the placeholder
    f = encode_frame([payload[:1000], payload[1000:]], codec="raw", key="a/b", ctime=3.0, sealed=False)
    assert isinstance(f, UnsealedFrame)
    assert await be.put_many([("a/b", f)]) == [True]
    assert f.sealed
    stored = bytes(await be.get("a/b"))
    assert stored == b"".join(encode_frame([payload], codec="raw", key="a/b", ctime=3.0))
    assert bytes(decode_frame(stored, key="a/b").payload) == payload
    # a second write of the same (now sealed) frame is a plain write of the same bytes
    assert await be.put_many([("a/c", f)]) == [True]
    assert bytes(await be.get("a/c")) == stored
    await be.close()


async def test_a_failed_sealing_write_leaves_the_frame_to_be_sealed_elsewhere(tmp_path: Path) -> None:
    from kvstore.frame import UnsealedFrame, decode_frame, encode_frame

    be = DiskBackend(tmp_path, watch=False)  # shard folders made as written, not at open
    be.path_of("a/b").parent.write_text("a file where a shard directory should be")
    f = encode_frame([b"p" * 70000], codec="raw", key="a/b", sealed=False)
    assert isinstance(f, UnsealedFrame)
    assert await be.put_many([("a/b", f)]) == [False]
    assert not f.sealed and f.claim()  # released: the next writer (another tier) can seal it
    f.release()
    f.ensure_sealed()
    assert bytes(decode_frame(b"".join(f), key="a/b").payload) == b"p" * 70000
    await be.close()


async def test_a_sealing_write_that_fails_midway_releases_the_frame_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import kvstore.backends.disk as disk
    from kvstore.frame import UnsealedFrame, decode_frame, encode_frame

    real = disk.pwrite_crc32c
    calls: list[int] = []

    def full(fd: int, src: memoryview, offset: int, value: int = 0) -> int:
        calls.append(offset)
        real(fd, src[: 1 << 20], offset, value)  # some of the payload lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "pwrite_crc32c", full)
    be = DiskBackend(tmp_path, fsync=False)
    f = encode_frame([b"q" * (3 << 20)], codec="raw", key="a/b", sealed=False)
    assert isinstance(f, UnsealedFrame)
    assert await be.put_many([("a/b", f)]) == [False]
    assert calls and be.counters.put_errors == 1
    assert await be.contains_many(["a/b"]) == [False]
    assert [p for p in (tmp_path / "objects").rglob("*") if p.is_file()] == []  # no temp file left
    assert not f.sealed
    f.ensure_sealed()  # released: another party seals it
    assert bytes(decode_frame(b"".join(f), key="a/b").payload) == b"q" * (3 << 20)
    await be.close()


async def test_vanished_file_is_a_miss(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path)
    await be.put("a/b", b"x")
    be.path_of("a/b").unlink()
    assert await be.get("a/b") is None
    assert be.counters.misses == 1 and be.stats().objects == 0


def test_bad_urls_say_what_to_write(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity"):
        open_backend(f"file://{tmp_path}?capacty=1GiB")
    with pytest.raises(ValueError, match="size"):
        open_backend(f"file://{tmp_path}?capacity=lots")
    with pytest.raises(ValueError, match="scheme"):
        open_backend("ftp://x")
    with pytest.raises(ValueError, match="local path"):
        open_backend("file://remotehost/x")


async def test_a_raw_name_cannot_take_a_long_names_file(tmp_path: Path) -> None:
    import hashlib

    from kvstore.backends.disk import encode_filename, shard_of

    def spelled(victim: str) -> str:  # a raw name spelling a long name's digest file name
        return "~" + hashlib.blake2b(victim.encode(), digest_size=20).hexdigest()

    long = (f"ns/{'x' * 260}/{i}" for i in range(100_000))
    victim = next(n for n in long if shard_of(n) == shard_of(spelled(n)))  # same directory
    crafted = spelled(victim)
    assert encode_filename(victim).startswith("~")
    be = DiskBackend(tmp_path / "root")
    assert await be.put(victim, b"victim")
    assert await be.put(crafted, b"crafted")
    assert [bytes(v) for v in await be.get_many([victim, crafted])] == [b"victim", b"crafted"]
    again = DiskBackend(tmp_path / "root")
    assert sorted([i.name async for i in again.list()]) == sorted([victim, crafted])
    assert [bytes(v) for v in await again.get_many([victim, crafted])] == [b"victim", b"crafted"]


async def test_names_starting_with_tilde_written_before_are_renamed_on_open(tmp_path: Path) -> None:
    from kvstore.backends.disk import shard_of

    name = "~x/y"
    shard = tmp_path / "root" / "objects" / shard_of(name)
    shard.mkdir(parents=True)
    (shard / "~x%2Fy").write_bytes(b"old")  # the layout an older kvstore wrote
    (shard / "~x%2Fy.name").write_text(name, "utf-8")
    be = DiskBackend(tmp_path / "root")
    assert [bytes(v) for v in await be.get_many([name])] == [b"old"]
    assert [i.name async for i in be.list()] == [name]
    assert sorted(p.name for p in shard.iterdir()) == ["%7Ex%2Fy"]


@given(st.text(alphabet=st.sampled_from("ab09_-.~/%Z é\\x00:"), max_size=60) | st.text(max_size=60))
def test_file_names_are_spelled_as_before_on_the_fast_path_too(name: str) -> None:
    """Files written by earlier versions are found: the file name of a name never changes
    (the spelling `quote` gives, '.' escaped, a leading '~' escaped, long names digested)."""
    from urllib.parse import quote

    from kvstore.backends.disk import MAX_FILENAME, encode_filename

    enc = quote(name, safe="-_").replace(".", "%2E")
    enc = "%7E" + enc[1:] if enc.startswith("~") else enc
    if len(enc) > MAX_FILENAME:
        enc = "~" + hashlib.blake2b(name.encode(), digest_size=20).hexdigest()
    assert encode_filename(name) == enc


async def test_stats_leave_the_calling_thread_on_a_remote_file_system_or_after_a_slow_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup may stat on the caller's thread (LMCache's, or the event loop) only where a
    stat is a local lookup: not on a network file system, not for a while after one took
    too long (a second, doubling while they stay slow, at most a minute)."""
    from kvstore.backends import disk

    be = DiskBackend(tmp_path / "d", fsync=False, watch=False)  # stats, not the kernel's file events
    await be.ready()
    assert await be.put("ns/m/f-1-0/1", b"x")
    assert disk.local_file_system(tmp_path) is True or be.contains_now(["ns/m/f-1-0/1"]) is None
    if disk.local_file_system(tmp_path):
        assert be.contains_now(["ns/m/f-1-0/1", "ns/m/f-1-0/2", "../x"]) == [True, False, False]
    now = [1000.0]
    be._clock = lambda: now[0]
    monkeypatch.setattr(disk, "SLOW_STAT_S", 0.0)  # every stat is "slow" now
    name = ["ns/m/f-1-0/1"]
    assert be.contains_now(name) == [True]  # answered, but it took too long (once: a busy process?)
    assert be.contains_now(name) == [True]  # twice in a row...
    assert be.contains_now(name) is None  # ...so a worker thread asks for a second
    assert await be.contains_many(["ns/m/f-1-0/1", "ns/m/f-1-0/2"]) == [True, False]  # still answered
    now[0] += 1.1
    assert be.contains_now(name) == [True]  # slow again, right after: two seconds now
    now[0] += 1.5
    assert be.contains_now(name) is None
    now[0] += 1.0
    monkeypatch.setattr(disk, "SLOW_STAT_S", 10.0)
    assert be.contains_now(name) == [True]  # a fast one forgets the streak
    monkeypatch.setattr(disk, "SLOW_STAT_S", 0.0)
    assert be.contains_now(name) == [True]
    assert be.contains_now(name) == [True]
    now[0] += 1.1  # one second again, not four
    assert be.contains_now(name) == [True]
    for _ in range(1100):  # slow for hours: never more than a minute at a time
        now[0] += 61
        assert be.contains_now(name) == [True]
        assert be.contains_now(name) is None
    now[0] += 61
    assert be.contains_now([]) == []  # nothing asked: no stat, and the streak stands
    assert await be.contains_many(name) == [True]
    assert be.contains_now(name) is None

    monkeypatch.setattr(disk, "local_file_system", lambda path: False)  # say, NFS
    remote = DiskBackend(tmp_path / "d", fsync=False)  # not watched either: another host's files raise no events here
    await remote.ready()
    assert remote._watch is None
    assert remote.contains_now(["ns/m/f-1-0/1"]) is None
    assert await remote.contains_many(["ns/m/f-1-0/1"]) == [True]
    await be.close()
    await remote.close()


def test_the_file_system_of_a_path_is_read_from_the_mount_table(tmp_path: Path) -> None:
    from kvstore.backends.disk import local_file_system

    assert local_file_system(Path("/proc/self")) is False  # procfs: not a place for objects
    shm = [line.split()[2] for line in Path("/proc/mounts").read_text().splitlines() if line.split()[1] == "/dev/shm"]
    if shm == ["tmpfs"]:
        assert local_file_system(Path("/dev/shm/kvstore-test")) is True


@pytest.mark.parametrize("route", ["frame", "streamed"])
async def test_an_object_over_the_readers_limit_is_a_counted_miss_left_in_place(
    tmp_path: Path, route: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Written by a store with a larger max_object_size: a reader with a smaller one
    refuses it unread (counted in `rejected`, logged with the option to raise) and
    leaves it where it is; it was moved into quarantine/, out of the writer's service."""
    big, small = names(2)
    writer = open_backend(f"{tmp_path.as_uri()}?max_object_size=8MiB")
    assert await writer.put_many([(big, blob(1, 2 << 20)), (small, blob(2))]) == [True, True]
    reader = open_backend(f"{tmp_path.as_uri()}?max_object_size=1MiB")
    if route == "frame":
        got = await reader.get_many([big, small])
        assert got[0] is None and bytes(got[1]) == blob(2)
    else:
        from kvstore.frame_sink import FrameSink

        verdicts = await reader.read_streamed([big], lambda n: FrameSink(n, lambda h: None))
        assert verdicts == [None]
    c = reader.stats().counters
    assert (c.rejected, c.quarantined) == (1, 0)
    assert "raise max_object_size" in caplog.text
    assert not any((tmp_path / "quarantine").iterdir())
    assert bytes(await writer.get(big)) == blob(1, 2 << 20)


async def test_a_write_the_caller_stopped_waiting_for_never_lands_torn(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A store call cancelled (its caller's deadline) while a worker thread hashes and
    writes the caller's tensor: the call returns at once, and that write is not
    published (the thread went on reading a buffer the caller reused: a torn object
    under a checksum computed as it was written); a later read is a miss, never the
    torn bytes, and the store is not left waiting on the device."""
    import threading
    import time as _time

    import kvstore.backends.disk as disk_module
    from kvstore.tiered import TieredStore

    real = disk_module.pwrite_crc32c
    began = threading.Event()

    def slow(fd, src, offset, value=0, block=1 << 20):  # type: ignore[no-untyped-def]
        began.set()
        view = memoryview(src).cast("B")
        for a in range(0, view.nbytes, 1 << 20):
            _time.sleep(0.2)  # a slow device: 200 ms a MiB
            value = real(fd, view[a : a + (1 << 20)], offset + a, value)
        return value

    monkeypatch.setattr(disk_module, "pwrite_crc32c", slow)
    store = TieredStore.from_urls([f"file://{tmp_path}?fsync=false"], discover=True)
    name = "t/m/raw-1-0/000001"
    t = torch.full((1 << 20,), 1.0)  # 4 MiB: hashed as it is written
    put = asyncio.ensure_future(store.put_many([(name, t)]))
    assert await asyncio.to_thread(began.wait, 5)
    cancelled_at = asyncio.get_running_loop().time()
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    assert asyncio.get_running_loop().time() - cancelled_at < 0.4  # not waiting on the device (0.8 s)
    t.fill_(7.0)  # the caller reuses its buffer while the thread still reads it
    await asyncio.sleep(1.0)
    (got,) = await store.get_many([name])
    assert got is None
    assert store.tiers[0].counters.corrupt == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    await store.close()
