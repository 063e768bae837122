"""kvstore as an L2 adapter of LMCache's multiprocess (MP) server.

Load it with::

    lmcache server --l1-size-gb 20 --eviction-policy LRU \\
      --l2-adapter '{"type": "plugin", "module_path": "kvstore_lmcache.l2_adapter",
                     "class_name": "KVStoreL2Adapter",
                     "adapter_params": {"tiers": ["file:///var/cache/kvstore?capacity=500GiB"]}}'

``adapter_params`` takes the in-process plugins' kvstore settings without the
``kvstore.`` prefix (``tiers``, ``cold_codec``, ``namespace``, ``timeout_s``,
``policy``, ``config_file``; see `kvstore.store_config`) plus ``lock_ttl_s``.  A bad
setting stops the server with a message naming it: the server never comes up
silently without its cache.

Owns: LMCache's L2 task protocol (task ids, completed-task tables, event fds),
lookup locks (pins, counted per key), the deadline and the fail-fast breaker of every
task, and the byte accounting LMCache's own L2 eviction and listing read.  Must not
touch: storage logic (the store), LMCache's threads (every task runs on the runtime's
own loop and signals its event fd when done; a lookup the store's books can answer, the
common case, is answered and signalled before `submit_lookup_and_lock_task` returns,
without the two thread hops; a load whose chunks all sit on a disk tier is read on the
store's worker threads, started from LMCache's thread, and signalled from the last of
them, `TieredStore.read_now`, with the loop's read path taking any batch that is not all
clean hits).

Every task ends: a tier that fails or misses its deadline (half of ``timeout_s``) is a
miss (or a failed store) for that tier only, never an exception in the server; its
breaker then fails it fast until a probe gets through, while the other tiers serve on.
Each task as a whole is also bounded by ``timeout_s`` (writes by a longer deadline).
Loads decode straight into the MemoryObjs the server hands in (one copy), and a
stored object whose key, checksum, shape or dtype does not match is a miss.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvstore.deadlines import within
from kvstore.keys import ChunkKey, InvalidKeyError, chunk_hash_of, namespace_prefix
from kvstore.metrics_export import export_store, parse_port
from kvstore.store_config import KEYS, StoreConfig, StoreConfigError
from kvstore_lmcache.keymap import (
    byte_target,
    mp_chunk_key,
    mp_object_key,
    mp_object_name,
    mp_object_names,
    payload_of,
)
from kvstore_lmcache.memory_tags import RESIDENCIES, Residency, StoreTags, store_tags
from kvstore_lmcache.runtime import Role, StoreRuntime, log

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import KeyListPage, MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

ADAPTER_KEYS = ("lock_ttl_s", "metrics_port", "residency")
LOCKS_PRUNE_AT = 1 << 14  # lookup locks kept before lapsed ones are swept
UNCOLLECTED_MOST = 1 << 16  # task results LMCache has not collected, kept before the oldest go


@dataclass
class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params``, validated: kvstore's settings plus the adapter's own."""

    store: StoreConfig
    lock_ttl_s: float = 120.0
    metrics_port: int | None = None  # serve kvstore's metrics there too (docs/operations.md)
    residency: Residency | None = None  # LMCache's memory tags: None = read from the tiers

    @classmethod
    def from_dict(cls, d: dict) -> KVStoreL2AdapterConfig:
        params = dict(d)
        for outer in ("type", "module_path", "class_name", "config_class_name"):
            params.pop(outer, None)  # tolerated when the whole JSON is handed in
        lock_ttl = params.pop("lock_ttl_s", 120.0)
        try:
            lock_ttl_s = float(lock_ttl)
        except (TypeError, ValueError):
            raise ValueError(f"adapter_params.lock_ttl_s: cannot read {lock_ttl!r} as seconds") from None
        if not lock_ttl_s > 0:
            raise ValueError("adapter_params.lock_ttl_s must be > 0 seconds")
        metrics_port = parse_port(params.pop("metrics_port", None), "adapter_params.metrics_port")
        residency = params.pop("residency", None)
        if residency is not None and residency not in RESIDENCIES:
            raise ValueError(
                f"adapter_params.residency: {residency!r}; use 'local' (this host's bytes) or "
                "'remote' (off this host, or shared with other hosts), or leave it out to read it from the tiers"
            )
        unknown = sorted(k for k in params if k not in KEYS)
        if unknown:
            raise ValueError(
                f"adapter_params key(s) {unknown} unknown; known: {', '.join((*KEYS, *ADAPTER_KEYS))}"
            )
        try:
            store = StoreConfig.from_mapping(params, prefix="")
        except StoreConfigError as exc:
            raise ValueError(f"kvstore adapter_params: {exc}") from None
        return cls(store=store, lock_ttl_s=lock_ttl_s, metrics_port=metrics_port, residency=residency)

    @classmethod
    def help(cls) -> str:
        return (
            "kvstore L2 adapter (adapter_params):\n"
            "- tiers (list of URLs, hottest first; required in practice): e.g.\n"
            '  ["mem://hot?capacity=4GiB", "file:///var/cache/kvstore?capacity=500GiB"]\n'
            "- cold_codec (str): codec of the last tier, e.g. cachegen?profile=smollm2-135m\n"
            "- namespace (str), timeout_s (float, per task deadline), policy (chain|lru|...)\n"
            "- config_file (path): JSON/TOML with the same keys\n"
            "- lock_ttl_s (float): how long a lookup lock protects an object at most\n"
            "- metrics_port (int): also serve kvstore's Prometheus metrics on this port\n"
            "- residency (local|remote): LMCache's memory tags (LMCache 0.5.7+); default: from the tiers"
        )


