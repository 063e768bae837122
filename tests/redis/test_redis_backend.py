"""Redis backend against a real redis-server: round trips, parts, TTL, listing, auth."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest
import redis

from kvstore.backends import open_backend
from kvstore.backends import redis_layout as layout
from kvstore.backends.base import Defect
from kvstore.testing.redis_server import RedisServer, redis_available
from tests.redis.conftest import FAST
from tests.support.required import REDIS_INSTALL, needs

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # an unawaited coroutine is a bug
KiB, MiB = 1 << 10, 1 << 20


def raw(srv: RedisServer) -> redis.Redis:
    """A plain redis-py client on the same server, to poke at keys behind the backend."""
    if srv.socket_path:
        return redis.Redis(unix_socket_path=srv.socket_path, password=srv.password)
    return redis.Redis(host=srv.host, port=srv.port, password=srv.password)


@pytest.mark.parametrize("size", [KiB, MiB, 32 * MiB])
async def test_round_trip_bytes_equal(backend, size):
    data = os.urandom(size)
    assert await backend.put_many([("ns/m/vllm-1-0/a", data)]) == [True]
    got = await backend.get_many(["ns/m/vllm-1-0/a"])
    assert bytes(got[0]) == data
    assert backend.counters.hits == 1 and backend.counters.put_bytes == size


async def test_batch_mixed_sizes_and_alloc_places_into_callers_buffer(backend):
    sizes = [100, 2 * KiB, 3 * MiB, 0, 9 * MiB]
    items = [(f"ns/m/vllm-1-0/{i}", os.urandom(n)) for i, n in enumerate(sizes)]
    assert await backend.put_many(items) == [True] * len(items)
    arena = bytearray(sum(sizes))
    view, cursor = memoryview(arena), [0]

    def alloc(n: int) -> memoryview:  # carve consecutive slices out of one arena
        off = cursor[0]
        cursor[0] += n
        return view[off : off + n]

    got = await backend.get_many([n for n, _ in items] + ["ns/m/vllm-1-0/absent"], alloc=alloc)
    assert got[-1] is None
    for (_, data), g in zip(items, got):
        assert bytes(g) == data
        assert g.obj is arena  # read straight into the caller's buffer


async def test_multi_part_value_round_trip_and_layout(redis_server):
    b = open_backend(f"{redis_server.url}?part_size=4MiB&{FAST}")
    header, payload = os.urandom(333), os.urandom(10 * MiB + 7)  # gathered value, parts straddle
    name = "ns/m/vllm-1-0/big"
    assert await b.put(name, [header, payload])
    got = await b.get(name)
    assert bytes(got) == header + payload
    r = raw(redis_server)
    manifest = layout.decode_manifest(r.get(layout.data_key("kv:", name)))
    assert manifest is not None and manifest.count == 3 and manifest.total == len(header) + len(payload)
    assert r.hlen(layout.parts_key("kv:", name)) == 3
    infos = [i async for i in b.list("ns/")]
    assert [(i.name, i.size) for i in infos] == [(name, manifest.total)]
    # overwrite with a small value: the parts go too (no leak), reads see the new value
    assert await b.put(name, b"small")
    assert bytes(await b.get(name)) == b"small"
    assert r.exists(layout.parts_key("kv:", name)) == 0
    # overwrite with a big single-part value: its put leaves the old parts; gc drops them
    assert await b.put(name, header + payload)
    big = os.urandom(2 * MiB)
    assert await b.put(name, big)
    assert r.exists(layout.parts_key("kv:", name)) == 1
    assert await b.collect_garbage() == 0  # young parts: maybe a write under way elsewhere
    assert await b.collect_garbage(grace_s=0) == 3  # its three parts
    assert r.exists(layout.parts_key("kv:", name)) == 0
    assert bytes(await b.get(name)) == big
    # a stale generation's fields are dropped, the live ones kept
    assert await b.put(name, header + payload)
    r.hset(layout.parts_key("kv:", name), "00ff00ff00ff00ff:0", b"old")
    assert await b.collect_garbage() == 1
    assert bytes(await b.get(name)) == header + payload
    await b.close()


async def test_gc_keeps_the_parts_of_a_put_not_yet_published(redis_server, monkeypatch):
    """`kvstore gc` in another process while multi-part puts run: a put caught between its
    parts and its manifest, of a new name or over a live object, keeps its parts, and a
    put that publishes while gc looks at the hash does too (each lost a put it had
    acknowledged: listed, `contains` true, every read a miss)."""
    b = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    gc = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    fresh, over = "ns/m/vllm-1-0/fresh", "ns/m/vllm-1-0/over"
    old = os.urandom(3 * MiB)
    assert await b.put(over, old)
    real_set = b.client.set

    async def set_after_gc(*args, **kwargs):  # type: ignore[no-untyped-def]
        await gc.collect_garbage()  # the parts are written, the manifest not yet
        return await real_set(*args, **kwargs)

    monkeypatch.setattr(b.client, "set", set_after_gc)
    new = {n: os.urandom(3 * MiB + 5) for n in (fresh, over)}
    for n, data in new.items():
        assert await b.put(n, data)
    monkeypatch.setattr(b.client, "set", real_set)
    for n, data in new.items():
        got = await b.get(n)
        assert got is not None and bytes(got) == data

    # gc reads the manifest, then the writer publishes and drops the old parts, then gc
    # lists the fields: all of them are of a generation gc did not see as live
    real_hkeys = gc.client.hkeys
    latest = os.urandom(2 * MiB + 3)

    async def hkeys_after_publish(key):  # type: ignore[no-untyped-def]
        assert await b.put(over, latest)
        return await real_hkeys(key)

    monkeypatch.setattr(gc.client, "hkeys", hkeys_after_publish)
    await gc.collect_garbage()
    got = await b.get(over)
    assert got is not None and bytes(got) == latest
    await b.close()
    await gc.close()


async def test_gc_drops_parts_of_writes_long_over(redis_server):
    """Parts of a generation no manifest names, written longer ago than the grace (a
    writer that died, an overwrite by a single-part value), go; the live ones stay."""
    b = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    r = raw(redis_server)
    name = "ns/m/vllm-1-0/aged"
    data = os.urandom(3 * MiB)
    assert await b.put(name, data)
    hkey = layout.parts_key("kv:", name)
    two_hours_ago = layout.new_generation(time.time() - 7200).hex()
    a_minute_ago = layout.new_generation(time.time() - 60).hex()
    r.hset(hkey, mapping={f"{two_hours_ago}:0": b"dead", f"{two_hours_ago}:1": b"dead", f"{a_minute_ago}:0": b"w"})
    orphan = layout.parts_key("kv:", "ns/m/vllm-1-0/orphan")  # no manifest at all
    r.hset(orphan, f"{two_hours_ago}:0", b"dead")
    assert await b.collect_garbage() == 3
    assert r.hexists(hkey, f"{a_minute_ago}:0") and r.exists(orphan) == 0
    assert bytes(await b.get(name)) == data
    await b.close()


async def test_deleted_or_truncated_part_is_a_miss(redis_server):
    b = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    r = raw(redis_server)
    names = ["ns/m/vllm-1-0/p1", "ns/m/vllm-1-0/p2"]
    assert await b.put_many([(n, os.urandom(3 * MiB)) for n in names]) == [True, True]
    m1 = layout.decode_manifest(r.get(layout.data_key("kv:", names[0])))
    m2 = layout.decode_manifest(r.get(layout.data_key("kv:", names[1])))
    r.hdel(layout.parts_key("kv:", names[0]), m1.fields()[1])
    r.hset(layout.parts_key("kv:", names[1]), m2.fields()[2], b"short")
    assert await b.get_many(names) == [None, None]
    assert b.counters.misses == 2 and b.counters.get_errors == 0
    await b.close()


async def test_a_failed_part_fetch_leaves_no_fetch_writing_after_the_read(redis_server, monkeypatch):
    """When one part's fetch fails, the read ends only after every other fetch has: none
    writes into the caller's buffer later (it goes back to a pool, where another read may
    hold it by then, its checksum already passed)."""
    b = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    name = "ns/m/vllm-1-0/parts"
    assert await b.put(name, os.urandom(4 * MiB))
    real_hget = b.client.hget
    calls = [0]

    async def hget(key, field):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise redis.exceptions.ConnectionError("reset by peer")  # the first part fails at once
        await asyncio.sleep(0.2)  # the others answer later
        return await real_hget(key, field)

    monkeypatch.setattr(b.client, "hget", hget)
    buf = bytearray(4 * MiB + 4096)
    got = await b.get_many([name], lambda n: memoryview(buf)[:n])
    assert got == [None] and b.counters.get_errors == 1
    returned = bytes(buf)  # the caller now reuses its buffer
    await asyncio.sleep(0.4)
    assert bytes(buf) == returned  # no fetch wrote into it after the read returned
    await b.close()


async def test_stale_manifest_never_mixes_two_writes(redis_server):
    """A reader holding an older generation's manifest gets a miss, not old+new parts."""
    b = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    r = raw(redis_server)
    name = "ns/m/vllm-1-0/gen"
    first, second = os.urandom(2 * MiB + 5), os.urandom(2 * MiB + 5)
    assert await b.put(name, first)
    old_manifest = r.get(layout.data_key("kv:", name))
    assert await b.put(name, second)
    assert bytes(await b.get(name)) == second
    r.set(layout.data_key("kv:", name), old_manifest)  # as if read before the overwrite
    assert await b.get(name) is None
    await b.close()


