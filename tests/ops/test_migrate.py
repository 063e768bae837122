"""Migration between mem and disk backends, resumability after kill -9, recode, corruption."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from kvstore.backends import open_backend
from kvstore.backends.disk import DiskBackend
from kvstore.keys import PROBE_PREFIX, ChunkKey
from kvstore.ops import migrate as migrate_module
from kvstore.ops.migrate import MigrateOptions, migrate
from kvstore.tier import Tier
from tests.support.required import require_module


def key(i: int, ns: str = "tenant", model: str = "m") -> str:
    return ChunkKey(model, 1, 0, i - 5, namespace=ns).object_name()


async def fill(
    url: str, n: int, shape: tuple[int, ...] = (2, 4, 16, 64), ns: str = "tenant", model: str = "m"
) -> dict[str, torch.Tensor]:
    tier = Tier.open(url)
    data = {key(i, ns, model): torch.randn(shape, dtype=torch.float16) for i in range(n)}
    assert all(await tier.put_many(list(data.items()), layout="KV_2LTD"))
    return data


async def assert_same(url: str, data: dict[str, torch.Tensor]) -> None:
    got = await Tier.open(url).get_many(list(data))
    for (name, want), have in zip(data.items(), got):
        assert have is not None, name
        assert torch.equal(have, want), name


@pytest.mark.parametrize("pair", ["mem->file", "file->mem", "file->file", "mem->mem"])
async def test_migrate_pairs_byte_equal(tmp_path: Path, pair: str) -> None:
    urls = {"mem": f"mem://src-{pair}", "file": (tmp_path / "a").as_uri()}
    src_kind, dst_kind = pair.split("->")
    src_url = urls[src_kind] if src_kind == "mem" else (tmp_path / "src").as_uri()
    dst_url = f"mem://dst-{pair}" if dst_kind == "mem" else (tmp_path / "dst").as_uri()
    data = await fill(src_url, 12)
    src, dst = open_backend(src_url), open_backend(dst_url)
    report = await migrate(src, dst, MigrateOptions(journal=tmp_path / "j.jsonl"))
    assert (report.copied, report.failed, report.corrupt) == (12, [], [])
    await assert_same(dst_url, data)
    raw_src = await src.get_many(list(data))
    raw_dst = await dst.get_many(list(data))
    assert [bytes(a) for a in raw_src] == [bytes(b) for b in raw_dst]  # frames copied as they are
    again = await migrate(src, dst, MigrateOptions(journal=tmp_path / "j.jsonl"))
    assert (again.copied, again.already_done) == (0, 12)  # idempotent


KINDS = ["mem", "file", "s3", "redis"]


@pytest.mark.parametrize(
    ("src_kind", "dst_kind"), [(a, b) for a in KINDS for b in KINDS if {"s3", "redis"} & {a, b}]
)
async def test_migrate_pairs_with_servers_byte_equal(
    make_url, tmp_path: Path, src_kind: str, dst_kind: str
) -> None:  # type: ignore[no-untyped-def]
    src_url, dst_url = make_url(src_kind), make_url(dst_kind)
    data = await fill(src_url, 6, shape=(2, 4, 64, 128))
    src, dst = open_backend(src_url), open_backend(dst_url)
    try:
        report = await migrate(src, dst, MigrateOptions(journal=tmp_path / "j"))
        assert (report.copied, report.failed, report.corrupt) == (6, [], [])
        raw_src = await src.get_many(list(data))
        raw_dst = await dst.get_many(list(data))
        assert [bytes(a) for a in raw_src] == [bytes(b) for b in raw_dst]
        await assert_same(dst_url, data)
    finally:
        await src.close()
        await dst.close()


async def test_filters_and_dry_run(tmp_path: Path) -> None:
    src_url = (tmp_path / "src").as_uri()
    a = await fill(src_url, 4, ns="a", model="m1")
    await fill(src_url, 3, ns="b", model="m1")
    await fill(src_url, 2, ns="a", model="m2")
    src, dst = open_backend(src_url), open_backend("mem://filters")
    dry = await migrate(
        src, dst, MigrateOptions(namespace="a", model="m1", dry_run=True, journal=tmp_path / "d")
    )
    assert (dry.listed, dry.copied) == (4, 4) and await dst.contains_many(list(a)) == [False] * 4
    by_model = await migrate(src, dst, MigrateOptions(model="m1", journal=tmp_path / "m"))
    assert by_model.copied == 7
    by_prefix = await migrate(
        src, open_backend("mem://filters2"), MigrateOptions(prefix="b/", journal=tmp_path / "p")
    )
    assert by_prefix.copied == 3


async def test_corrupt_source_object_is_reported_not_copied(tmp_path: Path) -> None:
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 5)
    names = list(data)
    src = DiskBackend(tmp_path / "src")
    bad = src.path_of(names[2])
    blob = bytearray(bad.read_bytes())
    blob[-7] ^= 0x40
    bad.write_bytes(bytes(blob))
    dst = open_backend((tmp_path / "dst").as_uri())
    report = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
    assert report.corrupt == [names[2]] and report.copied == 4
    assert await dst.contains_many(names) == [True, True, False, True, True]
    assert await src.contains_many([names[2]]) == [True]  # never deleted: nothing verified to replace it
    assert report.deleted == 4


async def test_delete_source_only_after_verified_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 6)
    src = open_backend(src_url)
    broken = DiskBackend(tmp_path / "dst", watch=False)  # shard folders made as written, not at open
    for name in list(data)[:3]:  # a file where the shard directory should be: those writes fail
        broken.path_of(name).parent.write_text("not a directory")
    # the destination's probe object (a random name) lands in a shard that works: one in
    # about 85 random names fell in a broken one, and migrate rightly refused to begin
    bad = {broken.path_of(n).parent for n in list(data)[:3]}
    token = next(t for t in (f"{i:024x}" for i in range(1000)) if broken.path_of(PROBE_PREFIX + t).parent not in bad)
    monkeypatch.setattr(migrate_module, "secrets", types.SimpleNamespace(token_hex=lambda n: token, token_bytes=os.urandom))
    report = await migrate(src, broken, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
    assert sorted(report.failed) == sorted(n for n in list(data)[:3] if not broken.path_of(n).parent.is_dir())
    assert len(report.failed) == 3 and report.deleted == 3
    left = await src.contains_many(list(data))
    assert [n for n, x in zip(data, left) if x] == [n for n in data if n in report.failed]
    await assert_same((tmp_path / "dst").as_uri(), {n: t for n, t in data.items() if n not in report.failed})


async def test_delete_source_into_a_budgeted_store_is_refused(tmp_path: Path) -> None:
    src_url = (tmp_path / "src").as_uri()
    await fill(src_url, 2)
    with pytest.raises(ValueError, match="delete-source"):
        await migrate(
            open_backend(src_url),
            DiskBackend(tmp_path / "dst", capacity=1 << 20),
            MigrateOptions(delete_source=True),
        )


async def test_delete_source_into_the_source_under_another_url_is_refused(tmp_path: Path) -> None:
    """One store under two URLs (a path through a link, a trailing slash): every source
    object would be found "done" in the destination and deleted, its only copy."""
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 3)
    (tmp_path / "link").symlink_to(tmp_path / "src")
    for alias in ((tmp_path / "link").as_uri(), src_url + "/"):
        with pytest.raises(ValueError, match="are one store"):
            await migrate(
                open_backend(src_url), open_backend(alias), MigrateOptions(delete_source=True, journal=tmp_path / "j")
            )
    src = open_backend(src_url)
    assert await src.contains_many(list(data)) == [True] * 3
    assert [i.name async for i in src.list("kvstore-migrate-probe/")] == []  # the probe is gone
    report = await migrate(src, open_backend((tmp_path / "dst").as_uri()), MigrateOptions(delete_source=True))
    assert report.deleted == 3  # two stores: the probe lets it through


@pytest.mark.parametrize(
    ("a", "b", "nested"),
    [
        ("s3://b?endpoint_url=http://127.0.0.1:9000", "s3://b/p?endpoint_url=http://127.0.0.1:9000", True),
        ("s3://b/p/q?endpoint_url=http://127.0.0.1:9000/", "s3://b/p?endpoint_url=HTTP://127.0.0.1:9000", True),
        ("s3://b/a?endpoint_url=http://127.0.0.1:9000", "s3://b/ab?endpoint_url=http://127.0.0.1:9000", False),
        ("s3://b/a?endpoint_url=http://127.0.0.1:9000", "s3://c/a?endpoint_url=http://127.0.0.1:9000", False),
        ("s3://b/a?endpoint_url=http://127.0.0.1:9000", "s3://b/a?endpoint_url=http://127.0.0.1:9001", False),
        ("s3://b", "s3://b/p?region=eu-west-1", True),  # AWS bucket names are global
        ("s3://b", "s3://b/p?endpoint_url=https://s3.eu-west-1.amazonaws.com", True),
        ("redis://127.0.0.1/0?prefix=x:", "redis://127.0.0.1:6379/0?prefix=x:y:", False),  # x:{… and x:y:{…
        ("redis://127.0.0.1/0?prefix=x:", "redis://127.0.0.1:6379/0?prefix=x:", True),
        ("redis://127.0.0.1/0?prefix=x:", "redis://127.0.0.1:6379/1?prefix=x:", False),
    ],
)
def test_stores_sharing_keys_are_told_from_their_urls(a: str, b: str, nested: bool) -> None:
    """Two stores whose keys share one space and whose prefixes contain one another (the
    source's listing would hold destination objects, copied into themselves and deleted):
    told from the URLs alone, with equal spellings of one endpoint, server or database."""
    from kvstore.ops.migrate import nested_stores

    src, dst = open_backend(a), open_backend(b)
    assert nested_stores(src, dst) is nested and nested_stores(dst, src) is nested


async def test_a_probe_the_source_failed_to_read_is_no_answer(tmp_path: Path) -> None:
    """The source's read of the probe fails (a reset, a 503): "not found" cannot be told
    from "another store", so --delete-source stops instead of deleting."""
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 2)
    src = open_backend(src_url)

    async def failing_get(names, alloc=None):  # type: ignore[no-untyped-def]
        src.counters.get_errors += len(names)
        return [None] * len(names)

    src.get_many = failing_get  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="cannot be told"):
        await migrate(src, open_backend((tmp_path / "dst").as_uri()), MigrateOptions(delete_source=True))
    assert await open_backend(src_url).contains_many(list(data)) == [True] * 2


async def test_delete_source_into_memory_or_unsynced_disk_is_refused(tmp_path: Path) -> None:
    """A mem:// store lives in this process only; a disk store with fsync=false can lose
    what it was given in a crash: neither may hold the only copy."""
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 2)
    for dst_url, why in (("mem://delete-into-mem", "memory only"), ((tmp_path / "d").as_uri() + "?fsync=false", "fsync=false")):
        with pytest.raises(ValueError, match=why):
            await migrate(open_backend(src_url), open_backend(dst_url), MigrateOptions(delete_source=True))
    assert await open_backend(src_url).contains_many(list(data)) == [True] * 2


async def test_delete_source_syncs_the_destination_directories_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file is synced before its rename; the renames are on the disk once their
    directories are: synced before any source is deleted."""
    import kvstore.backends.disk as disk_module

    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 4)
    src, dst = open_backend(src_url), DiskBackend(tmp_path / "dst")
    synced: list[Path] = []
    real_sync = disk_module._sync_directories
    real_delete = src.delete_many

    def sync(dirs: set[Path]) -> None:
        synced.extend(dirs)
        real_sync(dirs)

    async def delete_many(names):  # type: ignore[no-untyped-def]
        assert {dst.path_of(n).parent for n in names} <= set(synced)  # synced before any deletion
        return await real_delete(names)

    monkeypatch.setattr(disk_module, "_sync_directories", sync)
    monkeypatch.setattr(src, "delete_many", delete_many)
    report = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
    assert report.deleted == 4 and {dst.path_of(n).parent for n in data} <= set(synced)


