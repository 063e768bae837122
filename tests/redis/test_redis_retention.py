"""Redis: `retention_risks` names what may drop objects the store accepted: a TTL set by
the URL (for every namespace or one), a server with no append-only file (a restart loses
what it held), and the server's own eviction policy, asked from the server (CONFIG GET,
or INFO where CONFIG is renamed away as managed Redis does)."""

from __future__ import annotations

import pytest

from kvstore.backends import open_backend
from kvstore.testing.redis_server import RedisServer, redis_available
from tests.support.required import REDIS_INSTALL, require


def serve(*extra: str, appendonly: bool = True) -> RedisServer:
    require(redis_available(), "redis-server", REDIS_INSTALL)
    return RedisServer(extra=["--appendonly", "yes" if appendonly else "no", *extra])


def not_about_persistence(risks: list[str]) -> list[str]:
    return [r for r in risks if "appendonly" not in r]


async def risks_of(url: str) -> list[str]:
    b = open_backend(url)
    try:
        return await b.retention_risks()
    finally:
        await b.close()


async def test_a_persisting_server_and_a_plain_url_keep_everything() -> None:
    with serve() as srv:
        assert await risks_of(srv.url) == []
        assert await risks_of(f"{srv.url}?ttl.scratch=0") == []  # 0 = never expire


async def test_a_server_without_an_append_only_file_is_a_risk(redis_url) -> None:  # type: ignore[no-untyped-def]
    """A restart of a server that keeps no append-only file loses what it held: the only
    copy must not go there (redis_url's server runs with appendonly no)."""
    (risk,) = await risks_of(redis_url())
    assert "appendonly no" in risk and "set appendonly yes" in risk


async def test_ttl_options_are_risks_naming_the_option(redis_url) -> None:  # type: ignore[no-untyped-def]
    (every,) = not_about_persistence(await risks_of(redis_url(ttl="2")))
    assert "ttl=2s" in every and "drop ?ttl=" in every
    (one,) = not_about_persistence(await risks_of(redis_url(**{"ttl.tenant": "60"})))
    assert "ttl.tenant=60s" in one and "'tenant'" in one


@pytest.mark.parametrize("rename_config", [False, True])
async def test_an_evicting_policy_is_asked_from_the_server(rename_config: bool) -> None:
    extra = ["--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru"]
    if rename_config:  # as managed Redis does: CONFIG is not available, INFO still says
        extra += ["--rename-command", "CONFIG", ""]
    with serve(*extra) as srv:
        (risk,) = await risks_of(srv.url)
    assert "allkeys-lru" in risk and "maxmemory-policy noeviction" in risk and "10485760" in risk


async def test_volatile_policies_only_evict_keys_with_an_expiry() -> None:
    with serve("--maxmemory", "10mb", "--maxmemory-policy", "volatile-lru") as srv:
        assert await risks_of(srv.url) == []
        (ttl,) = await risks_of(f"{srv.url}?ttl=30")
        assert "ttl=30s" in ttl


async def test_a_server_that_will_not_say_is_a_risk() -> None:
    with serve("--rename-command", "CONFIG", "", "--rename-command", "INFO", "") as srv:
        (risk,) = await risks_of(srv.url)
    assert "cannot ask" in risk and "allow CONFIG GET or INFO" in risk


async def test_every_cluster_primary_is_asked(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    persistence = await risks_of(redis_cluster.url)  # the test cluster keeps no append-only files
    assert persistence and all("appendonly no" in r for r in persistence)
    node = redis_cluster.nodes[1]
    node.command("CONFIG", "SET", "maxmemory-policy", "allkeys-lfu")
    try:
        (risk,) = not_about_persistence(await risks_of(redis_cluster.url))
    finally:
        node.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    assert f"{node.port}" in risk and "allkeys-lfu" in risk and "noeviction" in risk


async def test_delete_source_into_a_persisting_redis_deletes_after_its_sync(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Into a Redis with an append-only file and no eviction, --delete-source goes
    through: every object is there, every source gone (make_durable waited for the sync
    first: WAITAOF, or a wait past appendfsync everysec on a server without it)."""
    from kvstore.ops.migrate import MigrateOptions, migrate
    from tests.ops.test_migrate import assert_same, fill

    src_url = (tmp_path / "src").as_uri()
    data = await fill(src_url, 3)
    with serve() as srv:
        src, dst = open_backend(src_url), open_backend(srv.url)
        report = await migrate(src, dst, MigrateOptions(delete_source=True, journal=tmp_path / "j"))
        assert (report.copied, report.deleted, report.lost) == (3, 3, [])
        assert await src.contains_many(list(data)) == [False] * 3
        await assert_same(srv.url, data)
        await dst.close()