async def test_ttl_per_namespace(redis_server):
    b = open_backend(f"{redis_server.url}?ttl.short=0.3&part_size=1MiB&{FAST}")
    items = [
        ("short/m/vllm-1-0/a", b"x" * 100),
        ("short/m/vllm-1-0/big", os.urandom(3 * MiB)),
        ("long/m/vllm-1-0/a", b"y" * 100),
    ]
    assert await b.put_many(items) == [True] * 3
    r = raw(redis_server)
    assert 0 < r.pttl(layout.data_key("kv:", "short/m/vllm-1-0/a")) <= 300
    assert 0 < r.pttl(layout.parts_key("kv:", "short/m/vllm-1-0/big")) <= 300
    assert r.pttl(layout.data_key("kv:", "long/m/vllm-1-0/a")) == -1
    assert all(v is not None for v in await b.get_many([n for n, _ in items]))
    await asyncio.sleep(0.5)
    got = await b.get_many([n for n, _ in items])
    assert got[0] is None and got[1] is None and bytes(got[2]) == b"y" * 100
    await b.close()


async def test_default_ttl_from_url(redis_server):
    b = open_backend(f"{redis_server.url}?ttl=60&ttl.forever=0&{FAST}")
    assert await b.put_many([("a/m/f-1-0/x", b"1"), ("forever/m/f-1-0/x", b"2")]) == [True, True]
    r = raw(redis_server)
    assert 50_000 < r.pttl(layout.data_key("kv:", "a/m/f-1-0/x")) <= 60_000
    assert r.pttl(layout.data_key("kv:", "forever/m/f-1-0/x")) == -1
    await b.close()