@dataclass
class L2Counters:
    lookups: int = 0
    lookup_hits: int = 0
    lookup_tasks_at_submit: int = 0  # lookup tasks answered on the server's thread, no hop to the loop
    loads: int = 0
    load_hits: int = 0
    loads_off_loop: int = 0  # load tasks read and completed on worker threads, no hop to the loop
    loads_handed_back: int = 0  # of those begun so, tasks the loop read after all (not all clean hits)
    fast_path_faults: int = 0  # lookups and loads the server's thread could not begin: the loop took them
    stores: int = 0
    stores_failed: int = 0
    timeouts: int = 0
    errors: int = 0
    refused: int = 0  # tasks submitted after close


def _prefix(name: str) -> str:
    """What a chunk's name shares with every chunk of its model, rank, group and salt
    (all but the chunk hash)."""
    return name[: name.rfind("/") + 1]


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` over a kvstore `TieredStore`."""

    def __init__(self, config: KVStoreL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        if not isinstance(config, KVStoreL2AdapterConfig):
            config = KVStoreL2AdapterConfig.from_dict(dict(config))
        self.config = config
        cfg = config.store
        capacity = store_capacity(cfg)
        super().__init__(max_capacity_bytes=capacity)
        self.counters = L2Counters()
        self._ns = cfg.namespace
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._done_stores: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookups: dict[L2TaskId, Bitmap] = {}
        self._done_loads: dict[L2TaskId, Bitmap] = {}
        # name -> (lookup locks held, until when): a lock whose lookup LMCache abandoned
        # (an aborted request never unlocks) lapses with its pin
        self._locks: dict[str, tuple[int, float]] = {}
        self._sizes: dict[str, int] = {}  # names this adapter knows are stored -> bytes
        self._storing: Counter[str] = Counter()  # names being stored now (the start's listing leaves them)
        self._keys: dict[str, ObjectKey] = {}
        # earlier runs' objects whose names were shortened (a model name or salt over 64
        # characters escaped), by name prefix: counted once a key names that prefix
        self._unnamed: dict[str, dict[str, int]] = {}  # prefix -> {name: stored size}
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        urls = [t.backend_url for t in cfg.tiers]
        self._tags = {shared: store_tags(urls, config.residency, shared=shared) for shared in (False, True)}
        self._lmcache_tags: dict[bool, Any] = {}
        self.runtime = StoreRuntime(cfg, name="kvstore-l2")
        self.runtime.store.on_gone = self._gone
        self._closed = False
        self._efds_closed = False
        export_store(self.runtime.store, name="kvstore-l2", adapter=self, port=config.metrics_port)
        self._listed = self.runtime.submit(self._adopt_existing(), "background")  # (tests wait for it)
        log.info("kvstore L2 adapter ready: %s", cfg.describe())

    # ---------------------------------------------------------------- event fds
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------------- tasks
    def _new_id(self) -> L2TaskId:
        with self._lock:
            tid = self._next_id
            self._next_id += 1
            return tid

    def _names(self, keys: Sequence[ObjectKey]) -> list[str | None]:
        try:
            names: list[str | None] = list(mp_object_names(keys, self._ns))
        except (InvalidKeyError, ValueError):  # one key cannot be named: name them one by one
            names = self._names_one_by_one(keys)
        if self._unnamed:  # (no lock taken here: callers may hold `_lock`)
            self._note_named(keys, names)
        return names

    def _names_one_by_one(self, keys: Sequence[ObjectKey]) -> list[str | None]:
        out: list[str | None] = []
        for key in keys:
            try:
                name = mp_object_name(key, self._ns)
            except (InvalidKeyError, ValueError) as exc:
                log.warning("kvstore: key %s cannot be stored (%s); treated as a miss", key, exc)
                name = None
            out.append(name)
        return out

    async def _bounded(self, coro: Coroutine[Any, Any, Any], timeout: float, what: str) -> Any:
        """Run `coro` under `timeout`; None on timeout or error (counted; the tiers' breakers
        are told by their own guards)."""
        try:
            result = await within(coro, timeout)
        except asyncio.TimeoutError:
            self.counters.timeouts += 1
            log.warning("kvstore L2: %s took longer than %.1fs; served as a miss", what, timeout)
            return None
        except Exception as exc:
            self.counters.errors += 1
            log.warning("kvstore L2: %s failed (%s); served as a miss", what, exc)
            return None
        return result

    def _start(self, task: Coroutine[Any, Any, None], refused: Callable[[], None], role: Role = "read") -> None:
        """Run `task` (a ``_finish_*`` coroutine, which makes the work's own coroutine
        where it runs, so no coroutine is left unawaited) on the store's loop; after
        close, or once the loop no longer runs, close it unrun and call `refused`, which
        completes LMCache's task as failed.  A task that is cancelled (the runtime
        closing) or raises before it completes LMCache's task is completed as failed too:
        LMCache never waits on a task that will not end."""
        if not self._closed:
            try:
                fut = self.runtime.submit(task, role)
            except RuntimeError:  # the runtime's loop stopped (closed under us)
                pass
            else:
                fut.add_done_callback(lambda f: self._ended(f, refused))
                return
        task.close()
        self.counters.refused += 1
        refused()

    def _ended(self, fut: concurrent.futures.Future[None], refused: Callable[[], None]) -> None:
        if fut.cancelled():
            refused()
        elif (exc := fut.exception()) is not None:
            self.counters.errors += 1
            log.error("kvstore L2: a task failed before it completed (%r); completed as failed", exc)
            refused()

    def _tell(self, what: str, notify: Callable[..., None], *args: Any) -> None:
        """One of LMCache's ``_notify_keys_*`` (its listeners and event bus): a listener
        that raises is logged, and neither fails the task nor reaches the loop."""
        try:
            notify(*args)
        except Exception:
            self.counters.errors += 1
            log.exception("kvstore L2: telling LMCache's listeners keys were %s failed", what)

    # --------------------------------------------------------------------- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._new_id()
        self._start(
            self._finish_store(tid, keys, objects), lambda: self._complete_store(tid, L2StoreResult(False, 0)), "write"
        )
        return tid

    async def _finish_store(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        # writes may move tens of MiB per chunk: a longer deadline than reads
        deadline = self.config.store.store_deadline_s()
        written = await self._bounded(self._store(keys, objects), deadline, f"store of {len(keys)} chunk(s)")
        if written is None:
            self.counters.stores_failed += len(keys)
            self._complete_store(tid, L2StoreResult(False, 0))
        else:
            ok, nbytes = written
            self._complete_store(tid, L2StoreResult(ok, nbytes))

    def _publish(self, done: dict[L2TaskId, Any], tid: L2TaskId, result: Any, efd: Any) -> None:
        """Hand LMCache a finished task's result and wake its poller (not once `close`
        closed the event fds: under the lock it closes them under)."""
        with self._lock:
            done[tid] = result
            if len(done) > UNCOLLECTED_MOST:  # results of tasks LMCache gave up on (an aborted request)
                for old in list(itertools.islice(done, len(done) - UNCOLLECTED_MOST // 2)):
                    del done[old]
            if not self._efds_closed:
                efd.notify()

    def _complete_store(self, tid: L2TaskId, result: L2StoreResult) -> None:
        self._publish(self._done_stores, tid, result, self._store_efd)

    async def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> tuple[bool, int]:
        """Write the batch: chunks a lookup placed in a prompt go as chained runs with their
        parent; chunks with no known parent go together, unchained.  All concurrently."""
        names = {i: n for i, n in enumerate(self._names(keys)) if n is not None}
        idx = list(names)
        payloads = {i: payload_of(objects[i]) for i in idx}
        parents = {i: self.runtime.parent_of(names[i]) for i in idx}
        runs: list[list[int]] = []  # consecutive chunks of one prompt, one layout
        loose: dict[str, list[int]] = {}  # no known parent, by layout
        for k, i in enumerate(idx):
            prev = idx[k - 1] if k else None
            if (
                prev is not None
                and runs
                and runs[-1][-1] == prev
                and parents[i] == names[prev]
                and payloads[i][1] == payloads[prev][1]
            ):
                runs[-1].append(i)
            elif parents[i] is not None or (
                k + 1 < len(idx) and parents[idx[k + 1]] == names[i]
            ):
                runs.append([i])
            else:
                loose.setdefault(payloads[i][1], []).append(i)

        async def put(group: list[int], chained: bool) -> list[bool]:
            return await self.runtime.store.put_many(
                [(names[i], payloads[i][0]) for i in group],
                chained=chained,
                parent=parents[group[0]] if chained else None,
                layout=payloads[group[0]][1],
            )

        groups = [(r, True) for r in runs] + [(g, False) for g in loose.values()]
        storing = list(names.values())
        with self._lock:
            self._storing.update(storing)
        try:
            results = await asyncio.gather(*(put(g, c) for g, c in groups))
            return self._stored(keys, objects, names, groups, results)
        finally:
            with self._lock:
                self._storing.subtract(storing)
                self._storing += Counter()  # drop the names at zero

    def _stored(
        self,
        keys: list[ObjectKey],
        objects: list[MemoryObj],
        names: dict[int, str],
        groups: list[tuple[list[int], bool]],
        results: list[list[bool]],
    ) -> tuple[bool, int]:
        """Count what a store task wrote (LMCache's usage counts each chunk once); a key
        that could not be named is a failed store."""
        all_ok = len(names) == len(keys)
        new_keys: list[ObjectKey] = []
        new_sizes: list[int] = []
        resized: list[tuple[ObjectKey, int]] = []  # (key, the size LMCache was told before)
        nbytes = 0
        for (group, _), res in zip(groups, results):
            for i, ok in zip(group, res):
                stored = names[i]
                if not ok:
                    all_ok = False
                    continue
                size = objects[i].get_size()
                nbytes += size
                with self._lock:
                    before = self._sizes.get(stored)
                    self._sizes[stored] = size
                    self._keys[stored] = keys[i]
                if before != size:
                    if before is not None:  # (an earlier run's object, counted at its stored size)
                        resized.append((keys[i], before))
                    new_keys.append(keys[i])
                    new_sizes.append(size)
        self.counters.stores += len(keys)
        if resized:  # LMCache's usage: the old size out, the new one in (below)
            self._tell("deleted", self._notify_keys_deleted, [k for k, _ in resized], [b for _, b in resized])
        if new_keys:
            self._tell("stored", self._notify_keys_stored, new_keys, new_sizes)
        return all_ok, nbytes

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done_stores = self._done_stores, {}
        return done

    # --------------------------------------------------------- lookup and lock
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        tid = self._new_id()
        names = self._names(keys)
        self._note_chains(keys, names)
        hits = None if self._closed else self._lookup_now(names)
        if hits is not None:  # answered from the books on this thread: no hop to the loop
            self._lookup_done(tid, hits, at_submit=True)
            return tid
        self._start(self._finish_lookup(tid, names), lambda: self._complete_lookup(tid, Bitmap(len(keys))))
        return tid

    def _note_chains(self, keys: list[ObjectKey], names: list[str | None]) -> None:
        """A lookup lists a prompt's chunks in order (per object group): remember parents."""
        run: list[str] = []
        prev: ObjectKey | None = None
        for key, name in zip(keys, names):
            same = prev is not None and (
                key.model_name,
                key.kv_rank,
                key.object_group_id,
                key.cache_salt,
            ) == (prev.model_name, prev.kv_rank, prev.object_group_id, prev.cache_salt)
            if name is None or not same:
                if len(run) > 1:
                    self.runtime.note_chain(run)
                run = []
            if name is not None:
                run.append(name)
            prev = key
        if len(run) > 1:
            self.runtime.note_chain(run)

    def _lookup_now(self, names: list[str | None]) -> list[bool] | None:
        """The lookup answered and its hits pinned on the caller's thread from the
        store's books (`TieredStore.lookup_now`: of the names the books do not hold, a
        `stat` each on a disk tier, one round trip of `TYPE`s on a Redis tier); None when
        the loop must answer (`_lookup`)."""
        asked = [n for n in names if n is not None]
        try:
            found = self.runtime.store.lookup_now(asked, ttl=self.config.lock_ttl_s)
        except Exception as exc:  # a fault here must not fail the lookup: the loop asks
            self._fast_path_fault("a lookup on the server's thread", exc)
            return None
        if found is None:
            return None
        return self._lock_hits(names, iter(found))

    async def _lookup(self, names: list[str | None]) -> list[bool]:
        asked = [n for n in names if n is not None]
        found = await self.runtime.store.contains_many(asked)
        return self._lock_hits(names, iter(found))

    def _lock_hits(self, names: list[str | None], found: Iterator[bool]) -> list[bool]:
        """Per name, found or not (`found` answers the names that are not None); one
        lookup lock taken per name found, and its pin (re)set with the count, under the
        lock `submit_unlock` unpins under, so a count never stands without its pin."""
        hits = [n is not None and next(found) for n in names]
        held = [n for n, h in zip(names, hits) if h and n is not None]
        if held:
            now = time.monotonic()
            until = now + self.config.lock_ttl_s
            with self._lock:
                locks = self._locks
                for n in held:
                    count, lapses = locks.get(n, (0, 0.0))
                    locks[n] = ((count if lapses > now else 0) + 1, until)
                self.runtime.store.pin(held, ttl=self.config.lock_ttl_s)
                if len(locks) > LOCKS_PRUNE_AT:
                    self._locks = {k: v for k, v in locks.items() if v[1] > now}
        return hits

    async def _finish_lookup(self, tid: L2TaskId, names: list[str | None]) -> None:
        n = len(names)
        hits = await self._bounded(self._lookup(names), self.config.store.timeout_s, f"lookup of {n} chunk(s)")
        self._lookup_done(tid, hits if hits is not None else [False] * n)

    def _lookup_done(self, tid: L2TaskId, hits: list[bool], *, at_submit: bool = False) -> None:
        """Count the lookup and hand its bitmap to LMCache (from the loop or the caller's thread)."""
        n = len(hits)
        bitmap = Bitmap(n)
        for i, hit in enumerate(hits):
            if hit:
                bitmap.set(i)
        with self._lock:  # both threads count
            self.counters.lookup_tasks_at_submit += at_submit
            self.counters.lookups += n
            self.counters.lookup_hits += bitmap.popcount()
            self.runtime.saw_lookups(n)
        self._complete_lookup(tid, bitmap)

    def _complete_lookup(self, tid: L2TaskId, bitmap: Bitmap) -> None:
        self._publish(self._done_lookups, tid, bitmap, self._lookup_efd)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Release one lookup lock per key; the last release unpins (never fails)."""
        free: list[str] = []
        now = time.monotonic()
        named = self._names(keys)
        with self._lock:
            locks = self._locks
            for name in named:
                entry = locks.get(name) if name is not None else None
                if entry is None or name is None:
                    continue
                count, lapses = entry
                if lapses <= now:  # lapsed with its pin (a lookup never unlocked)
                    del locks[name]
                elif count <= 1:
                    del locks[name]
                    free.append(name)
                else:
                    locks[name] = (count - 1, lapses)
            if free and not self._closed:  # pins may change on any thread: no wake-up of the loop
                self.runtime.store.unpin(free)

    # ---------------------------------------------------------------------- load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._new_id()
        names = self._names(keys)
        if not self._closed and self._load_now(tid, names, objects, keys):
            return tid
        self._load_on_loop(tid, names, objects, keys, self.config.store.timeout_s)
        return tid

    def _load_on_loop(
        self, tid: L2TaskId, names: list[str | None], objects: list[MemoryObj], keys: list[ObjectKey], timeout: float
    ) -> None:
        """The load read on the store's loop, bounded by `timeout`."""
        self._start(
            self._finish_load(tid, names, objects, keys, timeout), lambda: self._complete_load(tid, Bitmap(len(keys)))
        )

    def _load_now(self, tid: L2TaskId, names: list[str | None], objects: list[MemoryObj], keys: list[ObjectKey]) -> bool:
        """The load read on worker threads started from this thread, and completed from
        the last of them (`TieredStore.read_now`: every chunk on one disk tier, the
        common case), without the hops to the store's loop and back; False when the loop
        must read it.  A batch that is not all clean hits goes to the loop once nothing
        writes into the MemoryObjs any more, and is read there as any other."""
        known = [n for n in names if n is not None]
        if len(known) != len(names):
            return False
        try:
            outs = [byte_target(obj) or payload_of(obj)[0] for obj in objects]
        except Exception as exc:  # the loop's read says what is wrong with it
            self._fast_path_fault("a load's memory objects", exc)
            return False

        started = time.monotonic()

        def done(sizes: list[int] | None) -> None:
            try:
                if sizes is None:  # the loop reads it, within what is left of the task's deadline
                    with self._lock:
                        self.counters.loads_handed_back += 1
                    left = self.config.store.timeout_s - (time.monotonic() - started)
                    self._load_on_loop(tid, names, objects, keys, max(0.0, left))
                else:
                    self._loaded(tid, keys, [True] * len(keys), off_loop=True)
            except Exception:  # LMCache must never wait on a task that will not end
                self.counters.errors += 1
                log.exception("kvstore L2: completing a load read off the loop failed; completed as failed")
                self._complete_load(tid, Bitmap(len(keys)))

        try:
            return self.runtime.store.read_now(known, outs, done, self.runtime.loop)
        except Exception as exc:  # a fault here must not fail the load: the loop reads it
            self._fast_path_fault("a load off the loop", exc)
            return False

    def _fast_path_fault(self, what: str, exc: Exception) -> None:
        """Counted, and the first one said out loud: served by the loop all the same,
        but each costs the hops the fast path saves, so a fault that persists must show."""
        with self._lock:
            self.counters.fast_path_faults += 1
            first = self.counters.fast_path_faults == 1
        (log.warning if first else log.debug)(
            "kvstore L2: %s failed (%r); served on the store's loop instead (slower). Later such "
            "faults are logged at debug level and counted in report_status()['counters']['fast_path_faults']",
            what,
            exc,
        )

    async def _load(self, names: list[str | None], objects: list[MemoryObj]) -> list[bool]:
        known = {i: n for i, n in enumerate(names) if n is not None}
        idx = list(known)
        outs = [payload_of(objects[i])[0] for i in idx]
        got = await self.runtime.store.get_many(list(known.values()), out=outs)
        hits = [False] * len(names)
        for i, t in zip(idx, got):
            hits[i] = t is not None
        return hits

    async def _finish_load(
        self, tid: L2TaskId, names: list[str | None], objects: list[MemoryObj], keys: list[ObjectKey], timeout: float
    ) -> None:
        # a cancelled read returns only once nothing writes into the MemoryObjs any more
        hits = await self._bounded(self._load(names, objects), timeout, f"load of {len(keys)} chunk(s)")
        self._loaded(tid, keys, hits or [False] * len(keys))

    def _loaded(self, tid: L2TaskId, keys: list[ObjectKey], hits: list[bool], *, off_loop: bool = False) -> None:
        """Count the load and hand its bitmap to LMCache (from the loop, or from the
        worker thread that finished a load off the loop)."""
        bitmap = Bitmap(len(keys))
        for i, hit in enumerate(hits):
            if hit:
                bitmap.set(i)
        with self._lock:  # both threads count
            self.counters.loads += len(keys)
            self.counters.load_hits += bitmap.popcount()
            self.counters.loads_off_loop += off_loop
        accessed = [k for i, k in enumerate(keys) if bitmap.test(i)]
        if accessed:
            self._tell("accessed", self._notify_keys_accessed, accessed)
        self._complete_load(tid, bitmap)

    def _complete_load(self, tid: L2TaskId, bitmap: Bitmap) -> None:
        self._publish(self._done_loads, tid, bitmap, self._load_efd)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_loads.pop(task_id, None)

    # ------------------------------------------------------- delete, list, usage
    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete from every tier (LMCache's L2 eviction and admin tools call this)."""
        pairs = [(k, n) for k, n in zip(keys, self._names(keys)) if n is not None]
        if not pairs or self._closed:
            return
        names = [n for _, n in pairs]
        done: list[bool] | None = self.runtime.call(self.runtime.store.delete_many(names), None, "delete")
        if done is not None:  # (gone, or not held: either way not there now)
            self._gone(names)  # a delete that failed or timed out leaves them counted, for a later one

    def _gone(self, names: list[str]) -> None:
        """Names that left every tier (deleted, or evicted by kvstore's own policy)."""
        keys: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            if self._unnamed:  # gone before a request named them: never counted
                for name in names:
                    waiting = self._unnamed.get(_prefix(name))
                    if waiting is not None:
                        waiting.pop(name, None)
            for name in names:
                size = self._sizes.pop(name, None)
                key = self._keys.pop(name, None)
                if size is not None and key is not None:
                    keys.append(key)
                    sizes.append(size)
        if keys:
            self._tell("deleted", self._notify_keys_deleted, keys, sizes)

    def _note_named(self, keys: Sequence[ObjectKey], names: Sequence[str | None]) -> None:
        """Keys naming a prefix that earlier runs' objects under a shortened name share
        (model, rank, group and salt): those objects are counted, off this thread (a
        lookup's), by `_adopt_named`.  Membership tests only, no lock."""
        unnamed = self._unnamed
        found: dict[str, ObjectKey] = {}
        last = ""
        for key, name in zip(keys, names):
            if name is None or (last and name.startswith(last)):
                continue
            last = _prefix(name)
            if last in unnamed and last not in found:
                found[last] = key
        if found:
            try:
                self.runtime.submit(asyncio.to_thread(self._adopt_named, found), "background")
            except RuntimeError:  # closed: nothing to count any more
                pass

    def _adopt_named(self, found: dict[str, ObjectKey]) -> None:
        """The objects waiting under each prefix of `found`, counted as the listing at
        start counts the others: each one's key is the prefix's key with the object's
        own chunk hash (checked by naming it again).  Keys are made from a copy; the
        count is taken in one step with the prefix's removal, of the objects still
        waiting then (one gone meanwhile, `_gone` took out)."""
        adopted: list[ObjectKey] = []
        sizes: list[int] = []
        for prefix, key in found.items():
            with self._lock:
                waiting = dict(self._unnamed.get(prefix, {}))
            if not waiting:
                continue
            template = mp_chunk_key(key, self._ns)
            named: dict[str, ObjectKey] = {}
            for other in waiting:
                try:
                    okey = mp_object_key(replace(template, chunk_hash=chunk_hash_of(other)))
                except (InvalidKeyError, ValueError):
                    continue
                if okey is not None and mp_object_name(okey, self._ns) == other:
                    named[other] = okey  # (else not this key's kind after all: never counted)
            with self._lock:
                now = self._unnamed.pop(prefix, {})
                for other, okey in named.items():
                    size = now.get(other)
                    if size is None or other in self._sizes or other in self._storing:
                        continue  # gone meanwhile, or counted by its store
                    self._sizes[other] = size
                    self._keys[other] = okey
                    adopted.append(okey)
                    sizes.append(size)
                later = {n: b for n, b in now.items() if n not in waiting}  # listed since the copy
                if later:
                    self._unnamed[prefix] = later
        if adopted:
            self._tell("stored", self._notify_keys_stored, adopted, sizes)
            log.info("kvstore L2: counted %d objects from earlier runs under a shortened name", len(adopted))

    async def _adopt_existing(self) -> None:
        """Count what earlier runs left in the tiers (every tier: with ``write=back`` no
        single tier holds everything), so usage, listing and LMCache's L2 eviction see it.
        Runs in the background after start; sizes are stored (frame) bytes."""
        keys: list[ObjectKey] = []
        sizes: list[int] = []
        unnamed = 0
        for tier in self.runtime.store.tiers:
            try:
                async for info in tier.backend.list(namespace_prefix(self._ns)):
                    try:
                        key = mp_object_key(ChunkKey.from_object_name(info.name))
                    except InvalidKeyError:
                        key = None
                        prefix = _prefix(info.name)
                        if "~" in prefix:  # a component shortened: named by the first request for it
                            with self._lock:
                                if info.name not in self._sizes:
                                    self._unnamed.setdefault(prefix, {})[info.name] = info.size
                                    unnamed += 1
                    if key is None:
                        continue
                    with self._lock:
                        if info.name in self._sizes or info.name in self._storing:  # its store counts it
                            continue  # (a failed one leaves an earlier run's copy to be counted when read)
                        self._sizes[info.name] = info.size
                        self._keys[info.name] = key
                    keys.append(key)
                    sizes.append(info.size)
            except Exception as exc:
                log.warning("kvstore L2: listing %s at start failed (%s); its objects count once read", tier.name, exc)
        if keys:
            self._tell("stored", self._notify_keys_stored, keys, sizes)
            log.info("kvstore L2: found %d objects (%d bytes) from earlier runs", len(keys), sum(sizes))
        if unnamed:
            log.info(
                "kvstore L2: %d objects from earlier runs have shortened names (a model name or cache "
                "salt of over 64 characters escaped); they are counted once a request names their model",
                unnamed,
            )

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        from lmcache.v1.distributed.api import KeyEntry, KeyListPage

        if page_size <= 0:
            raise ValueError("page_size must be positive")
        with self._lock:
            rows = sorted(
                (n, k, self._sizes[n])
                for n, k in self._keys.items()
                if model_name is None or k.model_name == model_name
            )
        start = 0
        if cursor is not None:
            import bisect

            start = bisect.bisect_right([r[0] for r in rows], cursor)
        page = rows[start : start + page_size]
        entries = tuple(KeyEntry(key=k.to_encoded_object_key(), size_bytes=s) for _, k, s in page)
        more = start + page_size < len(rows)
        return KeyListPage(entries=entries, next_page_token=page[-1][0] if more and page else None)

    @property
    def tags(self) -> StoreTags:
        """Where this store's bytes live (``get_memory_tags`` in LMCache's terms); LMCache
        0.5.7 sets ``_shared`` (its spec's ``"shared": true``) after construction."""
        return self._tags[bool(getattr(self, "_shared", False))]

    def get_memory_tags(self) -> Any:
        """LMCache's ``MemoryTags`` of this store (LMCache 0.5.7+ asks, per prefetch
        request; see `kvstore_lmcache.memory_tags`)."""
        shared = bool(getattr(self, "_shared", False))
        made = self._lmcache_tags.get(shared)
        if made is None:
            made = self._lmcache_tags[shared] = self._tags[shared].to_lmcache()
        return made

    def _locked(self) -> int:
        """Names held by lookup locks that have not lapsed."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for _, lapses in self._locks.values() if lapses > now)

    def report_status(self) -> dict:
        from dataclasses import asdict

        store = self.runtime.store
        return {
            "is_healthy": not self._closed and all(store.tier_available(j) for j in range(len(store.tiers))),
            "type": "KVStoreL2Adapter",
            "breakers": [b.state.value for b in store.breakers],
            "config": self.config.store.describe(),
            "counters": asdict(self.counters),
            "locked": self._locked(),
            "memory_tags": {"segment": self.tags.segment, "residency": self.tags.residency},
            "tiers": [
                {"name": t.name, "hits": t.hits, "bytes_read": t.bytes_read, "objects": t.objects}
                for t in store.stats().tiers
            ],
        }

    def stats(self) -> dict[str, Any]:
        return {"adapter": self.report_status(), **self.runtime.stats()}

    # --------------------------------------------------------------------- close
    def close(self) -> None:
        """Take no more tasks, end the ones under way (`StoreRuntime.close`: stores
        finish, lookups and loads complete as misses), then close the event fds.  A
        second caller returns once the first's close is done."""
        self._closed = True
        self.runtime.close()
        with self._lock:  # a task refused or ending now must not notify a closed fd
            if self._efds_closed:
                return
            self._efds_closed = True
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()


def store_capacity(cfg: StoreConfig) -> int:
    """What LMCache's L2 eviction may take as this adapter's capacity: the largest tier
    budget when every tier has one (the store can hold no more distinct chunks than
    that), else 0 (some tier is unbounded: LMCache's global eviction stays off)."""
    budgets = [t.options.capacity for t in cfg.tiers]
    sized = [b for b in budgets if b]
    return max(sized) if sized and len(sized) == len(budgets) else 0


__all__ = ["KVStoreL2Adapter", "KVStoreL2AdapterConfig", "store_capacity"]
