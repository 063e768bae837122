"""What both in-process LMCache plugins do with chunks, written once.

Owns: `InProcessBridge`: object names from LMCache's keys, prefix lookups that remember
where a prompt's stored prefix ends (so the store that follows knows its parent),
background writes that hold their own reference to each MemoryObj until the write ends,
and reads into MemoryObjs from LMCache's allocator.  The storage plugin and the remote
connector only translate their interface's calls into these.  Must not touch: the
runtime's loop and deadlines (`kvstore_lmcache.runtime`), storage logic (the store).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from kvstore_lmcache.chunk_io import Allocations, read_chunks, write_chunks
from kvstore_lmcache.keymap import object_names
from kvstore_lmcache.runtime import StoreRuntime

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvstore.plugins")


class InProcessBridge:
    """One plugin's view of the store.

    ``count_inflight``: chunks this process is still writing count as held by a lookup
    (the storage plugin, whose reads wait for those writes); the remote connector's
    reads do not wait, so for it they do not count.
    """

    def __init__(self, runtime: StoreRuntime, allocator: Any, *, count_inflight: bool) -> None:
        self.runtime = runtime
        self.allocator = allocator
        self.count_inflight = count_inflight
        self.namespace = runtime.cfg.namespace
        close_store_first(allocator, runtime)

    def names(self, keys: Sequence[CacheEngineKey]) -> list[str]:
        return object_names(keys, self.namespace)

    # ----------------------------------------------------------------- lookups
    def _inflight_prefix(self, names: list[str]) -> int:
        n = 0
        if self.count_inflight:
            while n < len(names) and self.runtime.inflight(names[n]) is not None:
                n += 1  # being written by this process: visible to its own readers
        return n

    def _known_prefix(self, names: list[str]) -> int | None:
        """The store's answer from its books, on the caller's thread (no hop to the
        store's loop); None when the tiers must be asked."""
        try:
            return self.runtime.store.known_prefix(names)
        except Exception:  # a fault here must not fail LMCache's lookup: ask on the loop
            return None

    def _lookup_now(self, keys: Sequence[CacheEngineKey]) -> tuple[list[str], int, int | None]:
        """(names, n, known): the first `n` names are being written here, `known` more
        are held by the store's books (None: ask the store's loop about ``names[n:]``).
        A prompt whose first chunk is a miss (most new requests) has only that chunk
        named: `names` is then ``[first]``."""
        names = self.names(keys[:1])
        if not names:
            return names, 0, 0
        if self._inflight_prefix(names):  # being written here: count those, then ask
            names += self.names(keys[1:])
            n = self._inflight_prefix(names)
            return names, n, (self._known_prefix(names[n:]) if n < len(names) else 0)
        first = self._known_prefix(names)
        if first == 0:
            return names, 0, 0
        names += self.names(keys[1:])
        if first is None:  # the books cannot tell (a tier has it unknown to them): the loop asks
            return names, 0, None
        rest = self._known_prefix(names[1:]) if len(names) > 1 else 0  # the first is held
        return names, 0, None if rest is None else 1 + rest

    def lookup(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """How many leading chunks are held (blocking, within the deadline); none once the
        store is closing (its reads would miss).  With `pin` (LMCache's scheduler looks
        up before it retrieves), those chunks are kept from eviction until LMCache unpins
        them (or the store's pin TTL lapses)."""
        if self.runtime.closed:
            return 0
        names, n, known = self._lookup_now(keys)
        n += known if known is not None else self.runtime.call(self.runtime.store.prefix_lookup(names[n:]), 0, "lookup")
        self._found(names, n, len(keys), pin)
        return n

    async def alookup(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """`lookup` for a caller on LMCache's event loop."""
        if self.runtime.closed:
            return 0
        names, n, known = self._lookup_now(keys)
        n += known if known is not None else await self.runtime.acall(self.runtime.store.prefix_lookup(names[n:]), 0, "lookup")
        self._found(names, n, len(keys), pin)
        return n

    def _found(self, names: list[str], n: int, asked: int, pin: bool) -> None:
        if pin and n:
            self.runtime.store.pin(names[:n])  # (pins may be taken on any thread)
        self.runtime.note_lookup(names, n, asked)

    # ------------------------------------------------------------------ writes
    def write(
        self,
        keys: Sequence[CacheEngineKey],
        objs: Sequence[MemoryObj],
        on_done: Callable[[int], None] | None = None,
    ) -> concurrent.futures.Future | None:
        """Start writing consecutive chunks of one prompt without waiting for it.

        A reference to each MemoryObj is taken before the write can start and given back
        when its write ends (or at once, for chunks not written: already being written,
        or over ``max_pending``); `on_done(i)` follows each write's release.  Returns the
        write's future, None when nothing was started.
        """
        names = self.names(keys)
        items = [(n, o, o.get_size()) for n, o in zip(names, objs)]
        for o in objs:
            o.ref_count_up()
        first_parent = self.runtime.parent_of(names[0]) if names else None

        def make_coro(chosen: list[int]) -> Coroutine[Any, Any, list[bool]]:
            parent = names[chosen[0] - 1] if chosen[0] else first_parent
            return write_chunks(
                self.runtime.store, [names[i] for i in chosen], [objs[i] for i in chosen], parent=parent
            )

        def release(i: int) -> None:
            objs[i].ref_count_down()
            if on_done is not None:
                on_done(i)

        fut, chosen = self.runtime.start_put(items, make_coro, release)
        for i in set(range(len(objs))) - set(chosen):
            objs[i].ref_count_down()
        return fut

    def wait_written(self, names: Sequence[str], timeout: float) -> None:
        """Block until this process's writes of `names` have ended (at most `timeout`)."""
        pending = {f for f in (self.runtime.inflight(n) for n in names) if f is not None}
        if pending:
            concurrent.futures.wait(pending, timeout=timeout)

    # ------------------------------------------------------------------- reads
    def read(
        self, names: Sequence[str], *, prefix_only: bool = False
    ) -> Coroutine[Any, Any, list[MemoryObj | None]]:
        """The read coroutine (run it through the runtime's deadline): MemoryObjs with ref
        count 1 owned by the caller, None for misses (or only the hit prefix)."""
        return read_chunks(
            self.runtime.store, names, self.allocator, self.runtime.counters, prefix_only=prefix_only
        )

    def read_now(self, names: Sequence[str], timeout: float) -> list[MemoryObj | None] | None:
        """The chunks read off the store's loop while this thread waits
        (`TieredStore.read_now`: every chunk placed on one disk tier, the common case),
        as `read` would return them; None when they must be read the regular way
        (`read`): not started, or not all clean hits (nothing the attempt allocated is
        kept).  Past `timeout` every chunk is a miss, and what the read allocated goes
        back once nothing writes into it any more."""
        runtime = self.runtime
        if not names or runtime.closed or timeout <= 0:
            return None
        places = Allocations(len(names), self.allocator, runtime.counters)
        waiter = _Waiter(places)
        try:
            started = runtime.store.read_now(names, places.outs(described=True), waiter.done, runtime.loop)
        except Exception as exc:  # a fault here must not fail LMCache's read: the loop reads
            log.debug("kvstore: a read off the loop could not start (%s); reading on the loop", exc)
            return None
        if not started:
            return None
        clean = waiter.wait(timeout)
        c = runtime.counters
        if clean is None:  # (counted as the loop's read counts a timeout)
            c.timeouts += 1
            log.warning("kvstore: read of %d chunk(s) took longer than %.1fs; served as a miss", len(names), timeout)
            return [None] * len(names)
        if not clean:
            return None
        c.get_hits += len(names)
        c.reads_off_loop += 1
        return list(places.objs)

    def release_read(self, objs: Sequence[MemoryObj | None]) -> None:
        """Give back what a read returned after its caller stopped waiting (its deadline):
        each MemoryObj to LMCache's allocator, its hit counted as a miss."""
        c = self.runtime.counters
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()
                c.get_hits -= 1
                c.get_misses += 1


class _Waiter:
    """A read off the loop that a caller's thread waits for: the answer, or, once the
    caller gave up, the read's allocations given back when it ends."""

    def __init__(self, places: Allocations) -> None:
        self.places = places
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._clean = False
        self._gave_up = False

    def done(self, sizes: list[int] | None) -> None:
        """The read ended (on a worker thread): nothing writes into its objects now."""
        with self._lock:
            self._clean = sizes is not None
            if not self._clean or self._gave_up:
                self.places.release()
            self._ended.set()

    def wait(self, timeout: float) -> bool | None:
        """Whether all were clean hits; None when `timeout` passed first (the caller gave up)."""
        if not self._ended.wait(max(0.0, timeout)):
            with self._lock:
                if not self._ended.is_set():
                    self._gave_up = True
                    self.places.closed = True  # its objects not begun are not read: it ends sooner
                    return None
        return self._clean


def close_store_first(allocator: Any, runtime: StoreRuntime) -> None:
    """Have LMCache's CPU backend (`allocator`) close the store before it frees its memory.

    LMCache closes its backends in the order they were made, its CPU backend first: its
    allocator's memory went while writes this store had under way still read their
    MemoryObjs there (and reads wrote into them), which crashed the process at shutdown.
    Closed this way, the writes end (up to the store deadline) and the reads are
    cancelled first; the plugin's own close afterwards finds the store closed."""
    close = getattr(allocator, "close", None)
    if close is None:
        return
    stores = getattr(close, "_kvstore_runtimes", None)
    if stores is not None:  # another plugin of this engine wrapped it already
        stores.append(runtime)
        return
    stores = [runtime]

    def close_after_the_store() -> None:
        try:
            for store in stores:
                store.close()
        finally:
            close()

    close_after_the_store._kvstore_runtimes = stores  # type: ignore[attr-defined]
    try:
        allocator.close = close_after_the_store
    except (AttributeError, TypeError):  # an allocator that cannot take it: the order stays LMCache's
        pass


__all__ = ["InProcessBridge"]