async def test_contains_delete_and_list_with_glob_characters(backend):
    names = ["a*/m/f-1-0/1", "ab/m/f-1-0/2", "a[b]/m/f-1-0/3", "a?/m/f-1-0/4", "ns/m/f-1-0/5"]
    assert await backend.put_many([(n, n.encode() * 3) for n in names]) == [True] * 5
    assert await backend.contains_many([names[0], "zz/m/f-1-0/9"]) == [True, False]
    assert [i.name async for i in backend.list("a*")] == ["a*/m/f-1-0/1"]
    assert [i.name async for i in backend.list("a[b]")] == ["a[b]/m/f-1-0/3"]
    assert [i.name async for i in backend.list("a?")] == ["a?/m/f-1-0/4"]
    listed = {i.name: i.size async for i in backend.list("")}
    assert listed == {n: 3 * len(n) for n in names}
    assert await backend.delete_many([names[0], "zz/m/f-1-0/9"]) == [True, False]
    assert await backend.contains_many([names[0]]) == [False]
    assert backend.counters.deletes == 1


async def test_contains_of_many_names_sees_only_objects_and_a_refused_type_is_a_logged_miss(redis_server, caplog):
    """Lookups go out as one packed TYPE pipeline on a raw socket: every name answered in
    order (replies over several receive blocks), a key of another type under an object's
    key is no object, a pooled socket the server dropped is not used again, and a server
    that refuses TYPE (an ACL) gives misses and a warning, never an exception."""
    b = open_backend(f"{redis_server.url}?{FAST}")
    assert b.streams is not None  # plain TCP or unix socket: the raw-socket path
    calls = []
    types = b.streams.types

    async def counted(keys):
        calls.append(len(keys))
        return await types(keys)

    b.streams.types = counted  # type: ignore[method-assign]
    names = [f"ns/m/f-1-0/{i}" for i in range(10_000)]
    assert await b.put_many([(n, b"v") for n in names[:100:2]]) == [True] * 50
    r = raw(redis_server)
    r.hset(layout.data_key("kv:", names[1]), "f", "v")
    assert await b.contains_many(names) == [i < 100 and i % 2 == 0 for i in range(10_000)]
    assert calls == [10_000]
    r.client_kill_filter(_type="normal")  # every client of the server, this backend's pooled socket too
    assert await b.contains_many(names[:4]) == [True, False, True, False]
    await b.close()
    r = raw(redis_server)
    r.acl_setuser("notype", enabled=True, passwords=["+pw"], keys=["kv:*"], commands=["+@all", "-type"])
    nb = open_backend(f"redis://notype:pw@{redis_server.host}:{redis_server.port}/0?{FAST}")
    assert await nb.get("ns/m/f-1-0/0") is not None  # this user reads objects...
    assert await nb.contains_many(names[:2]) == [False, False]  # ...but may not ask TYPE
    assert "contains failed" in caplog.text and "Redis answered TYPE with" in caplog.text and "-NOPERM" in caplog.text
    assert nb.streams is not None and not nb.streams._idle  # a socket that answered an error is not reused
    await nb.close()


