"""One bad object stays one object's problem: oversized files and frames, a directory
where a file should be, a name that is not valid Unicode.  The rest of the batch is
served, listings go on and say what they could not read, and nothing is allocated for
a size that no object written here can have."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvstore.backends import open_backend
from kvstore.backends.disk import DiskBackend
from kvstore.cli.main import cli
from kvstore.keys import ChunkKey
from kvstore.ops.inspect import verify_store
from kvstore.ops.migrate import MigrateOptions, migrate
from kvstore.tier import Tier

GiB = 1 << 30
SURROGATE = "ns/m/vllm-1-0/bad\udc80"


def names(n: int) -> list[str]:
    return [ChunkKey("m", 1, 0, i, namespace="ns").object_name() for i in range(n)]


async def fill(root: Path, n: int = 4) -> tuple[Tier, dict[str, torch.Tensor]]:
    tier = Tier(DiskBackend(root, fsync=False))
    data = {name: torch.full((256,), float(i)) for i, name in enumerate(names(n))}
    assert all(await tier.put_many(list(data.items())))
    return tier, data


def run(*args: str) -> tuple[int, str]:
    res = (
        CliRunner(mix_stderr=False).invoke(cli, list(args)) if _mix() else CliRunner().invoke(cli, list(args))
    )
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output + (res.stderr if _mix() else "")


def _mix() -> bool:
    import inspect

    return "mix_stderr" in inspect.signature(CliRunner).parameters


async def test_file_extended_to_100_gib_is_a_refused_miss_left_in_place_and_the_batch_is_served(tmp_path: Path) -> None:
    """A file over the reader's max_object_size is a counted miss, not read and not
    quarantined (another process may have stored it under a larger limit)."""
    tier, data = await fill(tmp_path)
    bad = names(4)[1]
    os.truncate(tier.backend.path_of(bad), 100 * GiB)  # sparse: no disk used
    for fresh in (False, True):  # the size known from the index, and found by a new scan
        t = Tier(DiskBackend(tmp_path)) if fresh else tier
        if fresh:
            await _put_back(tmp_path, bad)
        got = await t.get_many(list(data))
        assert got[1] is None
        assert all(torch.equal(g, w) for g, w in zip(got[::2], list(data.values())[::2]))
        assert torch.equal(got[3], data[names(4)[3]])
        assert not (tmp_path / "quarantine").exists() or not any((tmp_path / "quarantine").iterdir())
        assert await t.contains_many([bad]) == [True]
        assert t.backend.counters.rejected >= 1


async def _put_back(root: Path, name: str) -> None:
    be = DiskBackend(root)
    assert await be.put(name, b"x")
    os.truncate(be.path_of(name), 100 * GiB)


async def test_streamed_reads_refuse_an_oversized_file(tmp_path: Path) -> None:
    tier, data = await fill(tmp_path, 2)
    bad = names(2)[0]
    os.truncate(tier.backend.path_of(bad), 100 * GiB)
    be = DiskBackend(tmp_path)
    from kvstore.frame_sink import FrameSink

    sinks = {n: FrameSink(n, lambda h: None) for n in data}
    verdicts = await be.read_streamed(list(data), lambda n: sinks[n])
    assert verdicts[0] is None and verdicts[1] is not None


async def test_max_object_size_is_configurable(tmp_path: Path) -> None:
    be = open_backend(f"{(tmp_path / 's').as_uri()}?max_object_size=1MiB")
    assert be.max_object_bytes == 1 << 20
    assert await be.put_many([("ns/small", b"x" * 1000), ("ns/big", b"x" * (2 << 20))]) == [True, False]
    plain = DiskBackend(tmp_path / "s")
    assert await plain.put("ns/big", b"x" * (2 << 20))  # written by a store with a larger limit
    assert [None if v is None else len(v) for v in await be.get_many(["ns/big", "ns/small"])] == [None, 1000]
    with pytest.raises(ValueError, match="max_object_size"):
        open_backend(f"{(tmp_path / 's').as_uri()}?max_object_size=0")


def test_verify_and_migrate_do_not_read_an_oversized_object(tmp_path: Path) -> None:
    tier, _ = asyncio.run(fill(tmp_path / "src"))
    bad = names(4)[2]
    os.truncate(tier.backend.path_of(bad), 100 * GiB)
    code, out = run("verify", (tmp_path / "src").as_uri(), "--json")
    assert code == 1, out
    report = json.loads(out.splitlines()[0])
    assert list(report["bad"]) == [bad] and "TooLarge" in report["bad"][bad] and report["ok"] == 3
    code, out = run("stat", (tmp_path / "src").as_uri(), "--json")
    st = json.loads(out.splitlines()[0])  # headers only: the size its header gives is not the file's
    assert (
        code == 1
        and st["objects"] == 4
        and st["unreadable"] == 1
        and st["by_codec"]["unreadable"]["objects"] == 1
    )
    assert tier.backend.path_of(bad).exists()  # stat reads, never quarantines

    async def go() -> None:
        src = DiskBackend(tmp_path / "src")
        dst = open_backend((tmp_path / "dst").as_uri())
        rep = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
        assert rep.corrupt == [bad] and rep.copied == 3 and rep.deleted == 3
        assert await src.contains_many([bad]) == [True]  # never deleted

    asyncio.run(go())


async def test_a_directory_in_place_of_an_object_file(tmp_path: Path) -> None:
    tier, data = await fill(tmp_path)
    bad = names(4)[0]
    path = tier.backend.path_of(bad)
    path.unlink()
    path.mkdir()
    be = DiskBackend(tmp_path)  # reopened: the scan must not index the directory
    assert await be.contains_many(list(data)) == [False, True, True, True]
    listed = [i.name async for i in be.list()]
    assert sorted(listed) == sorted(names(4)[1:]) and [u[0] for u in be.unlisted] == [bad]
    code, out = await asyncio.to_thread(run, "ls", tmp_path.as_uri())
    assert (
        code == 1
        and "unreadable, not listed" in out
        and len([ln for ln in out.splitlines() if "h  " in ln]) == 3
    )
    got = await Tier(be).get_many(list(data))
    assert got[0] is None and all(g is not None for g in got[1:])
    assert not path.exists() and any((tmp_path / "quarantine").iterdir())  # moved aside
    assert await be.contains_many([bad]) == [False]


@pytest.mark.parametrize("url", ["mem://surrogates", "file"])
async def test_a_name_that_is_not_unicode_fails_alone(tmp_path: Path, url: str) -> None:
    be = open_backend(tmp_path.as_uri() if url == "file" else url)
    ok_name = "ns/m/vllm-1-0/ok"
    assert await be.put_many([(ok_name, b"a"), (SURROGATE, b"b")]) == [True, False]
    assert [None if v is None else bytes(v) for v in await be.get_many([SURROGATE, ok_name])] == [None, b"a"]
    assert await be.contains_many([SURROGATE, ok_name]) == [False, True]
    assert await be.delete_many([SURROGATE, ok_name]) == [False, True]
    tier = Tier(be)
    assert await tier.put_many([(SURROGATE, torch.ones(2)), (ok_name, torch.ones(2))]) == [False, True]
    got = await tier.get_many([SURROGATE, ok_name])
    assert got[0] is None and torch.equal(got[1], torch.ones(2))


async def test_verify_store_reports_an_oversized_object_without_reading_it(tmp_path: Path) -> None:
    tier, _ = await fill(tmp_path)
    os.truncate(tier.backend.path_of(names(4)[3]), 100 * GiB)
    rep = await verify_store(DiskBackend(tmp_path))
    assert list(rep.bad) == [names(4)[3]] and rep.ok == 3 and rep.quarantined == 0