async def test_delete_source_needs_the_read_back_and_its_own_journal(tmp_path: Path) -> None:
    """--delete-source with --no-verify-after-write is refused (its last check reads
    headers only, so a torn copy could cost its source); names an unverified run wrote
    are read and checked by a later --delete-source run, not skipped on its journal."""
    with pytest.raises(ValueError, match="drop --no-verify-after-write"):
        MigrateOptions(delete_source=True, verify_after_write=False)
    src_url, dst_url = (tmp_path / "src").as_uri(), (tmp_path / "dst").as_uri()
    data = await fill(src_url, 3)
    src = open_backend(src_url)
    first = await migrate(src, open_backend(dst_url), MigrateOptions(verify_after_write=False))
    assert first.copied == 3
    torn = DiskBackend(tmp_path / "dst").path_of(next(iter(data)))
    blob = bytearray(torn.read_bytes())
    blob[-5] ^= 0x10  # the copy rotted (or was torn) after the unverified write
    torn.write_bytes(bytes(blob))
    again = await migrate(src, open_backend(dst_url), MigrateOptions(delete_source=True))
    assert again.already_done == 2 and again.copied == 1 and again.deleted == 3
    await assert_same(dst_url, data)  # the rotten copy was found and written again
    code = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "migrate", src_url, dst_url, "--delete-source", "--no-verify-after-write"],
        capture_output=True,
        text=True,
    )
    assert code.returncode == 2 and "drop --no-verify-after-write" in code.stderr

    # one journal named for both runs: the unverified run's names are not skipped either
    one = tmp_path / "one-journal"
    src_url2, dst_url2 = (tmp_path / "src2").as_uri(), (tmp_path / "dst2").as_uri()
    data2 = await fill(src_url2, 2)
    await migrate(open_backend(src_url2), open_backend(dst_url2), MigrateOptions(verify_after_write=False, journal=one))
    rot = DiskBackend(tmp_path / "dst2").path_of(next(iter(data2)))
    blob = bytearray(rot.read_bytes())
    blob[-5] ^= 0x10
    rot.write_bytes(bytes(blob))
    checked = await migrate(open_backend(src_url2), open_backend(dst_url2), MigrateOptions(delete_source=True, journal=one))
    assert (checked.copied, checked.already_done, checked.deleted) == (1, 1, 2)
    await assert_same(dst_url2, data2)