async def test_key_prefix_option_isolates_two_stores(redis_server):
    a = open_backend(f"{redis_server.url}?prefix=one:&{FAST}")
    b = open_backend(f"{redis_server.url}?prefix=two:&{FAST}")
    assert await a.put("ns/m/f-1-0/x", b"A")
    assert await b.get("ns/m/f-1-0/x") is None
    assert [i.name async for i in b.list()] == []
    await a.close()
    await b.close()


async def test_invalid_names_are_counted_not_raised(backend):
    assert await backend.put_many([("../etc/passwd", b"x"), ("ok/m/f-1-0/1", b"y")]) == [False, True]
    assert backend.counters.put_errors == 1
    assert await backend.get_many(["/abs", "ok/m/f-1-0/1"]) == [None, memoryview(b"y")]


def test_bad_url_options_say_what_is_known():
    with pytest.raises(ValueError, match="known"):
        open_backend("redis://127.0.0.1:1/0?colour=blue")
    with pytest.raises(ValueError, match="bulk limit"):
        open_backend("redis://127.0.0.1:1/0?part_size=1GiB")


async def test_unix_socket_with_password_from_env_never_logged(monkeypatch, caplog):
    with RedisServer(unix_socket=True, password="pa55-w0rd") as srv:
        monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", "pa55-w0rd")
        b = open_backend(f"unix://{srv.socket_path}?{FAST}")
        assert await b.put("ns/m/f-1-0/x", b"hello")
        assert bytes(await b.get("ns/m/f-1-0/x")) == b"hello"
        await b.close()
        # password in the URL; a wrong one is a counted failure, logged without the secret
        caplog.set_level(logging.DEBUG, logger="kvstore")
        bad = open_backend(f"unix://:wrong-secret@{srv.socket_path}?{FAST}")
        assert await bad.put("ns/m/f-1-0/x", b"zzz") is False
        assert await bad.get("ns/m/f-1-0/x") is None
        assert bad.counters.put_errors == 1 and bad.counters.get_errors == 1
        assert "wrong-secret" not in caplog.text and "wrong-secret" not in str(bad.stats())
        await bad.close()


async def test_acl_user_from_url(redis_server):
    r = raw(redis_server)
    r.acl_setuser("kvuser", enabled=True, passwords=["+userpw"], keys=["kv:*"], commands=["+@all"])
    b = open_backend(f"redis://kvuser:userpw@{redis_server.host}:{redis_server.port}/0?{FAST}")
    assert await b.put("ns/m/f-1-0/x", b"acl")
    assert bytes(await b.get("ns/m/f-1-0/x")) == b"acl"
    await b.close()


async def test_refresh_stats_reports_server_figures(backend):
    await backend.put_many([(f"ns/m/f-1-0/{i}", b"v" * 1000) for i in range(10)])
    st = await backend.refresh_stats()
    assert st.extra["server_keys"] == 10 and st.extra["server_used_memory"] > 10_000
    assert st.counters.puts == 10


@needs(redis_available(tls=True), "redis-server and openssl (for test certificates)", REDIS_INSTALL)
async def test_tls_round_trip():
    with RedisServer(tls=True) as srv:
        b = open_backend(f"{srv.url}&{FAST}")
        data = os.urandom(3 * MiB)
        assert await b.put("ns/m/f-1-0/tls", data)
        assert bytes(await b.get("ns/m/f-1-0/tls")) == data
        await b.close()
        # a client that does not trust the server's CA fails as a counted error, not an exception
        untrusted = open_backend(f"rediss://{srv.host}:{srv.port}/0?{FAST}")
        assert await untrusted.put("ns/m/f-1-0/tls", b"x") is False
        await untrusted.close()


