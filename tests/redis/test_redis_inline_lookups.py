"""Redis lookups answered on the caller's thread (`RedisBackend.contains_now`), against a
real redis-server: the same answers as the event loop gives, from a thread that is not
the loop's, logged in and on the right database; a killed, restarted or hung server
costs the caller one bounded wait at most, then lookups go through the loop for a while
and come back on their own.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.backends import open_backend
from kvstore.backends.redis import RedisBackend
from kvstore.testing.redis_server import RedisServer, redis_available
from tests.redis.conftest import FAST
from tests.support.required import REDIS_INSTALL, needs

# Tests that assert what the probe answers give it a deadline no slow moment of a shared
# CI machine reaches (the default 5 ms sends a call whose connect and login took longer
# to the loop, as designed); the deadline's own tests set theirs.
INLINE = "inline_timeout=0.5"

pytestmark = [
    pytest.mark.filterwarnings("error::RuntimeWarning"),
    needs(redis_available(), "redis-server", REDIS_INSTALL),  # CI=true: a failure, not a skip
]

A, B, C = "ns/m/vllm-1-0/a", "ns/m/vllm-1-0/b", "ns/m/vllm-1-0/c"


def redis_backend(url: str) -> RedisBackend:
    b = open_backend(url)
    assert isinstance(b, RedisBackend)
    return b


def on_a_thread(fn):
    """`fn()` run on a plain thread while the event loop is blocked waiting for it."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert out, "the call did not return"
    return out[0]


async def test_answers_match_the_loops_from_another_thread(redis_server) -> None:
    b = redis_backend(f"{redis_server.url}?prefix=t1:&part_size=64KiB&{FAST}&{INLINE}")
    odd = "ns/m/vllm-1-0/ü {x}%2F"
    assert await b.put_many([(A, b"x" * 100), (B, b"y" * 200_000), (odd, b"z")]) == [True] * 3  # B: 4 parts
    redis_server.command("HSET", "t1:{ns/m/vllm-1-0/c}", "f", "v")  # C's key holds no object of ours
    names = [A, C, B, odd, "ns/m/vllm-1-0/never"]
    assert on_a_thread(lambda: b.contains_now(names)) == [True, False, True, True, False]
    assert await b.contains_many(names) == [True, False, True, True, False]
    other = redis_backend(f"{redis_server.url}?{FAST}&{INLINE}")  # the default prefix: none of them
    assert other.contains_now(names) == [False] * 5
    await other.close()
    assert on_a_thread(lambda: b.contains_now([])) == []
    await b.close()
    assert b.contains_now([A]) is None, "a closed backend asks nothing"


@pytest.mark.parametrize("password", ["pw-1", "p*w*2", "user"])  # a '*' once miscounted the set-up replies
async def test_the_probe_logs_in_and_selects_the_database(password) -> None:
    with RedisServer(unix_socket=True, password="p*w*2" if password == "user" else password) as srv:
        url = srv.url
        if password == "user":  # an ACL user of its own
            assert b"OK" in srv.command("ACL", "SETUSER", "alice", "on", ">pw-a", "~*", "+@all")
            url = url.replace(":p*w*2@", "alice:pw-a@")
        b = redis_backend(f"{url}?db=3&{FAST}&{INLINE}")
        assert await b.put_many([(A, b"x")]) == [True]
        assert b.contains_now([A, B]) == [True, False]
        other = redis_backend(srv.url + f"?db=0&{FAST}&{INLINE}")  # the same server, database 0
        assert other.contains_now([A]) == [False]
        assert await b.get_many([A]) == [b"x"]  # the streamed path logs in the same way
        await b.close()
        await other.close()


async def test_inline_lookups_can_be_turned_off_and_are_not_made_over_tls_or_cluster(redis_server) -> None:
    off = redis_backend(f"{redis_server.url}?inline_timeout=0&{FAST}")
    assert await off.put_many([(A, b"x")]) == [True]
    assert off.contains_now([A]) is None
    assert await off.contains_many([A]) == [True]
    await off.close()
    for url in ("rediss://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1,127.0.0.1:2"):
        b = redis_backend(url)
        assert b.contains_now([A]) is None, url
        await b.close()


async def test_a_restart_replaces_the_idle_socket_at_once(redis_server) -> None:
    b = redis_backend(f"{redis_server.url}?{FAST}&{INLINE}")
    assert await b.put_many([(A, b"x")]) == [True]
    assert b.contains_now([A]) == [True]
    redis_server.restart()  # comes back empty: the probe's socket is closed under it
    assert b.contains_now([A]) == [False], "a socket the server closed is replaced, not failed on"
    await b.close()


