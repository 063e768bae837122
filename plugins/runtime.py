"""The kvstore side of a plugin: its own event loop thread, the store, deadlines, counters.

Owns: one background asyncio loop per plugin instance, the store opened on it, the
rule that every wait has a deadline (a timeout or a fault is a counted miss, never an
exception to LMCache), and the in-flight write table (dedupe, byte budget, release of
LMCache's references when a write ends).  Must not touch: LMCache's own loop or
threads (callers on LMCache's loop await through `acall`), storage logic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, TypeVar, cast

from kvstore.keys import namespace_prefix
from kvstore.metrics_export import export_store, forget_store
from kvstore.store_config import StoreConfig, StoreConfigError
from kvstore_lmcache.reuse_watch import ReuseWatch

log = logging.getLogger("kvstore.plugins")
T = TypeVar("T")
MAX_PARENTS = 1 << 16  # prompts' chunk parents remembered between a lookup and its store
STOP_GRACE_S = 5.0  # how long a closing runtime lets its cancelled tasks end
# What a coroutine handed to `StoreRuntime.submit` is, for `close`: a read (a lookup,
# a load: cancelled at once, it completes as a miss), a write (waited for, up to the
# write deadline: its bytes are worth keeping) or background work (a listing at start:
# cancelled).  All of them end before the tiers close.
Role = Literal["read", "write", "background"]


@dataclass
class PluginCounters:
    put_submitted: int = 0
    put_deduped: int = 0
    put_dropped_budget: int = 0
    put_ok: int = 0
    put_failed: int = 0
    get_hits: int = 0
    get_misses: int = 0
    timeouts: int = 0
    errors: int = 0
    alloc_failed: int = 0
    reads_off_loop: int = 0  # read batches answered off the store's loop (`TieredStore.read_now`)


def load_config(
    extra_config: Mapping[str, Any] | None, blocking_timeout_s: float | None, who: str
) -> StoreConfig:
    """Read and validate kvstore's settings; on error log at ERROR with the fix and raise.

    LMCache catches a plugin constructor's exception and only logs it, so the log line
    here is what an operator sees: it names the setting and what to write instead.
    """
    try:
        cfg = StoreConfig.from_mapping(extra_config or {})
        user_set = "kvstore.timeout_s" in (extra_config or {}) or "KVSTORE_TIMEOUT_S" in os.environ
        if blocking_timeout_s is not None and not user_set:
            # default: answer comfortably before LMCache's own deadline
            cfg = replace(cfg, timeout_s=min(cfg.timeout_s, 0.8 * blocking_timeout_s))
        cfg.validate(blocking_timeout_s=blocking_timeout_s)
        return cfg
    except StoreConfigError as exc:
        log.error("kvstore %s is NOT loaded, LMCache will run without it: %s", who, exc)
        raise


class _Handoff:
    """A result passing from the store's loop to a caller that may stop waiting for it
    (its deadline): whichever comes second, the result or the caller giving up, decides,
    under a lock.  A result the caller gave up on is handed to `release` (a read's
    MemoryObjs go back to LMCache's allocator); one that came first is the caller's."""

    def __init__(self, release: Callable[[Any], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._abandoned = False
        self._delivered = False
        self.result: Any = None

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        result = await coro
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                self._delivered, self.result = True, result
        if abandoned:
            self._release(result)
        return result

    def abandon(self) -> bool:
        """The caller stops waiting; True when the result had come already (`result`)."""
        with self._lock:
            self._abandoned = not self._delivered
            return self._delivered

    def give_back(self) -> None:
        """Release a result that came but that the caller will not use."""
        self._release(self.result)


class StoreRuntime:
    """A store living on its own loop thread, callable from any thread with deadlines."""

    def __init__(self, cfg: StoreConfig, *, name: str = "kvstore") -> None:
        self.cfg = cfg
        self.counters = PluginCounters()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._stopping = False  # set (under `_lock`) once the loop is told to stop
        # the role of each coroutine handed to `submit` and not yet ended (`close` finds their tasks)
        self._roles: dict[object, Role] = {}
        self._cancelled: set[object] = set()  # coroutines `close` cancelled (not their callers)
        self._close_done = threading.Event()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self.pending_bytes = 0
        self._closed = False
        self._parents: OrderedDict[str, str] = OrderedDict()
        try:
            self.store = self._submit_own(self._open()).result(timeout=60)
        except Exception as exc:
            self._stop()
            log.error("kvstore could not open its tiers %s: %s", cfg.describe()["tiers"], exc)
            raise
        self.metrics_label = export_store(self.store, name=name, plugin=self)  # docs/operations.md
        self.reuse = ReuseWatch(namespace=cfg.namespace)
        self.submit(self._count_existing(), "background")

    async def _settle(self, write_wait_s: float) -> None:
        """Close's first step, on the loop: end the work handed to `submit` before the
        tiers close under it.  Reads and background work are cancelled (a read then
        completes as a miss), writes get up to `write_wait_s` to finish, then are
        cancelled too; all get `STOP_GRACE_S` to unwind."""
        with self._lock:
            roles = dict(self._roles)
        tasks = [t for t in asyncio.all_tasks() if t.get_coro() in roles]
        writes = [t for t in tasks if roles[t.get_coro()] == "write"]
        for task in tasks:
            if task not in writes:
                self._cancel(task)
        if writes:
            _, late = await asyncio.wait(writes, timeout=write_wait_s)
            for task in late:
                log.warning("kvstore: a write was still running %.0fs into close; cancelled", write_wait_s)
                self._cancel(task)
        ending = [t for t in tasks if not t.done()]
        if ending:
            _, stuck = await asyncio.wait(ending, timeout=STOP_GRACE_S)
            if stuck:
                log.warning(
                    "kvstore: %d task(s) did not end within %.0fs of being cancelled at close "
                    "(a tier call that cannot be interrupted, e.g. a read stuck in the kernel); "
                    "the tiers close under them",
                    len(stuck),
                    STOP_GRACE_S,
                )

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._cancelled.add(task.get_coro())
        task.cancel()

    async def _cancel_rest(self) -> None:
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            self._cancel(t)
        if rest:
            await asyncio.wait(rest, timeout=STOP_GRACE_S)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        if asyncio.all_tasks(self.loop):  # a task that ignored its cancellation may still need it
            return
        try:  # give back the loop's selector and self-pipe; its worker threads end when idle
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()  # shuts the executor down without waiting on a stuck worker

    async def _open(self):
        store = self.cfg.build()
        await store.warm_up()
        return store

    # ------------------------------------------------------------- calling in
    def submit(self, coro: Coroutine[Any, Any, T], role: Role = "read") -> concurrent.futures.Future[T]:
        """Run `coro` on the store's loop (`role`: what `close` does with it if it is
        still running then, see `Role`).  Once `close` began, `coro` is closed unrun and
        `RuntimeError` raised."""
        with self._lock:  # `close` sets the flag under it: nothing slips in after
            if not self._closed:
                self._roles[coro] = role
                fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            else:
                fut = None
        if fut is None:
            coro.close()
            raise RuntimeError("kvstore's store is closed: it takes no more work")
        fut.add_done_callback(lambda _: self._ended(coro))  # outside the lock: may run here
        return fut

    def _ended(self, coro: Coroutine[Any, Any, Any]) -> None:
        with self._lock:
            self._roles.pop(coro, None)

    def _submit_own(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """The runtime's own steps (open, close): run until the loop stops."""
        with self._lock:  # `_stop` sets the flag under it: nothing slips in after the stop
            if not self._stopping:
                return asyncio.run_coroutine_threadsafe(coro, self.loop)
        coro.close()
        raise RuntimeError("kvstore's store is closed: its loop no longer runs")

    def _bounded(
        self, coro: Coroutine[Any, Any, T], release: Callable[[T], None] | None, timeout: float | None
    ) -> tuple[float, _Handoff | None, Coroutine[Any, Any, T]]:
        """The deadline to wait (default ``timeout_s``) and, with `release`, the handoff
        the coroutine then runs through (`call`)."""
        handoff = _Handoff(release) if release is not None else None
        wait = self.cfg.timeout_s if timeout is None else max(0.0, timeout)
        return wait, handoff, handoff.run(coro) if handoff is not None else coro

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        default: T,
        what: str,
        *,
        release: Callable[[T], None] | None = None,
        timeout: float | None = None,
    ) -> T:
        """Run on the store's loop and wait at most `timeout` (default ``timeout_s``);
        faults become `default`.  With `release`: a result that comes after the caller
        stopped waiting is given to it (a read's MemoryObjs go back), and one that came
        just as the deadline fired is served after all."""
        timeout, handoff, coro = self._bounded(coro, release, timeout)
        try:
            fut = self.submit(coro)
        except RuntimeError as exc:  # closed
            self.counters.errors += 1
            log.warning("kvstore: %s failed (%s); served as a miss", what, exc)
            return default
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if handoff is not None and handoff.abandon():
                return cast(T, handoff.result)  # it finished as the deadline fired
            fut.cancel()
            self.counters.timeouts += 1
            log.warning("kvstore: %s took longer than %.1fs; served as a miss", what, timeout)
        except Exception as exc:
            self.counters.errors += 1
            log.warning("kvstore: %s failed (%s); served as a miss", what, exc)
        return default

    async def acall(
        self,
        coro: Coroutine[Any, Any, T],
        default: T,
        what: str,
        *,
        release: Callable[[T], None] | None = None,
        timeout: float | None = None,
    ) -> T:
        """`call` for a caller running on another event loop (LMCache's)."""
        timeout, handoff, coro = self._bounded(coro, release, timeout)
        inner: concurrent.futures.Future[T] | None = None
        try:
            inner = self.submit(coro)
            waiting = asyncio.wrap_future(inner)
            try:
                done, _ = await asyncio.wait({waiting}, timeout=timeout)
            except asyncio.CancelledError:  # the caller's own cancellation: nobody takes the result
                if handoff is not None and handoff.abandon():
                    handoff.give_back()
                waiting.cancel()
                raise
            if not done:
                if handoff is not None and handoff.abandon():
                    return cast(T, handoff.result)  # it finished as the deadline fired
                waiting.cancel()
                raise asyncio.TimeoutError
            return waiting.result()
        except asyncio.CancelledError:
            # The store's task was cancelled (the runtime stopping), not the caller's: a
            # miss.  The caller's own cancellation (or a Python that cannot tell them
            # apart: `Task.cancelling` is 3.11+) goes on up.
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if inner is None or not inner.cancelled():
                raise
            if cancelling() if cancelling is not None else coro not in self._cancelled:  # 3.10
                raise
            self.counters.errors += 1
            log.warning("kvstore: %s was cancelled (the store is closing); served as a miss", what)
        except asyncio.TimeoutError:
            self.counters.timeouts += 1
            log.warning("kvstore: %s took longer than %.1fs; served as a miss", what, timeout)
        except Exception as exc:
            self.counters.errors += 1
            log.warning("kvstore: %s failed (%s); served as a miss", what, exc)
        return default

    # ------------------------------------------------- reuse across restarts
    async def _count_existing(self) -> None:
        """How many chunks earlier runs left in the tiers (up to what the watch needs)."""
        w = self.reuse
        try:
            for tier in self.store.tiers:
                async for _ in tier.backend.list(namespace_prefix(self.cfg.namespace)):
                    w.existing += 1
                    if w.existing >= w.min_existing:
                        return
        except Exception as exc:
            log.debug("kvstore: counting earlier chunks failed: %s", exc)
        finally:
            w.complete = True

    def saw_lookups(self, n: int) -> None:
        """`n` chunk names were looked up; warn once if a store of old chunks never serves one."""
        self.reuse.saw_lookups(n)
        if self.reuse.due():
            with self._lock:
                if not self._stopping:  # a stopped loop may be closed
                    self.loop.call_soon_threadsafe(self._check_reuse)

    def _check_reuse(self) -> None:
        st = self.store.stats()
        message = self.reuse.check(st.discovered + st.found)
        if message:
            log.warning(message)

    # ------------------------------------------------------------ prefix chains
    def note_lookup(self, names: list[str], hit: int, asked: int | None = None) -> None:
        """A lookup of `asked` chunks (default: all of `names`, the leading ones named)
        found `hit` of them: the store that follows starts at ``names[hit]``, whose
        parent is ``names[hit - 1]``."""
        self.saw_lookups(len(names) if asked is None else asked)
        if 0 < hit < len(names):
            self.note_chain(names[hit - 1 : hit + 1])

    def note_chain(self, names: list[str]) -> None:
        """`names` are consecutive chunks of one prompt: remember each one's parent."""
        with self._lock:
            for parent, name in itertools.pairwise(names):
                self._parents[name] = parent
                self._parents.move_to_end(name)
            while len(self._parents) > MAX_PARENTS:
                self._parents.popitem(last=False)

    def parent_of(self, name: str) -> str | None:
        """The chunk before `name` in the prompt a recent lookup saw, if known."""
        with self._lock:
            return self._parents.pop(name, None)

    # --------------------------------------------------------- background puts
    def start_put(
        self,
        items: list[tuple[str, Any, int]],
        make_coro: Callable[[list[int]], Coroutine[Any, Any, list[bool]]],
        release: Callable[[int], None],
    ) -> tuple[concurrent.futures.Future | None, list[int]]:
        """Start a write of ``items`` = (name, obj, nbytes) without waiting for it.

        Names already being written are skipped (LMCache does not dedupe repeated
        stores); a write that would take pending bytes past ``max_pending`` is dropped
        and counted, never waited for.  ``make_coro(indices)`` writes the chosen
        items; ``release(index)`` is called for each chosen item when its write ends.
        Returns the future of the write and the chosen indices.
        """
        chosen: list[int] = []
        with self._lock:
            closed = self._closed  # `close` sets it under this lock: a put after it is refused
            for i, (name, _obj, nbytes) in enumerate(items):
                if name in self._inflight:
                    self.counters.put_deduped += 1
                    continue
                budget = self.cfg.max_pending
                if budget is not None and self.pending_bytes + nbytes > budget:
                    self.counters.put_dropped_budget += 1
                    continue
                self.pending_bytes += nbytes
                chosen.append(i)
            if not chosen:
                return None, []
            fut: concurrent.futures.Future = concurrent.futures.Future()
            for i in chosen:
                self._inflight[items[i][0]] = fut
        self.counters.put_submitted += len(chosen)
        try:
            if closed:
                raise RuntimeError("kvstore's store is closed")
            inner = self.submit(self._guarded_put(make_coro, chosen), "write")
        except RuntimeError as exc:  # closed: nothing will write them; `done` releases them
            inner = concurrent.futures.Future()
            inner.set_exception(exc)

        def done(f: concurrent.futures.Future) -> None:
            try:
                oks = f.result()
            except BaseException as exc:  # cancelled or failed: nothing stored
                log.warning("kvstore: background write failed: %s", exc)
                oks = [False] * len(chosen)
            with self._lock:
                for i, ok in zip(chosen, oks):
                    self._inflight.pop(items[i][0], None)
                    self.pending_bytes -= items[i][2]
                    if ok:
                        self.counters.put_ok += 1
                    else:
                        self.counters.put_failed += 1
            for i in chosen:
                try:
                    release(i)
                except Exception:
                    log.exception("kvstore: releasing a stored MemoryObj failed")
            if not fut.done():
                fut.set_result(oks)

        inner.add_done_callback(done)
        return fut, chosen

    async def _guarded_put(self, make_coro, chosen: list[int]) -> list[bool]:
        try:
            return await asyncio.wait_for(make_coro(chosen), timeout=self.cfg.store_deadline_s())
        except Exception as exc:
            log.warning("kvstore: write of %d chunk(s) failed: %s", len(chosen), exc)
            return [False] * len(chosen)

    def inflight(self, name: str) -> concurrent.futures.Future | None:
        with self._lock:
            return self._inflight.get(name)

    def wait_writes(self, timeout: float | None = None) -> bool:
        """Block until the writes started so far have ended (tests, benchmarks, shutdown)."""
        with self._lock:
            futs = set(self._inflight.values())
        _, pending = concurrent.futures.wait(futs, timeout=timeout)
        return not pending

    # ------------------------------------------------------------------ close
    def stats(self) -> dict[str, Any]:
        st = self.store.stats()
        return {
            "plugin": asdict(self.counters),
            "store": asdict(st) if hasattr(st, "__dataclass_fields__") else st,
        }

    @property
    def closed(self) -> bool:
        """`close` began: no more work is taken."""
        return self._closed

    def close(self) -> None:
        """Refuse new work; wait for the writes under way (up to the write deadline);
        cancel the reads and background work still running and let them end; then close
        the tiers and stop the loop.  A second caller waits for the first's close; on
        the loop's own thread (a callback), the close runs on a thread of its own."""
        if threading.current_thread() is self._thread:
            threading.Thread(target=self.close, name="kvstore-close", daemon=True).start()
            return
        with self._lock:
            first = not self._closed
            self._closed = True
        if not first:
            self._close_done.wait()
            return
        try:
            self._close()
        finally:
            self._close_done.set()

    def _close(self) -> None:
        write_wait_s = self.cfg.store_deadline_s()
        try:  # the writes (this process's puts included) finish, the rest is cancelled
            self._submit_own(self._settle(write_wait_s)).result(timeout=write_wait_s + STOP_GRACE_S + 5)
        except Exception as exc:
            log.warning("kvstore: ending the store's last tasks failed: %s", exc)
        forget_store(self.store)
        try:
            self._submit_own(self.store.close()).result(timeout=30)
        except Exception as exc:
            log.warning("kvstore: closing the store failed: %s", exc)
        self._stop()

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True  # from here `_submit_own` refuses too
        # Tasks still running (a read stuck on a slow tier) or not yet started are
        # cancelled and given a moment to end, so whoever waits on one hears it failed.
        try:
            asyncio.run_coroutine_threadsafe(self._cancel_rest(), self.loop).result(timeout=STOP_GRACE_S + 5)
        except Exception as exc:
            log.warning("kvstore: cancelling the store's last tasks failed: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


__all__ = ["PluginCounters", "StoreConfigError", "StoreRuntime", "load_config"]
