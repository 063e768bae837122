"""kvstore's MP-mode L2 adapter, driven the way LMCache's store and prefetch controllers
drive it: submit a task, wait on its event fd, pop the result.

LMCache's own conformance check runs against it too (``basic_check --mode
test_l2_adapter``).  The adapter in a real ``lmcache server`` process is tested in
test_l2_server.py.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from tests.support.lmcache_check import assert_l2_conformance  # noqa: E402
from tests.support.required import require_module  # noqa: E402

require_module("lmcache.v1.distributed.l2_adapters.base")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402

from kvstore_lmcache.keymap import mp_object_name  # noqa: E402
from kvstore_lmcache.l2_adapter import KVStoreL2Adapter, KVStoreL2AdapterConfig  # noqa: E402
from kvstore_lmcache.l2_sync import SyncL2, object_key  # noqa: E402

SHAPE = (2, 2, 16, 32)  # [kv, layers, tokens, heads*dim]


def okey(i: int, *, model="m/x", kv_rank=0, group=0, salt="") -> ObjectKey:
    return object_key(i, model=model, kv_rank=kv_rank, object_group_id=group, cache_salt=salt)


def store(ad: KVStoreL2Adapter, keys, tensors) -> bool:
    return SyncL2(ad).store(keys, tensors)


def lookup(ad: KVStoreL2Adapter, keys) -> list[bool]:
    return SyncL2(ad).lookup(keys)


def load(ad: KVStoreL2Adapter, keys, shape=SHAPE, dtype=torch.bfloat16):
    outs = [torch.zeros(shape, dtype=dtype) for _ in keys]
    hits = SyncL2(ad).load(keys, outs)
    return [t if hit else None for t, hit in zip(outs, hits)]


def kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture
def make_adapter(tmp_path):
    made = []

    def make(tiers=None, **params):
        params.setdefault("tiers", tiers or [f"file://{tmp_path}/disk"])
        ad = KVStoreL2Adapter(KVStoreL2AdapterConfig.from_dict(params))
        made.append(ad)
        return ad

    yield make
    for ad in made:
        ad.close()


def test_store_lookup_load_bytes_equal(make_adapter, tmp_path):
    ad = make_adapter([f"mem://l2-{tmp_path.name}?capacity=64MiB", f"file://{tmp_path}/disk"])
    keys = [okey(i) for i in range(4)]
    tensors = [kv(i) for i in range(4)]
    assert lookup(ad, keys) == [False] * 4
    assert store(ad, keys, tensors)
    assert lookup(ad, keys) == [True] * 4
    got = load(ad, keys)
    for t, g in zip(tensors, got):
        assert g is not None and torch.equal(t, g)
    ad.submit_unlock(keys)
    ad.submit_unlock(keys)  # one lookup lock each was taken above; extra unlocks are harmless
    usage = ad.get_usage()
    assert usage.total_bytes_used == sum(t.nbytes for t in tensors)


def test_loads_from_a_disk_tier_are_read_and_completed_off_the_loop(make_adapter, tmp_path):
    """A load task whose chunks all sit on a disk tier is read on worker threads started
    from LMCache's thread and completed from the last of them (no hop to the store's
    loop); a chunk that is not a clean hit sends the task to the loop's read, which
    quarantines it: a miss for that chunk only."""
    ad = make_adapter([f"file://{tmp_path}/disk?fsync=false"])
    keys = [okey(i) for i in range(3)]
    tensors = [kv(i) for i in range(3)]
    assert store(ad, keys, tensors)
    assert lookup(ad, keys) == [True] * 3
    got = load(ad, keys)
    assert all(g is not None and torch.equal(g, t) for g, t in zip(got, tensors))
    assert (ad.counters.loads_off_loop, ad.counters.loads_handed_back, ad.counters.load_hits) == (1, 0, 3)
    files = sorted(p for p in (tmp_path / "disk" / "objects").rglob("*") if p.is_file())
    raw = bytearray(files[0].read_bytes())
    raw[-7] ^= 0x10
    files[0].write_bytes(bytes(raw))
    time.sleep(0.1)  # (a read quarantines only a file older than its start)
    got = load(ad, keys)
    assert sum(g is None for g in got) == 1, "the flipped chunk is a miss, the others load"
    assert all(torch.equal(g, t) for g, t in zip(got, tensors) if g is not None)
    assert ad.counters.loads_handed_back == 1
    assert any((tmp_path / "disk" / "quarantine").iterdir())
    assert ad.runtime.store.stats().tiers[0].hits == 5


def test_a_load_handed_back_to_the_loop_keeps_one_deadline(make_adapter, tmp_path):
    """A load read off the loop that runs past the tier's deadline is handed to the loop's
    read with what is left of the task's ``timeout_s``, not a fresh one: the task still
    ends within about ``timeout_s``."""
    import asyncio

    from kvstore.backends.base import ReadsNow

    ad = make_adapter([f"file://{tmp_path}/disk?fsync=false"], timeout_s=2.0)  # tier deadline: 1 s
    keys = [okey(i) for i in range(2)]
    assert store(ad, keys, [kv(0), kv(1)])
    store_ = ad.runtime.store
    disk = store_.tiers[0].backend
    real = disk.reader_now()

    def slow(name, sink):  # type: ignore[no-untyped-def]
        time.sleep(1.5)
        return real.step(name, sink)

    async def stuck(*_a, **_k):  # the loop's read of it hangs too
        await asyncio.sleep(30)

    started = time.monotonic()
    with (
        mock.patch.object(disk, "reader_now", lambda: ReadsNow(slow, 1)),
        mock.patch.object(store_, "get_many", stuck),
    ):
        assert load(ad, keys) == [None, None]
    took = time.monotonic() - started
    assert took < 2.8, f"one deadline in all (a fresh one for the loop's read took 3.5 s): {took:.2f}s"
    assert ad.counters.loads_handed_back == 1 and ad.counters.timeouts == 1


def test_store_tasks_into_a_full_tier_succeed_and_the_newest_are_loaded(make_adapter, tmp_path):
    """Once a bounded tier is full, each store task of fresh chunks still succeeds (the
    default policy makes room with older chunks, never with the task's own) and its
    chunks load back; LMCache's server would otherwise log each task as failed."""
    nbytes = kv(0).nbytes
    ad = make_adapter([f"file://{tmp_path}/full?capacity={12 * (nbytes + 1024)}&fsync=false"])
    for t in range(10):
        keys = [okey(100 * t + i) for i in range(4)]
        assert store(ad, keys, [kv(100 * t + i) for i in range(4)]), f"store task {t}"
    keys = [okey(900 + i) for i in range(4)]
    got = load(ad, keys)
    assert all(g is not None and torch.equal(g, kv(900 + i)) for i, g in enumerate(got))


def test_lookups_are_answered_at_submit_and_their_locks_hold_under_pressure(make_adapter, tmp_path):
    """A lookup the store's books can answer is done when `submit_lookup_and_lock_task`
    returns (its event fd already signalled: no wait on the store's loop); the chunks it
    found stay locked while fresh stores push everything else out of a full tier, and a
    chunk another adapter stored meanwhile is still found."""
    nbytes = kv(0).nbytes
    url = f"file://{tmp_path}/small?capacity={6 * (nbytes + 1024)}&fsync=false"
    ad = make_adapter([url])
    other = make_adapter([url])  # a second server process on the same directory
    keys = [okey(i) for i in range(3)]
    assert store(ad, keys, [kv(i) for i in range(3)])
    with mock.patch.object(ad.runtime, "submit", side_effect=AssertionError("the lookup went to the loop")):
        tid = ad.submit_lookup_and_lock_task([*keys, okey(99)], {})
    bitmap = ad.query_lookup_and_lock_result(tid)
    assert bitmap is not None, "a lookup the books answer is complete at submit"
    assert [bitmap.test(i) for i in range(4)] == [True, True, True, False]
    assert ad.counters.lookups == 4 and ad.counters.lookup_hits == 3
    assert ad.counters.lookup_tasks_at_submit == 1
    for t in range(6):  # four times the rest of the tier's room, in fresh chunks
        fresh = [okey(1000 + 10 * t + i) for i in range(2)]
        assert store(ad, fresh, [kv(1000 + 10 * t + i) for i in range(2)])
    got = load(ad, keys)
    assert all(g is not None and torch.equal(g, kv(i)) for i, g in enumerate(got)), "locked chunks were evicted"
    assert lookup(ad, [okey(1000)]) == [False]  # unlocked chunks did make room
    assert store(other, [okey(500)], [kv(500)])
    assert lookup(ad, [okey(500)]) == [True]  # found on disk, past this adapter's books
    ad.submit_unlock(keys)


def test_a_lookup_lock_never_released_lapses_with_its_pin(make_adapter, tmp_path):
    """LMCache leaves the locks of an aborted request's lookup unreleased: such a lock
    lapses after ``lock_ttl_s`` with its pin, so a later lookup's one unlock frees the
    chunk (it is not held by a count that never reaches zero)."""
    ad = make_adapter([f"file://{tmp_path}/d?fsync=false"], lock_ttl_s=1.0)
    keys = [okey(1)]
    assert store(ad, keys, [kv(1)])
    assert lookup(ad, keys) == [True]  # an aborted request: never unlocked
    assert ad.report_status()["locked"] == 1
    time.sleep(1.2)
    assert ad.report_status()["locked"] == 0
    assert lookup(ad, keys) == [True]
    name = ad._names(keys)[0]
    assert name is not None and name in ad.runtime.store.inflight  # pinned by the lookup
    ad.submit_unlock(keys)
    assert ad.report_status()["locked"] == 0
    assert name not in ad.runtime.store.inflight  # the one unlock freed it


def test_results_lmcache_never_collects_are_not_kept_forever(make_adapter, tmp_path, monkeypatch):
    """Lookups of an aborted request finish with nobody to collect them: past a bound,
    the oldest uncollected results go; the latest are still there to collect."""
    import kvstore_lmcache.l2_adapter as l2

    monkeypatch.setattr(l2, "UNCOLLECTED_MOST", 4)
    ad = make_adapter([f"file://{tmp_path}/d?fsync=false"])
    for i in range(9):
        ad.submit_lookup_and_lock_task([okey(i)], {})
    deadline = time.monotonic() + 10
    while ad.counters.lookups < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ad.counters.lookups == 9 and len(ad._done_lookups) <= 4
    assert lookup(ad, [okey(100)]) == [False]  # a result still reaches its collector


def test_the_start_listing_leaves_chunks_being_stored_to_their_store(make_adapter, tmp_path):
    """LMCache's usage counts each chunk once, at the size its store gave: a chunk whose
    file the start-up listing meets while this adapter is storing it is counted by the
    store, not by the listing (which would count it at its frame's size)."""
    url = f"file://{tmp_path}/d?fsync=false"
    other = make_adapter([url])
    assert store(other, [okey(1), okey(2)], [kv(1), kv(2)])  # on disk, unknown to `ad`
    ad = make_adapter([url])
    ad.runtime.submit(ad._adopt_existing()).result(10)  # as the listing at start does (names count once)
    before = ad.get_usage().total_bytes_used
    assert before > 2 * kv(1).nbytes, "the start listing counted both, at their frame's size"
    (name3,) = ad._names([okey(3)])
    assert store(other, [okey(3)], [kv(3)])
    with ad._lock:
        ad._storing[name3] += 1  # as while `ad` stores it
    ad.runtime.submit(ad._adopt_existing()).result(10)
    assert ad.get_usage().total_bytes_used == before, "a chunk being stored is left to its store"
    with ad._lock:
        ad._storing.clear()
    assert store(ad, [okey(3)], [kv(3)])
    assert ad.get_usage().total_bytes_used == before + kv(3).nbytes
    ad.runtime.submit(ad._adopt_existing()).result(10)
    assert ad.get_usage().total_bytes_used == before + kv(3).nbytes, "counted once"


def test_a_chunk_from_an_earlier_run_stored_again_is_counted_once_at_its_new_size(make_adapter, tmp_path):
    """The start listing counts a chunk at its stored (frame) size; stored again here, it
    counts at the size its store gave, so deleting it takes out what was put in."""
    url = f"file://{tmp_path}/d?fsync=false"
    other = make_adapter([url])
    assert store(other, [okey(1), okey(2)], [kv(1), kv(2)])
    ad = make_adapter([url])
    ad.runtime.submit(ad._adopt_existing()).result(10)
    framed = ad.get_usage().total_bytes_used
    assert framed > 2 * kv(1).nbytes  # two frames, header and all
    assert store(ad, [okey(1)], [kv(1)])
    assert ad.get_usage().total_bytes_used == framed // 2 + kv(1).nbytes
    ad.delete([okey(1), okey(2)])
    assert ad.get_usage().total_bytes_used == 0  # nothing left over, nothing taken twice


def test_a_delete_that_fails_leaves_the_chunks_counted(make_adapter):
    ad = make_adapter()
    keys = [okey(i) for i in range(2)]
    assert store(ad, keys, [kv(0), kv(1)])
    used = ad.get_usage().total_bytes_used

    async def broken(names):
        raise OSError("the disk went away")

    with mock.patch.object(ad.runtime.store, "delete_many", broken):
        ad.delete(keys)
    assert lookup(ad, keys) == [True, True]
    assert ad.get_usage().total_bytes_used == used  # still there, still counted
    ad.delete(keys)
    assert ad.get_usage().total_bytes_used == 0


def test_models_ranks_groups_and_salts_never_collide(make_adapter):
    ad = make_adapter()
    variants = [
        okey(7),
        okey(7, model="other/model"),
        okey(7, kv_rank=(2 << 24) | (1 << 16) | (2 << 8) | 1),
        okey(7, group=1),
        okey(7, salt="tenant-a"),
        okey(7, salt="t" * 128),  # longest salt LMCache allows
    ]
    tensors = [kv(100 + i) for i in range(len(variants))]
    assert store(ad, variants, tensors)
    got = load(ad, variants)
    for t, g in zip(tensors, got):
        assert g is not None and torch.equal(t, g)
    assert lookup(ad, [okey(7, salt="tenant-b")]) == [False]


def test_restart_finds_what_was_stored_and_lists_it(make_adapter, tmp_path):
    keys = [okey(i, salt="s1") for i in range(3)]
    tensors = [kv(i) for i in range(3)]
    first = make_adapter()
    assert store(first, keys, tensors)
    first.close()
    second = make_adapter()
    assert lookup(second, keys) == [True] * 3
    assert all(torch.equal(t, g) for t, g in zip(tensors, load(second, keys)))
    deadline = time.time() + 10
    while second.get_usage().total_bytes_used < sum(t.nbytes for t in tensors) and time.time() < deadline:
        time.sleep(0.05)  # the start-up listing runs in the background
    page = second.list_l2_keys(model_name="m/x", page_size=2)
    assert len(page.entries) == 2 and page.next_page_token is not None
    rest = second.list_l2_keys(model_name="m/x", page_size=2, cursor=page.next_page_token)
    listed = {e.key.to_object_key() for e in (*page.entries, *rest.entries)}
    assert listed == set(keys) and rest.next_page_token is None
    by_salt = second.get_usage().bytes_by_cache_salt
    assert set(by_salt) == {"s1"} and by_salt["s1"] >= sum(t.nbytes for t in tensors)  # stored frames


# vLLM's model name is the model argument: a local path, escaped, is over 64 characters
LONG_MODEL = "/mnt/models/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f249a16976918f6564b8830bc894c89659"


def restarted_over_long_named_chunks(make_adapter):
    """An adapter started over two chunks an earlier one stored under `LONG_MODEL`, its
    listing at start over (they wait, unnamed); and their keys."""
    keys = [okey(i, model=LONG_MODEL) for i in range(2)]
    first = make_adapter()
    assert store(first, keys, [kv(0), kv(1)])
    first.close()
    second = make_adapter()
    second._listed.result(10)
    return second, keys


def assert_counted_once(ad, nbytes):
    """LMCache's usage comes to one chunk of `nbytes` (a frame: a little more), and stays."""
    deadline = time.time() + 10
    while ad.get_usage().total_bytes_used == 0 and time.time() < deadline:
        time.sleep(0.02)  # (counted off the request's thread)
    time.sleep(0.1)
    assert nbytes <= ad.get_usage().total_bytes_used < 2 * nbytes


def test_after_a_restart_chunks_of_a_long_model_name_count_once_a_request_names_it(make_adapter):
    """vLLM's model name is often a path: escaped, it is over 64 characters and its names
    are shortened with a digest, which the listing at start cannot read back. The first
    request naming that model tells which key they are: then they count, list and delete
    like any other."""
    model = LONG_MODEL
    keys = [okey(i, model=model) for i in range(3)]
    tensors = [kv(i) for i in range(3)]
    other = okey(9, model=model + "-other")  # an earlier run's model no request names now
    first = make_adapter()
    assert store(first, keys, tensors)
    assert store(first, [other], [kv(9)])
    first.close()
    second = make_adapter()
    second._listed.result(10)  # (the listing at start is over)
    assert second.get_usage().total_bytes_used == 0  # not readable from the names alone
    sync = SyncL2(second)
    assert sync.lookup(keys[:1]) == [True]  # a request names the model...
    done = threading.Thread(target=sync.unlock, args=(keys[:1],), daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive(), "unlocking while other shortened names wait must not hang"
    deadline = time.time() + 10
    while second.get_usage().total_bytes_used < sum(t.nbytes for t in tensors) and time.time() < deadline:
        time.sleep(0.02)  # (counted off the request's thread)
    assert sum(t.nbytes for t in tensors) <= second.get_usage().total_bytes_used < 4 * kv(0).nbytes  # ...all three
    listed = {e.key.to_object_key() for e in second.list_l2_keys(model_name=model, page_size=10).entries}
    assert listed == set(keys)
    second.delete(keys)
    assert second.get_usage().total_bytes_used == 0
    assert lookup(second, keys) == [False] * 3


def test_a_chunk_under_a_shortened_name_gone_before_it_was_named_is_never_counted(make_adapter):
    second, keys = restarted_over_long_named_chunks(make_adapter)
    second._gone([mp_object_name(keys[0], second._ns)])  # evicted by kvstore's own policy before any request named the model
    assert lookup(second, keys[1:]) == [True]
    assert_counted_once(second, kv(1).nbytes)  # the one left


def test_a_chunk_under_a_shortened_name_gone_while_it_is_being_counted_is_not(make_adapter):
    from kvstore_lmcache import l2_adapter

    second, keys = restarted_over_long_named_chunks(make_adapter)
    victim = mp_object_name(keys[0], second._ns)
    naming = l2_adapter.mp_object_name

    def evicted_as_it_is_named(key, ns):  # kvstore's policy evicts it while it is being counted
        name = naming(key, ns)
        if name == victim:
            second._gone([victim])
        return name

    with mock.patch.object(l2_adapter, "mp_object_name", evicted_as_it_is_named):
        assert lookup(second, keys[1:]) == [True]
        assert_counted_once(second, kv(1).nbytes)  # the one left
    assert victim not in second._sizes


def test_a_fast_path_that_faults_is_served_on_the_loop_counted_and_said_once(make_adapter, caplog):
    ad = make_adapter()
    keys = [okey(i) for i in range(2)]
    assert store(ad, keys, [kv(0), kv(1)])

    def broken(*args, **kw):
        raise OSError("stat failed")

    tiered = ad.runtime.store
    with (
        mock.patch.object(tiered, "lookup_now", broken),
        mock.patch.object(tiered, "read_now", broken),
        caplog.at_level("DEBUG", logger="kvstore"),
    ):
        assert lookup(ad, keys) == [True, True]  # answered all the same
        assert all(torch.equal(t, kv(i)) for i, t in enumerate(load(ad, keys)))
        assert lookup(ad, keys) == [True, True]
    assert ad.report_status()["counters"]["fast_path_faults"] == 3
    said = [r for r in caplog.records if "fast_path_faults" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "DEBUG", "DEBUG"]


def test_a_key_that_cannot_be_named_is_a_miss_for_itself_only(make_adapter):
    ad = make_adapter()
    keys = [okey(i) for i in range(3)]
    assert store(ad, keys, [kv(i) for i in range(3)])
    unnamable = okey(5, model="m" * 2000)  # longer than any object name may be
    assert lookup(ad, [keys[0], unnamable, keys[1], keys[2]]) == [True, False, True, True]
    ad.submit_unlock(keys)


def test_wrong_shape_is_a_miss_not_wrong_data(make_adapter):
    ad = make_adapter()
    assert store(ad, [okey(1)], [kv(1)])
    (got,) = load(ad, [okey(1)], shape=(2, 2, 16, 16))  # same key, another model geometry
    assert got is None
    (got,) = load(ad, [okey(1)], dtype=torch.float16)
    assert got is None
    (got,) = load(ad, [okey(1)])
    assert got is not None


def test_swapped_object_files_are_misses(make_adapter, tmp_path):
    ad = make_adapter()
    a, b = okey(1), okey(2)
    assert store(ad, [a, b], [kv(1), kv(2)])
    ad.close()
    files = sorted(p for p in (tmp_path / "disk" / "objects").rglob("*") if p.is_file())
    assert len(files) == 2
    tmp = files[0].with_suffix(".swap")
    files[0].rename(tmp)
    files[1].rename(files[0])
    tmp.rename(files[1])
    ad2 = make_adapter()
    assert load(ad2, [a, b]) == [None, None]


def test_delete_removes_from_every_tier_and_usage(make_adapter, tmp_path):
    ad = make_adapter([f"mem://del-{tmp_path.name}", f"file://{tmp_path}/disk"])
    keys = [okey(i) for i in range(3)]
    assert store(ad, keys, [kv(i) for i in range(3)])
    ad.delete(keys[:2])
    assert lookup(ad, keys) == [False, False, True]
    assert ad.get_usage().total_bytes_used == kv(0).nbytes
    ad.close()
    again = make_adapter()
    assert lookup(again, keys) == [False, False, True]


def test_lookup_order_gives_store_its_parents(make_adapter):
    ad = make_adapter()
    keys = [okey(i) for i in range(4)]
    assert lookup(ad, keys) == [False] * 4
    names = ad._names(keys)
    assert [ad.runtime.parent_of(n) for n in names[1:]] == names[:-1]


@pytest.mark.parametrize(
    "params, words",
    [
        ({"tiers": ["nope://x"]}, "tiers[0]"),
        ({"tiers": ["mem://a"], "timeout": 3}, "timeout"),
        ({"tiers": ["mem://a"], "timeout_s": "soon"}, "timeout_s"),
        ({"tiers": ["mem://a"], "policy": "fifo"}, "policy"),
        ({"tiers": ["mem://a"], "lock_ttl_s": 0}, "lock_ttl_s"),
    ],
)
def test_bad_settings_name_the_setting(params, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        KVStoreL2AdapterConfig.from_dict(params)


def test_lmcache_conformance_check(tmp_path):
    spec = {
        "type": "plugin",
        "module_path": "kvstore_lmcache.l2_adapter",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"tiers": ["mem://bc?capacity=64MiB", f"file://{tmp_path}/disk"]},
    }
    assert_l2_conformance(spec, tmp_path)


# ---------------------------------------------------------------------- faults
from kvstore.testing.redis_server import RedisServer, redis_available  # noqa: E402
from tests.support.required import REDIS_INSTALL, needs  # noqa: E402

needs_redis = needs(redis_available(), "redis-server", REDIS_INSTALL)


@needs_redis
def test_lmcache_conformance_check_over_redis(tmp_path):
    """LMCache's check over a Redis tier alone."""
    with RedisServer(workdir=tmp_path / "redis") as server:
        spec = {
            "type": "plugin",
            "module_path": "kvstore_lmcache.l2_adapter",
            "class_name": "KVStoreL2Adapter",
            "adapter_params": {"tiers": [server.url]},
        }
        assert_l2_conformance(spec, tmp_path)


@needs_redis
def test_big_chunks_over_redis_are_hashed_as_sent_and_load_bytes_equal(make_adapter, tmp_path):
    from kvstore import checksum

    checksum.fast()  # compiled: no chunk waits for the kernels (it would be sealed first)
    big = (2, 4, 256, 512)  # 2 MiB of bf16 a chunk
    chunks = [torch.randn(big, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in range(3)]
    with RedisServer(workdir=tmp_path / "redis") as server:
        ad = make_adapter([server.url])
        keys = [okey(i) for i in range(3)]
        assert store(ad, keys, chunks)
        assert b"cmdstat_eval:calls=3," in server.command("INFO", "commandstats")  # one publish a chunk
        fresh = make_adapter([server.url])
        assert lookup(fresh, keys) == [True] * 3
        for got, want in zip(load(fresh, keys, shape=big), chunks):
            assert got is not None and torch.equal(got, want)


@needs_redis
def test_redis_misses_are_answered_at_submit_and_chunks_stored_elsewhere_are_found(make_adapter, tmp_path):
    """A lookup on a Redis tier that finds none of a prompt's chunks is done when
    `submit_lookup_and_lock_task` returns (one round trip on LMCache's thread, no hop to
    the store's loop); one that finds a chunk the books do not know (another server
    stored it) still asks on the loop, which takes it into the books, and it loads."""
    with RedisServer(workdir=tmp_path / "redis") as server:
        # a deadline no slow moment of a shared CI machine reaches: the default 5 ms would
        # send a lookup whose first connect and login took longer to the loop, as designed
        ad = make_adapter([f"{server.url}?inline_timeout=0.5"])
        other = make_adapter([server.url])  # a second server process on the same Redis
        keys = [okey(i) for i in range(4)]
        with mock.patch.object(ad.runtime, "submit", side_effect=AssertionError("the lookup went to the loop")):
            tid = ad.submit_lookup_and_lock_task(keys, {})
        bitmap = ad.query_lookup_and_lock_result(tid)
        assert bitmap is not None and bitmap.popcount() == 0
        assert ad.counters.lookup_tasks_at_submit == 1
        assert store(other, keys[:2], [kv(0), kv(1)])
        assert lookup(ad, keys) == [True, True, False, False]
        assert ad.counters.lookup_tasks_at_submit == 1, "found past the books: asked on the loop"
        got = load(ad, keys[:2])
        assert all(g is not None and torch.equal(g, kv(i)) for i, g in enumerate(got))
        with mock.patch.object(ad.runtime, "submit", side_effect=AssertionError("the lookup went to the loop")):
            tid = ad.submit_lookup_and_lock_task(keys, {})  # the books hold 0 and 1 now
        bitmap = ad.query_lookup_and_lock_result(tid)
        assert bitmap is not None and [bitmap.test(i) for i in range(4)] == [True, True, False, False]
        ad.submit_unlock(keys[:2])
        ad.submit_unlock(keys[:2])


@needs_redis
def test_hung_redis_is_a_miss_within_the_deadline_then_fails_fast(make_adapter, tmp_path):
    with RedisServer(workdir=tmp_path / "redis") as server:
        ad = make_adapter([server.url], timeout_s=1.0)
        keys = [okey(i) for i in range(3)]
        assert store(ad, keys, [kv(i) for i in range(3)])
        server.pause()  # SIGSTOP: connections stay open, nothing answers
        try:
            t = time.monotonic()
            assert load(ad, keys) == [None, None, None]
            first = time.monotonic() - t
            assert first < 3.0, f"first load took {first:.2f}s; deadline 1s"
            t = time.monotonic()
            assert lookup(ad, keys) == [False] * 3
            assert load(ad, keys) == [None, None, None]
            assert time.monotonic() - t < 0.2, "breaker open: later tasks must not wait"
            assert ad.runtime.store.breakers[0].state.value == "open"
            assert ad.report_status()["is_healthy"] is False
        finally:
            server.resume()
        deadline = time.time() + 40
        while time.time() < deadline and lookup(ad, keys) != [True] * 3:
            time.sleep(0.3)  # the breaker half-opens, a probe gets through, it closes
        assert lookup(ad, keys) == [True] * 3
        assert all(g is not None for g in load(ad, keys))
        ad.submit_unlock(keys)


@needs_redis
@pytest.mark.parametrize("order", ["disk-then-redis", "redis-then-disk"])
def test_a_hung_tier_does_not_take_the_healthy_one_down(make_adapter, tmp_path, order):
    """One tier hanging fails that tier fast; the disk tier keeps serving and storing."""
    with RedisServer(workdir=tmp_path / "redis") as server:
        disk = f"file://{tmp_path}/disk?fsync=false"
        tiers = [disk, server.url] if order == "disk-then-redis" else [server.url, disk]
        ad = make_adapter(tiers, timeout_s=1.0)
        held = [okey(i) for i in range(3)]
        assert store(ad, held, [kv(i) for i in range(3)])
        server.pause()
        try:
            assert lookup(ad, [okey(99)]) == [False]  # asks every tier: Redis misses its deadline
            t = time.monotonic()
            assert lookup(ad, held) == [True] * 3, "the disk tier still answers"
            got = load(ad, held)
            assert all(g is not None and torch.equal(g, kv(i)) for i, g in enumerate(got))
            assert store(ad, [okey(50)], [kv(50)]) or order == "disk-then-redis"
            assert lookup(ad, [okey(50)]) == [True]
            assert time.monotonic() - t < 3.0
        finally:
            server.resume()


@needs_redis
def test_killed_redis_store_fails_cleanly_and_recovers(make_adapter, tmp_path):
    with RedisServer(workdir=tmp_path / "redis") as server:
        ad = make_adapter([server.url], timeout_s=1.0)
        server.kill()
        t = time.monotonic()
        assert not store(ad, [okey(1)], [kv(1)])
        assert lookup(ad, [okey(1)]) == [False]
        assert time.monotonic() - t < 10
        server.restart()
        deadline = time.time() + 40
        while time.time() < deadline and not store(ad, [okey(2)], [kv(2)]):
            time.sleep(0.3)
        assert lookup(ad, [okey(2)]) == [True]


def test_capacity_for_lmcache_eviction(make_adapter, tmp_path):
    bounded = make_adapter([f"mem://cap-{tmp_path.name}?capacity=64MiB", f"file://{tmp_path}/a?capacity=1GiB"])
    assert bounded.get_usage().total_capacity_bytes == 1 << 30 and bounded.supports_global_eviction
    unbounded = make_adapter([f"mem://cap2-{tmp_path.name}?capacity=64MiB", f"file://{tmp_path}/b"])
    assert unbounded.get_usage().total_capacity_bytes == 0 and not unbounded.supports_global_eviction


def test_memory_tags_follow_the_tiers_and_the_residency_setting(make_adapter, tmp_path):
    import lmcache.v1.distributed.api as api

    ad = make_adapter([f"mem://tags-{tmp_path.name}?capacity=64MiB", f"file://{tmp_path}/t"])
    assert ad.report_status()["memory_tags"] == {"segment": "storage", "residency": "local"}
    shared = make_adapter([f"file://{tmp_path}/shared"], residency="remote")
    assert shared.report_status()["memory_tags"] == {"segment": "storage", "residency": "remote"}
    flagged = make_adapter([f"file://{tmp_path}/flagged"])
    if hasattr(flagged, "set_backend_identity"):  # LMCache 0.5.7: its spec's "shared": true
        flagged.set_backend_identity("plugin", shared=True)
    else:
        flagged._shared = True
    assert flagged.report_status()["memory_tags"] == {"segment": "storage", "residency": "remote"}
    with pytest.raises(ValueError, match="residency"):
        KVStoreL2AdapterConfig.from_dict({"tiers": ["mem://a"], "residency": "elsewhere"})
    if not hasattr(api, "MemoryTags"):  # LMCache 0.5.6 never asks
        with pytest.raises(RuntimeError, match=r"0\.5\.7"):
            ad.get_memory_tags()
        return
    assert ad.get_memory_tags() == api.MemoryTags(api.MemorySegment.STORAGE, api.MemoryResidency.LOCAL)
    assert shared.get_memory_tags() == api.MemoryTags(api.MemorySegment.STORAGE, api.MemoryResidency.REMOTE)


def test_tasks_after_the_store_stopped_complete_as_failures_and_leave_nothing_unawaited(make_adapter):
    """A task submitted once the store's loop no longer runs (its runtime closed under
    the adapter, or a task racing `close`) completes at once as a failure: no task that
    LMCache waits on forever, no coroutine left unawaited."""
    import gc
    import warnings

    ad = make_adapter()
    keys = [okey(i) for i in range(3)]
    assert store(ad, keys[:1], [kv(0)])
    ad.runtime.close()
    sync = SyncL2(ad, timeout_s=5.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sync.store(keys[1:2], [kv(1)]) is False
        assert sync.load(keys[:1], [torch.zeros(SHAPE, dtype=torch.bfloat16)]) == [False]
        found = sync.lookup(keys[2:])  # unknown to the books: needs the loop, or says no at once
        assert found == [False]
        gc.collect()
    assert ad.counters.refused >= 2
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_close_fails_a_load_stuck_on_a_tier_and_later_tasks_raise_nothing(make_adapter):
    """A load still waiting on a tier when the adapter closes is completed as a miss by
    the close (not left for LMCache to wait on); a task submitted after close completes
    at once as a failure, without touching the closed event fds."""
    import asyncio

    from kvstore_lmcache.l2_sync import memory_obj

    ad = make_adapter(timeout_s=60)
    keys = [okey(i) for i in range(2)]
    assert store(ad, keys[:1], [kv(0)])
    started = __import__("threading").Event()

    async def stuck(*_a, **_k):
        started.set()
        await asyncio.Event().wait()

    published_at_close: list[bool] = []
    close = ad.runtime.store.close

    async def closing():  # the tiers close only after the stuck load was completed
        published_at_close.append(tid in ad._done_loads)
        await close()

    with (
        mock.patch.object(ad.runtime.store, "get_many", stuck),
        mock.patch.object(ad.runtime.store, "read_now", lambda *_a: False),  # (the loop's read path)
        mock.patch.object(ad.runtime.store, "close", closing),
    ):
        tid = ad.submit_load_task(keys[:1], [memory_obj(torch.zeros(SHAPE, dtype=torch.bfloat16))])
        assert started.wait(10)
        t0 = time.monotonic()
        ad.close()
        assert time.monotonic() - t0 < 20
    assert published_at_close == [True]
    bm = ad.query_load_result(tid)
    assert bm is not None and not bm.test(0)
    tid = ad.submit_store_task(keys[1:], [memory_obj(kv(1))])  # no OSError from a closed fd
    assert ad.pop_completed_store_tasks()[tid].is_successful() is False


def test_a_listener_that_raises_fails_no_task(make_adapter):
    """LMCache's listeners are told of stored and accessed keys; one that raises is
    logged and counted, and the store and the load still complete with what they did."""
    ad = make_adapter()

    class Broken:
        def on_l2_keys_stored(self, keys, sizes):
            raise RuntimeError("listener bug")

        def on_l2_keys_accessed(self, keys):
            raise RuntimeError("listener bug")

        def on_l2_keys_deleted(self, keys, sizes):
            raise RuntimeError("listener bug")

    ad.register_listener(Broken())
    keys = [okey(i) for i in range(2)]
    tensors = [kv(0), kv(1)]
    assert store(ad, keys, tensors)
    got = load(ad, keys)
    assert all(g is not None and torch.equal(g, t) for g, t in zip(got, tensors))
    assert ad.counters.errors >= 2


def test_a_task_that_raises_is_completed_as_failed(make_adapter):
    """Whatever a task's coroutine raises past its own handling, LMCache's task is
    completed (as failed) instead of waited on forever."""
    ad = make_adapter()
    refused = __import__("threading").Event()

    async def broken() -> None:
        raise KeyError("bug")

    ad._start(broken(), refused.set)
    assert refused.wait(10)
    assert ad.counters.errors == 1


def test_close_lets_a_store_under_way_finish_before_the_tiers_close(make_adapter):
    """A store task still writing when the adapter closes is waited for: it completes as
    stored, and the tiers close only after it ended."""
    import asyncio

    from kvstore_lmcache.l2_sync import memory_obj

    ad = make_adapter()
    store_ = ad.runtime.store
    order: list[str] = []
    put_many, close = store_.put_many, store_.close

    async def slow_put(*a, **k):
        await asyncio.sleep(0.5)
        res = await put_many(*a, **k)
        order.append("stored")
        return res

    async def closing():
        order.append("closed")
        await close()

    with mock.patch.object(store_, "put_many", slow_put), mock.patch.object(store_, "close", closing):
        tid = ad.submit_store_task([okey(1)], [memory_obj(kv(1))])
        time.sleep(0.1)
        ad.close()
    assert order == ["stored", "closed"]
    assert ad.pop_completed_store_tasks()[tid].is_successful()


def test_closed_adapters_give_their_file_descriptors_back(make_adapter, tmp_path):
    """LMCache may add and remove L2 adapters while it runs: each close gives back the
    loop's and the tiers' descriptors (the loop alone kept 3 a cycle)."""
    import gc
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    make_adapter(tiers=["mem://fd-warm"]).close()
    gc.collect()
    before = open_fds()
    cycles = 10
    for i in range(cycles):
        ad = make_adapter(tiers=[f"mem://fd-{i}", f"file://{tmp_path}/fd-{i}"])
        assert store(ad, [okey(i)], [kv(i)])
        ad.close()
    # a disk tier's first listing of its folders runs on a thread of its own and may still
    # hold a folder open for a moment after close: a few at most, not one or more a cycle
    deadline = time.monotonic() + 5
    while open_fds() > before + 1 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert open_fds() - before < cycles // 2