async def test_alloc_may_hand_back_a_shaped_view(backend):
    """Callers hand tensor-backed buffers (2-D, or '<B'); the bytes land in them all the same."""
    data = os.urandom(2 * MiB)
    assert await backend.put("ns/m/f-1-0/t", data)
    target = bytearray(2 * MiB)
    got = await backend.get("ns/m/f-1-0/t", alloc=lambda n: memoryview(target).cast("B", (2, n // 2)))
    assert bytes(got) == data and bytes(target) == data


@pytest.mark.parametrize("payload_size", [100, 100 * KiB, 3 * MiB])
async def test_gathered_value_is_stored_as_one_value(redis_server, payload_size):
    """A value given as parts (frame header + payload) is one Redis string, parts in order."""
    b = open_backend(f"{redis_server.url}?{FAST}")
    header, payload = b"HDR" * 11, os.urandom(payload_size)
    items = [("ns/m/f-1-0/g", [header, memoryview(payload)]), ("ns/m/f-1-0/h", [b"", payload, b"!"])]
    assert await b.put_many(items) == [True, True]
    r = raw(redis_server)
    assert r.get(layout.data_key("kv:", "ns/m/f-1-0/g")) == header + payload
    assert r.get(layout.data_key("kv:", "ns/m/f-1-0/h")) == payload + b"!"
    await b.close()


async def test_verify_reports_an_object_that_lost_a_part_as_bad(redis_server):
    """Listed, yet read as absent by the backend's own check (a part gone) with no error
    counted: verify reports it bad (so --quarantine may take it), not "unreadable"."""
    from kvstore.frame import encode_frame
    from kvstore.ops.inspect import verify_store

    b = open_backend(f"{redis_server.url}?part_size=1MiB&{FAST}")
    r = raw(redis_server)
    names = ["ns/m/vllm-1-0/whole", "ns/m/vllm-1-0/holed"]
    for n in names:
        assert await b.put(n, encode_frame([os.urandom(3 * MiB)], codec="raw", key=n))
    manifest = layout.decode_manifest(r.get(layout.data_key("kv:", names[1])))
    r.hdel(layout.parts_key("kv:", names[1]), manifest.fields()[1])
    report = await verify_store(b)
    assert report.ok == 1 and list(report.bad) == [names[1]] and "Incomplete" in report.bad[names[1]]
    assert report.unreadable == []
    await b.close()


@pytest.mark.parametrize("part_size", ["", "64KiB"])
async def test_quarantine_deletes_only_the_copy_it_compared(redis_server, monkeypatch, part_size):
    """A copy written between quarantine's comparison and its delete stays: the key is
    WATCHed, so the delete's MULTI/EXEC is refused (single values and multi-part ones)."""
    url = f"{redis_server.url}?{FAST}" + (f"&part_size={part_size}" if part_size else "")
    b = open_backend(url)
    name = "ns/m/vllm-1-0/q"
    bad, good = os.urandom(200 * KiB), os.urandom(200 * KiB)
    assert await b.put_many([(name, bad)]) == [True]

    async def rewrite() -> None:  # another writer
        other = open_backend(url)
        assert await other.put_many([(name, good)]) == [True]
        await other.close()

    if part_size:  # quarantine reads a multi-part value's parts through get_many
        real_get = b.get_many

        async def get_many(names, alloc=None):  # type: ignore[no-untyped-def]
            got = await real_get(names, alloc)
            await rewrite()
            return got

        monkeypatch.setattr(b, "get_many", get_many)
    else:  # and a single value on its watching pipeline
        real_pipeline = b.client.pipeline

        def pipeline(*args, **kwargs):  # type: ignore[no-untyped-def]
            pipe = real_pipeline(*args, **kwargs)
            real_command = pipe.execute_command

            def execute_command(*cmd, **kw):  # type: ignore[no-untyped-def]
                reply = real_command(*cmd, **kw)
                if cmd[0] != "GET":
                    return reply

                async def then_rewrite():  # type: ignore[no-untyped-def]
                    value = await reply
                    await rewrite()
                    return value

                return then_rewrite()

            pipe.execute_command = execute_command
            return pipe

        monkeypatch.setattr(b.client, "pipeline", pipeline)
    assert await b.quarantine(name, "test", Defect(read=bad)) is False
    monkeypatch.undo()
    (got,) = await b.get_many([name])
    assert got is not None and bytes(got) == good
    assert await b.quarantine(name, "test", Defect(read=good)) is True
    assert await b.contains_many([name]) == [False]
    await b.close()
