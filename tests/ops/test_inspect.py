"""ls / stat / verify / gc through the command line, on a real disk store."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvstore.backends.disk import DiskBackend
from kvstore.cli.main import cli
from kvstore.keys import ChunkKey
from kvstore.tier import Tier


def populate(root: Path) -> list[str]:
    async def go() -> list[str]:
        tier = Tier(DiskBackend(root, fsync=False))
        names = []
        for i in range(6):
            ns = "a" if i < 4 else "b"
            name = ChunkKey("llama", 1, 0, i, namespace=ns).object_name()
            await tier.put_many([(name, torch.full((1024,), float(i)))])
            names.append(name)
        return names

    return asyncio.run(go())


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def test_ls_and_stat(tmp_path: Path) -> None:
    names = populate(tmp_path)
    code, out = run("ls", tmp_path.as_uri(), "--json")
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert sorted(x["name"] for x in listed) == sorted(names)
    code, out = run("ls", tmp_path.as_uri(), "--namespace", "b")
    assert code == 0 and len(out.splitlines()) == 2
    code, out = run("stat", tmp_path.as_uri(), "--json")
    st = json.loads(out)
    assert st["objects"] == 6
    assert st["by_namespace"]["a"]["objects"] == 4 and st["by_namespace"]["b"]["objects"] == 2
    assert st["by_codec"]["raw"]["objects"] == 6
    assert st["by_age"]["<1h"]["objects"] == 6


def test_verify_finds_a_bit_flip_and_quarantines(tmp_path: Path) -> None:
    names = populate(tmp_path)
    be = DiskBackend(tmp_path)
    p = be.path_of(names[3])
    blob = bytearray(p.read_bytes())
    blob[len(blob) // 2] ^= 0x08
    p.write_bytes(bytes(blob))
    code, out = run("verify", tmp_path.as_uri(), "--json")
    report = json.loads(out)
    assert code == 1 and list(report["bad"]) == [names[3]] and report["ok"] == 5
    assert "Checksum" in report["bad"][names[3]]
    code, out = run("verify", tmp_path.as_uri(), "--quarantine", "--json")
    assert json.loads(out)["quarantined"] == 1
    code, out = run("verify", tmp_path.as_uri(), "--json")
    assert code == 0 and json.loads(out)["ok"] == 5
    assert any((tmp_path / "quarantine").iterdir())


@pytest.mark.parametrize("kind", ["disk", "redis", "redis-parts", "s3"])
async def test_verify_quarantine_leaves_a_copy_written_since_its_read(kind, tmp_path, request) -> None:  # type: ignore[no-untyped-def]
    """verify reads a corrupt object; before it quarantines, a writer puts a good copy
    under the name (a repair, an engine storing the chunk again). The good copy stays in
    service (it was moved aside or deleted); the name is reported as not quarantined. With
    nothing written in between, the corrupt object is quarantined as before."""
    from kvstore.backends import open_backend
    from kvstore.ops.inspect import verify_store

    if kind == "disk":
        url = tmp_path.as_uri() + "?fsync=false"
    elif kind == "s3":
        url = request.getfixturevalue("s3_url")()
    else:
        url = request.getfixturevalue("redis_url")(**({"part_size": "64KiB"} if kind == "redis-parts" else {}))
    b = open_backend(url)
    tier = Tier(b)
    name = ChunkKey("m", 1, 0, 7).object_name()
    value = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB: several parts with part_size=64KiB
    await tier.put_many([(name, value)])
    (good,) = await b.get_many([name])
    good = bytes(good)
    bad = bytearray(good)
    bad[-5] ^= 0x10  # a payload bit flip: the frame's checksum fails
    for rewrite in (True, False):
        assert await b.put_many([(name, bytes(bad))]) == [True]
        real = b.get_many
        pending = [rewrite]

        async def get_many(names, alloc=None, real=real, pending=pending):  # type: ignore[no-untyped-def]
            got = await real(names, alloc)
            if pending[0] and name in names:
                pending[0] = False
                assert await b.put_many([(name, good)]) == [True]  # lands after verify's read
            return got

        b.get_many = get_many  # type: ignore[method-assign]
        report = await verify_store(b, quarantine=True)
        b.get_many = real  # type: ignore[method-assign]
        assert name in report.bad
        if rewrite:
            assert report.quarantined == 0 and report.not_quarantined == [name]
            got = await tier.get_many([name])
            assert got[0] is not None and torch.equal(got[0], value)
        else:
            assert report.quarantined == 1 and report.not_quarantined == []
            assert await b.contains_many([name]) == [False]
    await tier.close()


def test_verify_quarantines_only_what_it_read_and_found_defective(tmp_path: Path) -> None:
    """An object over the reader's size limit is reported, never read, so never moved
    aside; a file that is no kvstore frame at all is reported and left where it is."""
    names = populate(tmp_path)
    be = DiskBackend(tmp_path)
    foreign = be.path_of(names[1])
    foreign.write_bytes(b"another program's bytes")
    small = be.path_of(names[0]).stat().st_size - 1
    url = f"{tmp_path.as_uri()}?max_object_size={small}"
    code, out = run("verify", url, "--quarantine", "--json")
    report = json.loads(out.splitlines()[-1])
    assert code == 1 and report["foreign"] == [names[1]] and report["quarantined"] == 0
    assert len(report["bad"]) == len(names) - 1  # every kvstore object is over the limit
    assert all("TooLarge" in why and "not read" in why for why in report["bad"].values())
    assert foreign.exists() and all(be.path_of(n).exists() for n in names)


async def test_verify_tells_an_unreadable_object_from_a_vanished_one() -> None:
    """A read that fails while the object is still listed is a fault (reported, exit 1),
    not a deletion that happened meanwhile."""
    from kvstore.backends.memory import MemoryBackend
    from kvstore.ops.inspect import verify_store

    class Failing(MemoryBackend):
        async def get_many(self, names, alloc=None):  # type: ignore[no-untyped-def]
            self.counters.get_errors += len(names)
            return [None] * len(names)  # as a backend answers a read that failed

    be = Failing("mem://")
    tier = Tier(be)
    name = ChunkKey("llama", 1, 0, 0, namespace="a").object_name()
    await tier.put_many([(name, torch.zeros(8))])
    report = await verify_store(be)
    assert report.unreadable == [name] and report.missing == 0 and report.ok == 0


def test_gc_budget_oldest_first_and_age(tmp_path: Path) -> None:
    names = populate(tmp_path)
    be = DiskBackend(tmp_path)
    size = be.path_of(names[0]).stat().st_size
    # make creation order explicit: rewrite frames' ctime via mtime fallback is not used; frames carry ctime
    code, out = run("gc", tmp_path.as_uri(), "--max-bytes", str(3 * size), "--dry-run", "--json")
    dry = json.loads(out)
    assert dry["deleted"] == names[:3] and len(list(be._entries())) == 6
    code, out = run("gc", tmp_path.as_uri(), "--max-bytes", str(3 * size), "--json")
    assert code == 0 and json.loads(out)["after_bytes"] <= 3 * size
    left = sorted(i for i, _ in DiskBackend(tmp_path)._entries())
    assert left == sorted(names[3:])  # the oldest went first
    code, out = run("gc", tmp_path.as_uri(), "--older-than", "1h", "--json")
    assert json.loads(out)["deleted"] == []
    time.sleep(1.1)
    code, out = run("gc", tmp_path.as_uri(), "--older-than", "1s", "--namespace", "b", "--json")
    assert sorted(json.loads(out)["deleted"]) == sorted(names[4:])


def test_gc_leaves_what_is_not_a_kvstore_frame(tmp_path: Path) -> None:
    """Another program's object under the prefix is neither deleted (by age or budget)
    nor counted in the budget; a damaged kvstore frame (its magic still there) is ours
    to collect."""
    names = populate(tmp_path)
    be = DiskBackend(tmp_path)
    foreign = be.path_of(names[1])
    foreign.write_bytes(b"another program's bytes")
    damaged = be.path_of(names[2])
    blob = bytearray(damaged.read_bytes())
    blob[8] ^= 0xFF  # inside the header: unreadable, the magic intact
    damaged.write_bytes(bytes(blob))
    time.sleep(1.1)
    code, out = run("gc", tmp_path.as_uri(), "--older-than", "1s", "--json")
    report = json.loads(out.splitlines()[0])
    assert code == 0 and report["foreign"] == [names[1]] and names[1] not in report["deleted"]
    assert names[2] in report["deleted"] and report["before_objects"] == len(names) - 1
    assert foreign.exists() and not damaged.exists()


def test_gc_refuses_a_budget_that_would_delete_everything(tmp_path: Path) -> None:
    """Values a size parser reads as "no limit" (or a fraction of a byte) are no budget to
    keep: gc refuses them, deletes nothing, and says how to delete everything on purpose."""
    names = populate(tmp_path)
    for value in ("none", "inf", "unbounded", "", "0", "0.5"):
        code, out = run("gc", tmp_path.as_uri(), "--max-bytes", value, "--older-than", "7d")
        assert code == 2 and "would delete every object" in out and "--older-than 0s" in out, (value, out)
    assert sorted(i for i, _ in DiskBackend(tmp_path)._entries()) == sorted(names)


def test_gc_with_a_prefix_outside_its_namespace_deletes_nothing(tmp_path: Path) -> None:
    """--namespace and --prefix both filter: a prefix in another namespace matches nothing
    (it once replaced the namespace, so gc deleted there)."""
    names = populate(tmp_path)
    time.sleep(1.1)
    code, out = run("gc", tmp_path.as_uri(), "--namespace", "a", "--prefix", "b/", "--older-than", "1s", "--json")
    assert code == 0 and json.loads(out)["deleted"] == []
    code, out = run("ls", tmp_path.as_uri(), "b/", "--namespace", "a")
    assert code == 0 and out.strip() == ""
    assert sorted(i for i, _ in DiskBackend(tmp_path)._entries()) == sorted(names)
    code, out = run("gc", tmp_path.as_uri(), "--namespace", "b", "--prefix", "b/", "--older-than", "1s", "--json")
    assert sorted(json.loads(out)["deleted"]) == sorted(names[4:])


def test_a_tier_url_from_a_store_config_works_as_written(tmp_path: Path) -> None:
    """The URL a store's config names (with store options) lists the same objects; a bad
    store option is an error that names it."""
    names = populate(tmp_path)
    url = f"{tmp_path.as_uri()}?capacity=10GiB&write=through&policy=lru&fsync=false"
    code, out = run("ls", url, "--json")
    assert code == 0, out
    assert sorted(json.loads(line)["name"] for line in out.splitlines()) == sorted(names)
    code, out = run("ls", f"{tmp_path.as_uri()}?write=sideways")
    assert code == 2 and "write=" in out


def test_clear_errors_and_exit_codes(tmp_path: Path) -> None:
    code, out = run("ls", "ftp://nowhere")
    assert code == 2 and "unknown backend scheme" in out
    code, out = run("gc", tmp_path.as_uri())
    assert code == 2 and "--older-than" in out
    code, out = run("gc", tmp_path.as_uri(), "--older-than", "soon")
    assert code == 2 and "duration" in out
    assert os.path.exists(tmp_path)


def test_unreachable_redis_is_exit_3_with_the_fix() -> None:
    from kvstore.testing.seaweed import free_port

    code, out = run("stat", f"redis://127.0.0.1:{free_port()}/0?connect_timeout=0.5&timeout=1")
    assert code == 3
    assert "redis-server running" in out


def test_wrong_s3_credentials_are_exit_3_with_the_fix(s3_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    url = s3_url()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    code, out = run("ls", url)
    assert code == 3
    assert "credential" in out.lower() or "signature" in out.lower()


async def test_gc_leaves_an_object_whose_header_it_could_not_read(redis_url) -> None:  # type: ignore[no-untyped-def]
    """A Redis listing has no modification time: an object of which nothing could be read
    back (a failed read, a value caught mid-overwrite) was aged from 0, so any
    --older-than deleted it and --max-bytes took it first. Now it is reported and left."""
    from kvstore.backends import open_backend
    from kvstore.ops.inspect import gc_store

    b = open_backend(redis_url())
    tier = Tier(b)
    names = [ChunkKey("m", 1, 0, i).object_name() for i in range(3)]
    await tier.put_many([(n, torch.full((64,), float(i))) for i, n in enumerate(names)])
    real = b.read_heads

    async def read_heads(ns, nbytes):  # type: ignore[no-untyped-def]
        got = await real(ns, nbytes)
        return [None if n == names[1] else g for n, g in zip(ns, got)]

    b.read_heads = read_heads  # type: ignore[method-assign]
    report = await gc_store(b, older_than_s=3600)
    assert report.deleted == [] and report.unreadable == [names[1]]
    report = await gc_store(b, max_bytes=1)
    assert names[1] not in report.deleted and len(report.deleted) == 2
    assert (await b.contains_many([names[1]])) == [True]
    await tier.close()


async def test_gc_removes_redis_leftover_parts(redis_url) -> None:  # type: ignore[no-untyped-def]
    import os

    from kvstore.backends import open_backend

    url = redis_url(part_size="4MiB")
    b = open_backend(url)
    name = ChunkKey("m", 1, 0, 1).object_name()
    assert await b.put(name, os.urandom(10 << 20))  # three parts
    assert await b.put(name, os.urandom(2 << 20))  # one big single-part value leaves the old parts behind
    await b.close()
    code, out = await asyncio.to_thread(run, "gc", url, "--max-bytes", "1TiB", "--json")
    report = json.loads(out.splitlines()[0])  # (then a line on stderr: the value is no frame, so left)
    assert code == 0 and report["deleted"] == [] and report["leftovers_removed"] == 0  # young: a write may be under way
    code, out = await asyncio.to_thread(run, "gc", url, "--max-bytes", "1TiB", "--stale-uploads", "0s", "--json")
    report = json.loads(out.splitlines()[0])
    assert code == 0 and report["deleted"] == [] and report["leftovers_removed"] == 3  # the old value's parts
    b = open_backend(url)
    assert len(await b.get(name)) == 2 << 20  # the live value is untouched
    await b.close()


def test_verify_reports_a_frame_under_another_name(tmp_path: Path) -> None:
    names = populate(tmp_path)
    be = DiskBackend(tmp_path)
    be.path_of(names[1]).write_bytes(be.path_of(names[0]).read_bytes())
    code, out = run("verify", tmp_path.as_uri(), "--json")
    report = json.loads(out)
    assert code == 1 and list(report["bad"]) == [names[1]]
    assert "MisplacedFrameError" in report["bad"][names[1]]


def test_ls_escapes_control_characters_and_newlines(tmp_path: Path) -> None:
    odd = ["ns/evil\nname", "ns/bell\x07\x1b[31mred", "ns/tab\there\u202e"]

    async def go() -> None:
        be = DiskBackend(tmp_path)
        assert all(await be.put_many([(n, b"x") for n in odd]))

    asyncio.run(go())
    code, out = run("ls", tmp_path.as_uri())
    lines = out.splitlines()
    assert code == 0 and len(lines) == len(odd)
    assert not any(c in out for c in "\x07\x1b")
    assert any(line.endswith("ns/evil\\nname") for line in lines)
    code, out = run("ls", tmp_path.as_uri(), "--json")
    assert sorted(json.loads(line)["name"] for line in out.splitlines()) == sorted(odd)


def test_stat_counts_misplaced_and_resized_frames_unreadable_and_reads_long_headers(tmp_path: Path) -> None:
    from kvstore.frame import encode_frame

    names = populate(tmp_path)
    be = DiskBackend(tmp_path)
    be.path_of(names[1]).write_bytes(be.path_of(names[0]).read_bytes())  # misplaced
    with be.path_of(names[2]).open("ab") as f:
        f.write(b"\0" * 100)  # longer than its header says
    long_name = "a/long-header"
    parts = encode_frame([b"\0" * 16], codec="raw", shape=(16,), key=long_name, meta={"pad": "x" * 8000})
    asyncio.run(be.put(long_name, parts))
    code, out = run("stat", tmp_path.as_uri(), "--json")
    st = json.loads(out.splitlines()[0])
    assert code == 1 and st["unreadable"] == 2 and st["by_codec"]["raw"]["objects"] == 5


async def test_gc_never_takes_a_failed_header_read_for_damage(redis_url) -> None:  # type: ignore[no-untyped-def]
    """A header read that fails (a timeout, a stall) is no damage: on Redis (no
    modification time) such a fresh object read its frame magic on a later read, was
    classed a damaged frame aged from the epoch, and any --older-than deleted it. Only
    bytes read and refused are damage, and a damaged frame with no time to age it by is
    not the oldest: --older-than leaves it, --max-bytes takes it last."""
    from kvstore.backends import open_backend
    from kvstore.backends import redis_layout as layout
    from kvstore.ops.inspect import HEAD_BYTES, gc_store

    b = open_backend(redis_url())
    tier = Tier(b)
    names = [ChunkKey("m", 1, 0, i).object_name() for i in range(3)]
    await tier.put_many([(n, torch.full((64,), float(i))) for i, n in enumerate(names)])
    real = b.read_heads
    failed = []

    async def read_heads(ns, nbytes):  # type: ignore[no-untyped-def]
        got = await real(ns, nbytes)
        if nbytes == HEAD_BYTES and names[1] in ns and not failed:  # the first header read of it fails
            failed.append(names[1])
            return [None if n == names[1] else g for n, g in zip(ns, got)]
        return got

    b.read_heads = read_heads  # type: ignore[method-assign]
    report = await gc_store(b, older_than_s=3600)
    assert failed and report.deleted == [] and report.unreadable == [] and report.undated == []
    assert await b.contains_many(names) == [True] * 3

    key = layout.data_key(b.options.prefix, names[2])
    value = bytearray(await b.client.get(key))
    value[8] ^= 0xFF  # inside the header, the magic intact: damaged, of unknown age
    await b.client.set(key, bytes(value))
    report = await gc_store(b, older_than_s=3600)
    assert report.deleted == [] and report.undated == [names[2]]
    size = len(value)
    report = await gc_store(b, max_bytes=2 * size)  # one object over the budget: the oldest dated one
    assert report.deleted == [names[0]]
    await tier.close()