async def test_a_dead_server_costs_one_failed_ask_then_the_loop_asks_until_it_answers(redis_server) -> None:
    b = redis_backend(f"{redis_server.url}?{FAST}&{INLINE}")
    now = [1000.0]
    b._clock = lambda: now[0]
    assert await b.put_many([(A, b"x")]) == [True]
    assert b.contains_now([A]) == [True]
    redis_server.kill()
    assert b.contains_now([A]) is None  # refused: the loop asks (and counts the fault)
    redis_server.start()
    assert not b._failing, "no call on the loop yet: only the back-off can say None now"
    assert b.contains_now([A]) is None, "backing off for a second: nothing asked, though the server is back"
    now[0] += 1.1
    assert b.contains_now([A]) == [False]  # asked again: the restarted server is empty
    redis_server.kill()
    assert await b.contains_many([A]) == [False]  # the loop meets the fault: the tier is failing
    redis_server.start()
    now[0] += 100
    assert b.contains_now([A]) is None, "the tier's last call on the loop failed: the loop asks"
    assert await b.contains_many([A]) == [False]  # answers again
    assert b.contains_now([A]) == [False]
    await b.close()


async def test_a_hung_server_holds_the_caller_for_the_inline_timeout_only(redis_server) -> None:
    b = redis_backend(f"{redis_server.url}?inline_timeout=0.05&{FAST}")
    now = [1000.0]
    b._clock = lambda: now[0]
    assert await b.put_many([(A, b"x")]) == [True]
    assert b.contains_now([A]) == [True]
    redis_server.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        t = time.monotonic()
        assert b.contains_now([A]) is None
        waited = time.monotonic() - t
        assert waited < 0.5, f"held the caller {waited:.2f}s; inline_timeout is 0.05s"
        t = time.monotonic()
        assert b.contains_now([A]) is None
        assert time.monotonic() - t < 0.01, "backing off: the second ask must not wait"
    finally:
        redis_server.resume()
    now[0] += 1.1  # the back-off over
    assert b.contains_now([A]) == [True], "the timed-out socket was dropped, a fresh one answers"
    await b.close()


async def test_slow_round_trips_back_off_and_a_busy_probe_says_so(redis_server, monkeypatch) -> None:
    from kvstore.backends import redis as redis_mod

    b = redis_backend(f"{redis_server.url}?{FAST}&{INLINE}")
    now = [1000.0]
    b._clock = lambda: now[0]
    assert await b.put_many([(A, b"x")]) == [True]
    monkeypatch.setattr(redis_mod, "SLOW_PROBE_SHARE", 0.0)  # every round trip is "slow" now
    assert b.contains_now([A]) == [True]  # slow once: answered (a busy process?)
    assert b.contains_now([A]) == [True]  # twice in a row: answered, then backing off
    assert b.contains_now([A]) is None
    monkeypatch.setattr(redis_mod, "SLOW_PROBE_SHARE", 10.0)
    now[0] += 1.1
    assert b.probe is not None
    with b.probe._lock:  # another thread is asking: this one goes to the loop, no wait
        assert b.contains_now([A]) is None
    assert b.contains_now([A]) == [True]
    await b.close()


async def test_a_host_name_is_resolved_on_the_loop_not_the_callers_thread(redis_server) -> None:
    b = redis_backend(f"redis://localhost:{redis_server.port}/0?{FAST}&{INLINE}")
    assert await b.put_many([(A, b"x")]) == [True]
    assert b.contains_now([A]) is None, "no DNS lookup on the caller's thread"
    assert await b.contains_many([A]) == [True]  # the loop starts resolving in the background
    assert b._resolving is not None
    await b._resolving
    assert b.contains_now([A, B]) == [True, False]
    await b.close()


async def test_a_fresh_connection_that_hangs_at_login_is_bounded_too() -> None:
    with RedisServer(password="pw-1") as srv:
        b = redis_backend(f"{srv.url}?inline_timeout=0.05&{FAST}")
        assert await b.put_many([(A, b"x")]) == [True]
        assert b.contains_now([A]) == [True]
        assert b.probe is not None and b.probe._sock is not None
        b.probe._sock.close()
        b.probe._sock = None  # the next call connects and logs in again
        srv.pause()  # the kernel still accepts the connection; AUTH is never answered
        try:
            t = time.monotonic()
            assert b.contains_now([A]) is None
            waited = time.monotonic() - t
        finally:
            srv.resume()
        assert waited < 0.3, f"connect + login held the caller {waited:.2f}s; inline_timeout is 0.05s for the whole call"
        assert b.probe._sock is None, "the half-open connection was dropped"
        await b.close()