async def test_recode_raw_to_cachegen_shrinks(tmp_path: Path) -> None:
    require_module("kvstore.codec.cachegen")
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 4, shape=(2, 30, 256, 192))
    dst_url = (tmp_path / "dst").as_uri()
    report = await migrate(
        open_backend(src_url),
        open_backend(dst_url),
        MigrateOptions(recode="cachegen", journal=tmp_path / "j"),
    )
    assert report.copied == 4
    assert report.written_bytes * 3 < report.copied_bytes
    got = await Tier.open(dst_url).get_many(list(data))
    for have, want in zip(got, data.values()):
        assert have.shape == want.shape and have.dtype == want.dtype
        assert (
            torch.nn.functional.cosine_similarity(have.float().flatten(), want.float().flatten(), dim=0)
            > 0.95
        )


def test_kill_9_then_rerun_finishes_writing_each_object_once(tmp_path: Path) -> None:
    src_url = (tmp_path / "src").as_uri()
    dst_root = tmp_path / "dst"
    data = asyncio.run(fill(src_url, 120, shape=(2, 8, 64, 256)))  # 120 x 512 KiB
    env = {**os.environ, "KVSTORE_HOME": str(tmp_path / "home")}
    cmd = [
        sys.executable,
        "-m",
        "kvstore.cli.main",
        "migrate",
        src_url,
        dst_root.as_uri(),
        "--concurrency",
        "1",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline:
        n = (
            sum(1 for p in (dst_root / "objects").rglob("*") if p.is_file() and not p.name.startswith("."))
            if dst_root.exists()
            else 0
        )
        if n >= 10:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    survivors = {
        p: p.stat().st_ino
        for p in (dst_root / "objects").rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }
    assert 10 <= len(survivors) < 120, "the kill must land mid-migration"
    out = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["copied"] + report["already_done"] == 120
    assert report["copied"] == 120 - len(survivors)  # each missing object written once, nothing twice
    for path, inode in survivors.items():
        assert path.stat().st_ino == inode  # what was done before the kill was not rewritten
    asyncio.run(assert_same(dst_root.as_uri(), data))
    verify = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "verify", dst_root.as_uri(), "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] == 120


async def _swap_two(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 4)
    a, b = (DiskBackend(tmp_path / "src").path_of(n) for n in list(data)[:2])
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(blob_b)
    b.write_bytes(blob_a)  # two intact frames, each under the other's name
    return src_url, data


@pytest.mark.parametrize("recode", [None, "raw", "cachegen"])
async def test_swapped_objects_are_neither_copied_nor_deleted(tmp_path: Path, recode: str | None) -> None:
    if recode == "cachegen":
        require_module("kvstore.codec.cachegen")
    src_url, data = await _swap_two(tmp_path)
    names = list(data)
    src, dst = open_backend(src_url), open_backend((tmp_path / "dst").as_uri())
    report = await migrate(
        src, dst, MigrateOptions(recode=recode, delete_source=True, journal=tmp_path / "j")
    )
    assert sorted(report.corrupt) == sorted(names[:2]) and report.copied == 2 and report.deleted == 2
    assert await dst.contains_many(names) == [False, False, True, True]
    assert await src.contains_many(names) == [True, True, False, False]  # the swapped ones stay


def test_cli_migrate_of_swapped_objects_exits_nonzero(tmp_path: Path) -> None:
    src_url, data = asyncio.run(_swap_two(tmp_path))
    env = {**os.environ, "KVSTORE_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli.main",
            "migrate",
            src_url,
            (tmp_path / "d").as_uri(),
            "--recode",
            "raw",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr
    assert all(f"corrupt in source, skipped: {n}" in out.stderr for n in list(data)[:2])


@pytest.fixture
def evicting_redis():  # type: ignore[no-untyped-def]
    from kvstore.testing.redis_server import RedisServer, redis_available
    from tests.support.required import REDIS_INSTALL, require

    require(redis_available(), "redis-server", REDIS_INSTALL)
    with RedisServer(extra=["--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru"]) as srv:
        yield srv


async def test_delete_source_into_an_evicting_redis_is_refused(tmp_path: Path, evicting_redis) -> None:  # type: ignore[no-untyped-def]
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 200, shape=(2, 4, 64, 64))  # 200 x 64 KiB: more than the server's 10mb
    src, dst = open_backend(src_url), open_backend(evicting_redis.url)
    try:
        with pytest.raises(ValueError, match="maxmemory-policy noeviction") as refused:
            await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
        assert "allkeys-lru" in str(refused.value) and "--delete-source" in str(refused.value)
        assert await src.contains_many(list(data)) == [True] * 200
        assert [o async for o in dst.list()] == []  # refused before anything was written
    finally:
        await dst.close()


async def test_delete_source_deletes_only_what_the_destination_still_holds(
    tmp_path: Path, evicting_redis, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A destination that evicts without saying so (its risks hidden here): every object is
    checked again once all are written, and only sources whose copy is still there go."""
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 200, shape=(2, 4, 64, 64))
    src, dst = open_backend(src_url), open_backend(evicting_redis.url)

    async def no_risks() -> list[str]:
        return []

    monkeypatch.setattr(dst, "retention_risks", no_risks, raising=False)
    read_heads = dst.read_heads

    async def stop_evicting_then_read(names, nbytes):  # type: ignore[no-untyped-def]
        # the server evicted while the objects were written; from the final check on it
        # stops, so what the check saw is what stays (reads alone can make Redis evict)
        await dst.client.config_set("maxmemory", 0)
        return await read_heads(names, nbytes)

    monkeypatch.setattr(dst, "read_heads", stop_evicting_then_read)
    try:
        report = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
        names = list(data)
        in_dst = dict(zip(names, await dst.contains_many(names)))
        in_src = dict(zip(names, await src.contains_many(names)))
        assert all(in_dst[n] or in_src[n] for n in names)  # nothing is in neither store
        assert report.deleted == sum(in_dst.values())
        assert report.lost and not report.ok, "the server must have evicted part of what was written"
        assert report.deleted == 200 - len(report.lost) - len(report.failed)
        assert all(in_src[n] and not in_dst[n] for n in report.lost)
        await assert_same(evicting_redis.url, {n: t for n, t in data.items() if not in_src[n]})
    finally:
        await dst.close()


async def test_delete_source_into_a_redis_with_ttl_is_refused(tmp_path: Path, redis_url) -> None:  # type: ignore[no-untyped-def]
    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 5)
    for options in ({"ttl": "2"}, {"ttl.tenant": "60"}):
        dst = open_backend(redis_url(**options))
        try:
            with pytest.raises(ValueError, match=r"after ttl(\.tenant)?=[0-9]+s"):
                await migrate(
                    open_backend(src_url), dst, MigrateOptions(delete_source=True, journal=tmp_path / "j")
                )
            assert await dst.contains_many(list(data)) == [False] * 5
        finally:
            await dst.close()


def test_cli_delete_source_into_a_redis_with_ttl_names_the_fix(tmp_path: Path, redis_url) -> None:  # type: ignore[no-untyped-def]
    src_url = (tmp_path / "src").as_uri()
    data = asyncio.run(fill(src_url, 3))
    env = {**os.environ, "KVSTORE_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "migrate", src_url, redis_url(ttl="2"), "--delete-source"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr
    assert "drop ?ttl=" in out.stderr
    assert asyncio.run(open_backend(src_url).contains_many(list(data))) == [True] * 3


async def test_a_rerun_with_delete_source_deletes_what_an_earlier_run_copied(tmp_path: Path) -> None:
    src_url, dst_url = (tmp_path / "src").as_uri(), (tmp_path / "dst").as_uri()
    data = await fill(src_url, 6)
    src, dst = open_backend(src_url), open_backend(dst_url)
    first = await migrate(src, dst, MigrateOptions(journal=tmp_path / "j"))
    assert (first.copied, first.deleted) == (6, 0)
    victim = DiskBackend(tmp_path / "dst").path_of(next(iter(data)))
    victim.unlink()  # gone from the destination since: copied again, then deleted
    again = await migrate(
        src, open_backend(dst_url), MigrateOptions(delete_source=True, journal=tmp_path / "j")
    )
    assert (again.copied, again.already_done, again.deleted, again.lost) == (1, 5, 6, [])
    assert await src.contains_many(list(data)) == [False] * 6
    await assert_same(dst_url, data)


async def test_delete_source_proves_each_journaled_copy_before_deleting_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun with --delete-source read nothing of what its journal said was done: a
    copy truncated since (a torn file, a disk error) cost its source. Now each copy is
    read whole and checked (checksum, key, size) first: a bad one is copied again,
    and a source whose copy cannot be made good is kept and the run fails."""
    src_url, dst_url = (tmp_path / "src").as_uri(), (tmp_path / "dst").as_uri()
    data = await fill(src_url, 3)
    first = await migrate(open_backend(src_url), open_backend(dst_url), MigrateOptions(journal=tmp_path / "j"))
    assert first.copied == 3
    torn, stuck = list(data)[:2]
    for name in (torn, stuck):
        os.truncate(DiskBackend(tmp_path / "dst").path_of(name), 5000)
    dst = open_backend(dst_url)
    real_put = dst.put_many

    async def put_many(items):  # type: ignore[no-untyped-def]
        return [False if n == stuck else (await real_put([(n, v)]))[0] for n, v in items]  # `stuck`: refused

    monkeypatch.setattr(dst, "put_many", put_many)
    src = open_backend(src_url)
    again = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
    assert (again.copied, again.already_done, again.deleted, again.failed) == (1, 1, 2, [stuck])
    assert not again.ok
    assert await src.contains_many(list(data)) == [n == stuck for n in data]  # its copy is torn: kept
    await assert_same(dst_url, {n: t for n, t in data.items() if n != stuck})  # the torn one made good


async def test_delete_source_syncs_copies_an_unsynced_run_left_before_deleting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first run into the destination with fsync=false leaves its copies in the page
    cache; a later --delete-source run (fsync on) found them in place and deleted their
    sources having synced only directories. Now each such copy's file is synced before
    any source goes."""
    src_url, dst_dir = (tmp_path / "src").as_uri(), tmp_path / "dst"
    data = await fill(src_url, 3)
    first = await migrate(
        open_backend(src_url), open_backend(dst_dir.as_uri() + "?fsync=false"), MigrateOptions(journal=tmp_path / "j")
    )
    assert first.copied == 3
    synced: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    src, dst = open_backend(src_url), DiskBackend(dst_dir)
    real_delete = src.delete_many

    async def delete_many(names):  # type: ignore[no-untyped-def]
        for n in names:
            st = dst.path_of(n).stat()
            assert (st.st_dev, st.st_ino) in synced, f"{n}: its copy was not synced before its source went"
        return await real_delete(names)

    monkeypatch.setattr(src, "delete_many", delete_many)
    report = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
    assert (report.already_done, report.deleted) == (3, 3)
    await assert_same(dst_dir.as_uri(), data)
