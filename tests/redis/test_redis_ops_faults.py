"""`kvstore ls/stat/verify/gc/migrate` on a Redis that fails part way (killed): a listing
cut short, deletes that fail. Every command says what it could not do and exits
nonzero; nothing is reported done that was not."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvstore.backends import open_backend
from kvstore.backends.redis import RedisBackend
from kvstore.cli.main import cli
from kvstore.keys import ChunkKey
from kvstore.ops.inspect import gc_store
from kvstore.tier import Tier
from tests.redis.conftest import FAST


def names(n: int) -> list[str]:
    return [ChunkKey("m", 1, 0, i).object_name() for i in range(n)]


async def fill(url: str, n: int) -> list[str]:
    tier = Tier.open(url)
    chosen = names(n)
    for start in range(0, n, 200):
        assert all(await tier.put_many([(name, torch.full((16,), 1.0)) for name in chosen[start : start + 200]]))
    await tier.close()
    return chosen


def invoke(*args: str) -> tuple[int, str, str]:
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in inspect.signature(CliRunner).parameters else CliRunner()
    res = runner.invoke(cli, list(args))
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.parametrize("command", ["ls", "stat", "verify", "gc", "migrate"])
def test_a_listing_cut_short_fails_every_command(
    redis_server, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Redis killed after the first 500 objects of a listing: the listing was logged,
    counted and silently cut short, so every command exited 0 having acted on part of
    the store. Now each says the listing stopped part way and exits 1."""
    url = f"{redis_server.url}?{FAST}"
    asyncio.run(fill(url, 1200))
    real_sizes = RedisBackend._sizes
    calls = []

    async def sizes_then_kill(self, batch):  # type: ignore[no-untyped-def]
        got = await real_sizes(self, batch)
        calls.append(len(batch))
        if len(calls) == 1:
            redis_server.kill()
        return got

    monkeypatch.setattr(RedisBackend, "_sizes", sizes_then_kill)
    args = {
        "ls": ["ls", url],
        "stat": ["stat", url],
        "verify": ["verify", url],
        "gc": ["gc", url, "--older-than", "30d"],
        "migrate": ["migrate", url, (tmp_path / "dst").as_uri()],
    }[command]
    code, _, err = invoke(*args)
    assert calls and code == 1, err
    assert "the listing stopped part way" in err and "rerun once Redis answers" in err


async def test_gc_never_counts_a_failed_delete_as_done(redis_server) -> None:  # type: ignore[no-untyped-def]
    """The deletes fail (Redis killed): gc asked whether the objects were still there,
    the failed lookup answered "no", and gc reported them deleted. A lookup during a
    fault is no proof of absence: they are reported not deleted."""
    url = f"{redis_server.url}?{FAST}"
    chosen = await fill(url, 3)
    b = open_backend(url)
    real_delete = b.delete_many

    async def kill_then_delete(ns):  # type: ignore[no-untyped-def]
        redis_server.kill()
        return await real_delete(ns)

    b.delete_many = kill_then_delete  # type: ignore[method-assign]
    try:
        report = await gc_store(b, older_than_s=0)
    finally:
        await b.close()
    assert report.deleted == [] and sorted(report.not_deleted) == sorted(chosen)
    assert b.counters.delete_errors == 3


def test_migrate_delete_source_fails_when_the_source_deletes_fail(
    redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Every copy proven, then the source's deletes fail (Redis killed): the run said
    "deleted from source 0" and exited 0. Now each source not deleted is named, counted
    in the report and the run exits 1."""
    url = f"{redis_server.url}?{FAST}"
    chosen = asyncio.run(fill(url, 3))
    real_delete = RedisBackend.delete_many

    async def kill_then_delete(self, ns):  # type: ignore[no-untyped-def]
        redis_server.kill()
        return await real_delete(self, ns)

    monkeypatch.setattr(RedisBackend, "delete_many", kill_then_delete)
    code, out, err = invoke("migrate", url, (tmp_path / "dst").as_uri(), "--delete-source", "--json")
    report = json.loads(out.splitlines()[0])
    assert code == 1, err
    assert report["copied"] == 3 and report["deleted"] == 0 and sorted(report["not_deleted"]) == sorted(chosen)
    assert all(f"source delete failed (see -v); rerun to delete it: {n}" in err for n in chosen)
