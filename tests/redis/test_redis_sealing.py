"""Big Redis values hashed as they are sent (`RedisBackend` with an `UnsealedFrame`).

A real redis-server each: the stored value is the frame a sealed encode gives, with the
expiry asked for and no temporary key left; a frame another party is hashing is sent
once it is sealed; a server that runs no scripts for this user, or an ACL that does not
cover the temporary keys, still gets whole, sealed values; the publishing script takes
only a whole temporary value; a send cut short or refused for memory is a failed put
that leaves the object's key as it was (a cut-short frame goes back unsealed, for another
tier to seal); a temporary key a writer leaves behind expires.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from kvstore.backends import open_backend
from kvstore.frame import UnsealedFrame, decode_frame, encode_frame
from kvstore.testing.redis_server import RedisServer, redis_available
from tests.support.required import REDIS_INSTALL, needs

pytestmark = needs(redis_available(), "redis-server", REDIS_INSTALL)

FAST = "timeout=2&connect_timeout=0.5"


@pytest.fixture(autouse=True)
def compiled() -> None:
    from kvstore import checksum

    checksum.fast()  # the kernels compiled: a put hashes as it sends from the first one
PAYLOAD = bytes(range(251)) * 16736  # ~4 MiB: four hash blocks and a piece


def unsealed(name: str = "a/b") -> UnsealedFrame:
    f = encode_frame([PAYLOAD[:1000], PAYLOAD[1000:]], codec="raw", key=name, ctime=3.0, sealed=False)
    assert isinstance(f, UnsealedFrame)
    return f


def sealed_bytes(name: str = "a/b") -> bytes:
    return b"".join(encode_frame([PAYLOAD], codec="raw", key=name, ctime=3.0))


def test_what_refuses_the_way_for_good() -> None:
    from kvstore.backends.redis_stream import refuses_the_way

    assert refuses_the_way(b"-NOPERM this user has no permissions to run the 'eval' command")
    assert refuses_the_way(b"-ERR unknown command 'EVAL', with args beginning with: ")
    assert refuses_the_way(b"-ERR user_script:3: Unknown Redis command called from script script: ...")
    assert not refuses_the_way(b"-OOM command not allowed when used memory > 'maxmemory'.")
    assert not refuses_the_way(b"-ERR Error running script (call to f_1): @user_script:2: -OOM command not allowed")
    assert not refuses_the_way(b"-MISCONF Redis is configured to save RDB snapshots")
    assert refuses_the_way(b"-NOPERM no permissions to access the key 'kv:{x/OOM}:tmp:ab'")
    assert not refuses_the_way(b":1") and not refuses_the_way(b"+OK")


def temp_keys(srv: RedisServer) -> list[bytes]:
    return cli(srv).keys("*:tmp:*")


def cli(srv: RedisServer) -> redis.Redis:
    return redis.Redis(host=srv.host, port=srv.port)


async def test_a_big_unsealed_frame_is_stored_sealed_with_no_temporary_key_left() -> None:
    with RedisServer() as srv:
        be = open_backend(f"{srv.url}?{FAST}")
        assert be.capabilities.seals_frames
        f = unsealed()
        assert await be.put_many([("a/b", f)]) == [True]
        assert f.sealed
        stored = cli(srv).get("kv:{a/b}")
        assert stored == sealed_bytes()
        assert bytes(decode_frame(stored, key="a/b").payload) == PAYLOAD
        assert cli(srv).pttl("kv:{a/b}") == -1  # no expiry asked: none set
        assert temp_keys(srv) == []
        stats = cli(srv).info("commandstats")
        assert stats["cmdstat_eval"]["calls"] == 1  # sent hashed as it went, published by the script
        assert [o.name async for o in be.list("")] == ["a/b"]  # nothing else listed
        got = await be.get_many(["a/b"])
        assert got[0] is not None and bytes(got[0]) == stored
        assert be.counters.puts == 1 and be.counters.put_errors == 0
        await be.close()


async def test_expiry_is_the_one_asked_for_and_an_old_expiry_goes() -> None:
    with RedisServer() as srv:
        with_ttl = open_backend(f"{srv.url}?{FAST}&ttl=100")
        assert await with_ttl.put_many([("a/b", unsealed())]) == [True]
        assert 90_000 < cli(srv).pttl("kv:{a/b}") <= 100_000
        await with_ttl.close()
        without = open_backend(f"{srv.url}?{FAST}")
        assert await without.put_many([("a/b", unsealed())]) == [True]  # over the expiring value
        assert cli(srv).pttl("kv:{a/b}") == -1
        assert cli(srv).get("kv:{a/b}") == sealed_bytes()
        await without.close()


async def test_a_frame_another_party_is_hashing_is_sent_once_sealed() -> None:
    with RedisServer() as srv:
        be = open_backend(f"{srv.url}?{FAST}")
        f = unsealed()
        assert f.claim()  # e.g. a disk tier writing it at the same time
        sealer = threading.Timer(0.2, lambda: f.seal(decode_frame(sealed_bytes()).header.csum))
        sealer.start()
        assert await be.put_many([("a/b", f)]) == [True]
        sealer.join()
        assert cli(srv).get("kv:{a/b}") == sealed_bytes()
        assert temp_keys(srv) == []
        await be.close()


async def test_a_server_that_runs_no_scripts_still_gets_whole_sealed_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with RedisServer() as srv:
        cli(srv).execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "+@all", "-@scripting")
        url = f"redis://noscripts:pw@127.0.0.1:{srv.port}/0?{FAST}"
        be = open_backend(url)
        assert await be.put_many([("a/b", unsealed())]) == [True]
        assert "checksummed before they are sent" in caplog.text and not be.capabilities.seals_frames
        assert cli(srv).get("kv:{a/b}") == sealed_bytes()
        assert temp_keys(srv) == []
        assert await be.put_many([("a/c", unsealed("a/c"))]) == [True]  # straight to whole values
        assert cli(srv).get("kv:{a/c}") == sealed_bytes("a/c")
        assert temp_keys(srv) == []
        assert be.counters.put_errors == 0
        await be.close()


async def test_a_value_refused_for_memory_is_a_failed_put_and_the_frame_stays_sealed() -> None:
    with RedisServer(extra=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as srv:
        be = open_backend(f"{srv.url}?{FAST}")
        f = unsealed()
        assert await be.put_many([("a/b", f)]) == [False]
        assert be.counters.put_errors == 1
        assert cli(srv).exists("kv:{a/b}") == 0
        assert temp_keys(srv) == []
        assert f.sealed  # hashed as it went: the checksum is right for another tier
        assert be.capabilities.seals_frames  # a refusal for memory is this write's, not the script's
        assert bytes(decode_frame(b"".join(f), key="a/b").payload) == PAYLOAD
        await be.close()


async def test_a_send_cut_short_gives_the_frame_back_unsealed() -> None:
    # the server drops any connection that announces a value longer than 1 MiB; the value
    # is far larger than the socket buffers, so the send fails before the last block
    # (a smaller one could fit in them whole, be sealed, and fail only at the reply)
    payload = bytes(range(251)) * ((32 << 20) // 251)  # 32 MiB
    with RedisServer(extra=["--proto-max-bulk-len", "1mb"]) as srv:
        be = open_backend(f"{srv.url}?{FAST}")
        cli(srv).set("kv:{a/b}", "older")
        f = encode_frame([payload], codec="raw", key="a/b", sealed=False)
        assert isinstance(f, UnsealedFrame)
        assert await be.put_many([("a/b", f)]) == [False]
        assert be.counters.put_errors == 1
        assert not f.sealed and f.claim()  # released: another tier can hash it
        f.release()
        assert be.streams is not None and be.streams._idle == []  # a socket cut short is not kept
        assert cli(srv).get("kv:{a/b}") == b"older"
        assert temp_keys(srv) == []
        await be.close()


async def test_through_a_tiered_store_the_value_is_a_hit_for_a_fresh_reader() -> None:
    import torch

    from kvstore.tiered import TieredStore

    with RedisServer() as srv:
        st = TieredStore.from_urls([f"{srv.url}?{FAST}"])
        t = torch.randn(8, 1 << 18).to(torch.bfloat16)  # 4 MiB
        assert await st.put_many([("ns/m/f-1-0/0", t)]) == [True]
        fresh = TieredStore.from_urls([srv.url], discover=True)
        out = torch.zeros_like(t)
        (got,) = await fresh.get_many(["ns/m/f-1-0/0"], out=[out])
        assert got is out and torch.equal(out, t)
        assert temp_keys(srv) == []
        await asyncio.gather(st.close(), fresh.close())


async def test_the_publishing_script_publishes_only_a_whole_temporary_value() -> None:
    from kvstore.backends.redis_stream import PATCH_SCRIPT

    with RedisServer() as srv:
        r = cli(srv)
        r.set("kv:{a/b}", "older")
        tmp = "kv:{a/b}:tmp:1"
        assert r.eval(PATCH_SCRIPT, 2, tmp, "kv:{a/b}", b"HDR", 100, "") == 0  # none there
        r.set(tmp, b"x" * 50, px=60_000)
        assert r.eval(PATCH_SCRIPT, 2, tmp, "kv:{a/b}", b"HDR", 100, "") == 0  # a short one
        assert r.get("kv:{a/b}") == b"older" and r.get(tmp) == b"x" * 50
        r.set(tmp, b"x" * 100, px=60_000)
        assert r.eval(PATCH_SCRIPT, 2, tmp, "kv:{a/b}", b"HDR", 100, 5000) == 1
        assert r.get("kv:{a/b}") == b"HDR" + b"x" * 97 and not r.exists(tmp)
        assert 0 < r.pttl("kv:{a/b}") <= 5000
        r.set(tmp, b"y" * 100, px=60_000)
        assert r.eval(PATCH_SCRIPT, 2, tmp, "kv:{a/b}", b"HDR", 100, "") == 1
        assert r.get("kv:{a/b}") == b"HDR" + b"y" * 97 and r.pttl("kv:{a/b}") == -1


async def test_an_acl_without_the_temporary_keys_gets_whole_sealed_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with RedisServer() as srv:
        cli(srv).execute_command("ACL", "SETUSER", "narrow", "on", ">pw", "~kv:{*}", "~kv:{*}:parts", "+@all")
        be = open_backend(f"redis://narrow:pw@127.0.0.1:{srv.port}/0?{FAST}")
        for name in ("a/b", "a/c"):
            assert await be.put_many([(name, unsealed(name))]) == [True]
            assert cli(srv).get(f"kv:{{{name}}}") == sealed_bytes(name)
        assert "NOPERM" in caplog.text and not be.capabilities.seals_frames
        assert temp_keys(srv) == [] and be.counters.put_errors == 0
        await be.close()


async def test_a_temporary_key_left_behind_expires_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # RENAME renamed away: the script fails after writing the header into the temporary key
    with RedisServer(extra=["--rename-command", "RENAME", ""]) as srv:
        be = open_backend(f"{srv.url}?{FAST}")

        async def unreachable(*names: str) -> int:
            raise ConnectionError("Redis went away")

        monkeypatch.setattr(be.client, "unlink", unreachable)
        assert await be.put_many([("a/b", unsealed())]) == [True]  # sent again, whole and sealed
        assert cli(srv).get("kv:{a/b}") == sealed_bytes() and not be.capabilities.seals_frames
        (left,) = temp_keys(srv)
        assert 0 < cli(srv).pttl(left) <= be._temp_ttl_ms(len(sealed_bytes()))
        await be.close()


@pytest.mark.parametrize(
    "answer",
    [
        b":0",  # the temporary key was gone (evicted) or short
        b"-OOM command not allowed when used memory > 'maxmemory'.",
        b"-ERR Error running script (call to f_1): @user_script:2: -OOM command not allowed",  # Redis 6
        b"-MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        b"-ERR some error no one foresaw",  # a failed put, not a reason to stop hashing as sent
    ],
)
async def test_a_publish_refused_for_this_write_fails_that_put_only(
    monkeypatch: pytest.MonkeyPatch, answer: bytes
) -> None:
    import kvstore.backends.redis_stream as redis_stream

    real = redis_stream._read_line
    seen: list[bytes] = []

    async def answered(loop: asyncio.AbstractEventLoop, sock: object) -> bytes:
        line = await real(loop, sock)  # type: ignore[arg-type]
        seen.append(line)
        return answer if len(seen) == 2 else line  # the script's answer, as a server could give it

    with RedisServer() as srv:
        be = open_backend(f"{srv.url}?{FAST}")
        monkeypatch.setattr(redis_stream, "_read_line", answered)
        f = unsealed()
        assert await be.put_many([("a/b", f)]) == [False]
        assert seen == [b"+OK", b":1"] and be.counters.put_errors == 1
        assert be.capabilities.seals_frames and f.sealed  # the next put goes the same way
        assert temp_keys(srv) == []
        monkeypatch.undo()
        assert await be.put_many([("a/c", unsealed("a/c"))]) == [True]
        assert cli(srv).info("commandstats")["cmdstat_eval"]["calls"] == 2
        await be.close()
