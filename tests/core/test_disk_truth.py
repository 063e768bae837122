"""The disk tier tells the truth about deletes, survives its directory being removed,
and read-only commands never create a store that was not there."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import aiofiles.os
import pytest

from kvstore.backends.disk import DiskBackend
from kvstore.ops.inspect import gc_store


def _erofs(path: object = None, *args: object, **kwargs: object) -> None:
    if path is not None and not os.path.lexists(path):  # type: ignore[arg-type]
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    raise OSError(errno.EROFS, "Read-only file system")


async def _aerofs(path: object = None, *args: object, **kwargs: object) -> None:
    _erofs(path)


def read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Removals fail as on a file system remounted read-only."""
    monkeypatch.setattr(os, "remove", _erofs)
    monkeypatch.setattr(os, "unlink", _erofs)
    monkeypatch.setattr(aiofiles.os, "remove", _aerofs)


async def test_delete_on_a_read_only_file_system_is_not_reported_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.frame import encode_frame

    be = DiskBackend(tmp_path)
    frames = {n: encode_frame([n.encode()], codec="raw", key=n) for n in ("ns/a", "ns/b")}  # gc collects frames only
    assert await be.put_many(list(frames.items())) == [True, True]
    read_only(monkeypatch)
    assert await be.delete_many(["ns/a", "ns/missing"]) == [False, False]
    assert be.path_of("ns/a").exists()
    assert await be.contains_many(["ns/a"]) == [True]  # still indexed: it is still there
    assert be.stats().counters.delete_errors == 1 and be.stats().counters.deletes == 0
    assert be.stats().bytes == sum(p.nbytes for parts in frames.values() for p in parts)
    report = await gc_store(be, max_bytes=0)
    assert sorted(report.not_deleted) == ["ns/a", "ns/b"] and report.deleted == []
    monkeypatch.undo()
    assert await be.delete_many(["ns/a"]) == [True]


async def test_eviction_that_cannot_delete_refuses_the_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = DiskBackend(tmp_path, capacity=100)
    assert await be.put("ns/a", b"x" * 80)
    read_only(monkeypatch)
    assert await be.put("ns/b", b"y" * 80) is False  # room cannot be made: no overshoot, no hang
    assert be.stats().bytes == 80


def _ro_bind(src: Path, dst: Path) -> bool:
    dst.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    if subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True).returncode:
        return False
    if subprocess.run(["mount", "-o", "remount,ro,bind", str(dst)], capture_output=True).returncode:
        subprocess.run(["umount", str(dst)], capture_output=True)
        return False
    return True


async def test_delete_on_a_real_read_only_mount(tmp_path: Path) -> None:
    src, ro = tmp_path / "src", tmp_path / "ro"
    async with DiskBackend(src) as writer:
        assert await writer.put("ns/a", b"a")
    if not _ro_bind(src, ro):
        pytest.skip("needs root and mount to make a read-only bind mount")
    try:
        be = DiskBackend(ro)
        assert await be.delete_many(["ns/a"]) == [False]
        assert be.path_of("ns/a").exists() and await be.contains_many(["ns/a"]) == [True]
        await be.close()  # the index's files are open until then
    finally:
        subprocess.run(["umount", str(ro)], check=True)


async def test_store_directory_removed_while_running_is_recreated(tmp_path: Path) -> None:
    root = tmp_path / "store"
    be = DiskBackend(root)
    assert await be.put("ns/a", b"a")
    shutil.rmtree(root)
    assert await be.get_many(["ns/a"]) == [None]
    assert [i async for i in be.list()] == [] and be.unlisted  # says the directory is gone
    assert await be.put_many([("ns/b", b"b"), ("ns/c", b"c")]) == [True, True]
    assert [bytes(v) for v in await be.get_many(["ns/b", "ns/c"])] == [b"b", b"c"]
    shutil.rmtree(root)
    assert await be.put("ns/d", b"not a frame")
    await be.quarantine("ns/d", "test")  # the quarantine directory is remade too
    assert be.stats().counters.quarantined == 1


@pytest.mark.parametrize(
    "args",
    [["ls"], ["stat"], ["verify"], ["gc", "--max-bytes", "1MiB"], ["migrate", "DST"]],
)
def test_read_only_commands_on_a_missing_path_exit_nonzero_and_create_nothing(
    tmp_path: Path, args: list[str]
) -> None:
    from click.testing import CliRunner

    from kvstore.cli.main import cli

    missing = tmp_path / "no" / "such" / "store"
    argv = [args[0], missing.as_uri(), *args[1:]]
    if args[0] == "migrate":
        argv = ["migrate", missing.as_uri(), (tmp_path / "dst").as_uri()]
    res = CliRunner().invoke(cli, argv)
    assert res.exit_code == 3, res.output
    assert "does not exist" in res.output
    assert not (tmp_path / "no").exists()


def test_migrate_creates_a_missing_destination(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvstore.cli.main import cli

    src = tmp_path / "src"
    DiskBackend(src)  # an empty store that exists
    res = CliRunner().invoke(cli, ["migrate", src.as_uri(), (tmp_path / "new" / "dst").as_uri()])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "new" / "dst" / "objects").is_dir()
