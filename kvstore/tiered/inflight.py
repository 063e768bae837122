"""What a TieredStore has under way, by object name: one ticket per operation.

Owns: the in-flight registry (`InFlight`) and its tickets.  An operation *prepares* a
ticket before it starts (synchronously, in the same step as the engine's decision, so
no other task sees a half-made plan) and *completes* it when it is over, with whether it
succeeded, as vLLM's ``kv_offload`` manager does with ``prepare_store`` /
``complete_store``.  From the live tickets follow the store's guarantees:

* a name being written is invisible (`writing`) until its write completes;
* a name being read, or pinned, or being written and landed nowhere yet, is protected:
  ``name in inflight`` is the engine's `protected` container, so no victim is chosen
  from it (a concurrent write does not push out another's chunks before they have
  landed; once one tier has them, a slow write-through copy does not hold them there);
* a name placed in a tier by a copy that has not landed is read where its bytes are
  (`source`); copies of one name run one at a time, in order, after the foreground
  write of that name has landed (`turn`);
* while a copy of a name is under way (`copying`) its drops wait and discovery leaves
  it alone; completing the name's last copy tells the caller to clean up;
* a name written anew makes the copies of it decided before `stale` (they carry the
  object before) and is read where the books place it.

Must not touch: tiers, the engine, metrics (this only records what is under way).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Container, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from kvstore.policy import Copy


@dataclass(eq=False)
class Ticket:
    """One operation under way: a read of `names`, a batch of writes, or one copy."""

    kind: Literal["read", "write", "copy"]
    names: list[str] = field(default_factory=list)  # read: the names; copy: its one name
    pending: Counter[str] = field(default_factory=Counter)  # write: writes not yet over, per name
    landed: asyncio.Event | None = None  # write: set when the batch's writes are over
    copy: Copy | None = None  # copy: the move being carried out
    generation: int = 0  # copy: its name's `InFlight.replaced` count when it was decided
    open: bool = True


class InFlight:
    """The store's in-flight registry; see the module docstring."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._writing: Counter[str] = Counter()
        self._unlanded: set[str] = set()  # being written, no write of it over yet
        self._reading: Counter[str] = Counter()
        self._pins: dict[str, float] = {}
        self._pin_lock = threading.Lock()
        self._landing: dict[tuple[str, int], int] = {}  # (name, tier) -> tier its bytes are still in
        self._landed: dict[str, asyncio.Event] = {}  # name -> its foreground write batch's event
        self._copies: Counter[str] = Counter()  # copies prepared and not completed, per name
        self._generation: Counter[str] = Counter()  # names with copies: how often replaced since
        self._locks: dict[str, asyncio.Lock] = {}
        # names being read -> tier -> how often placed there anew (a write or copy) since
        # (`placements`: a read's "gone" is about the object it began reading, not a newer one)
        self._placed: dict[str, Counter[int]] = {}

    # -- questions -----------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        """Protected from eviction: being read, being written and landed nowhere yet, or
        pinned (and the pin has not expired)."""
        if name in self._reading or name in self._unlanded:
            return True
        until = self._pins.get(name) if isinstance(name, str) else None
        return until is not None and until > self._clock()

    def writing(self, name: str) -> bool:
        return name in self._writing

    @property
    def writing_now(self) -> Container[str]:
        """The names being written (live, for membership tests only: `writing` unrolled)."""
        return self._writing

    def copying(self, name: str) -> bool:
        return name in self._copies

    def landing_write(self, name: str) -> bool:
        """A foreground write batch holding `name` has not finished."""
        return name in self._landed

    def placements(self, name: str, tier: int) -> int:
        """How often `name` was placed in `tier` anew while it has been read (a read's
        mark: the same count at its end means the object it read is the one placed)."""
        placed = self._placed.get(name)
        return placed[tier] if placed is not None else 0

    def placing(self, name: str, tier: int) -> None:
        """`name` is placed in `tier` anew (a write or a copy is decided)."""
        if name in self._reading:
            self._placed.setdefault(name, Counter())[tier] += 1

    def busy(self, name: str) -> bool:
        """A write or a copy of `name` is under way."""
        return name in self._writing or name in self._copies

    def source(self, name: str, tier: int) -> int:
        """The tier to read `name` from when the engine places it in `tier`."""
        return self._landing.get((name, tier), tier)

    # -- pins ----------------------------------------------------------------------------
    # Pins may also be taken on another thread (`TieredStore.lookup_now`): changes and
    # walks of the pin table hold `_pin_lock`; a membership test (`__contains__`) needs no
    # lock, a dict lookup being atomic.
    def pin(self, names: Iterable[str], until: float) -> None:
        with self._pin_lock:
            for name in names:
                self._pins[name] = until

    def unpin(self, names: Iterable[str]) -> None:
        with self._pin_lock:
            for name in names:
                self._pins.pop(name, None)

    def pinned(self, now: float) -> int:
        with self._pin_lock:
            return sum(1 for t in self._pins.values() if t > now)

    def prune_pins(self, now: float) -> None:
        if len(self._pins) > 1024:
            with self._pin_lock:
                self._pins = {n: t for n, t in self._pins.items() if t > now}

    # -- reads ---------------------------------------------------------------------------
    def prepare_read(self, names: Sequence[str]) -> Ticket:
        """`names` are about to be read: protect them until `complete`."""
        for name in names:
            self._reading[name] += 1
        return Ticket("read", list(names))

    # -- writes --------------------------------------------------------------------------
    def prepare_write(self) -> Ticket:
        """A batch of foreground writes; add each (name, tier) write with `add_write`."""
        return Ticket("write", landed=asyncio.Event())

    def add_write(self, ticket: Ticket, name: str) -> None:
        """One write of `name` (into one tier) joins the batch: `name` is invisible until
        `wrote` (or the ticket's `complete`)."""
        assert ticket.kind == "write" and ticket.landed is not None
        ticket.pending[name] += 1
        self._writing[name] += 1
        self._unlanded.add(name)
        self._landed[name] = ticket.landed

    def wrote(self, ticket: Ticket, name: str) -> None:
        """One write of `name` in `ticket` is over (landed or failed)."""
        ticket.pending[name] -= 1
        self._release_write(name)

    def _release_write(self, name: str) -> None:
        self._unlanded.discard(name)
        self._writing[name] -= 1
        if self._writing[name] <= 0:
            del self._writing[name]

    # -- copies --------------------------------------------------------------------------
    def prepare_copy(self, move: Copy) -> Ticket:
        """`move` is decided: until it lands, `name` in `move.dst` is read where its bytes are."""
        self._landing[(move.key, move.dst)] = self.source(move.key, move.src)
        self.placing(move.key, move.dst)
        self._copies[move.key] += 1
        return Ticket("copy", [move.key], copy=move, generation=self._generation[move.key])

    def replaced(self, name: str) -> None:
        """`name` is written anew: the copies of it decided before carry the object before
        (`stale`: they must not land), and it is read where the books place it, not where
        such a copy's bytes are."""
        if name in self._copies:
            self._generation[name] += 1
            for key in [k for k in self._landing if k[0] == name]:
                del self._landing[key]

    def stale(self, ticket: Ticket) -> bool:
        """A copy whose name was written anew since it was decided (`replaced`)."""
        return self._generation[ticket.names[0]] != ticket.generation

    @asynccontextmanager
    async def turn(self, ticket: Ticket, limit: asyncio.Semaphore) -> AsyncIterator[int]:
        """Run a copy: its name's copies one at a time, at most `limit` copies at once,
        after the name's foreground write has landed.  Yields the tier to copy from."""
        move = ticket.copy
        assert move is not None
        lock = self._locks.setdefault(move.key, asyncio.Lock())
        async with lock:
            pending = self._landed.get(move.key)
            if pending is not None:
                await pending.wait()  # the source is still being written by a put (no slot held)
            async with limit:
                yield self._landing.get((move.key, move.dst), move.src)

    # -- completion ----------------------------------------------------------------------
    def complete(self, ticket: Ticket, success: bool = True) -> bool:
        """The operation is over.  For a copy: True when it was its name's last copy (the
        caller then removes bytes no tier's books count).  Completing twice is a no-op."""
        if not ticket.open:
            return False
        ticket.open = False
        if ticket.kind == "read":
            for name in ticket.names:
                self._reading[name] -= 1
                if self._reading[name] <= 0:
                    del self._reading[name]
                    self._placed.pop(name, None)
            return False
        if ticket.kind == "write":
            for name, n in ticket.pending.items():
                for _ in range(n):  # writes never reported: over now
                    self._release_write(name)
                if self._landed.get(name) is ticket.landed:
                    del self._landed[name]
            if ticket.landed is not None:
                ticket.landed.set()
            return False
        name = ticket.names[0]
        self._copies[name] -= 1
        if self._copies[name] > 0:
            return False
        del self._copies[name]
        self._generation.pop(name, None)
        self._locks.pop(name, None)
        for key in [k for k in self._landing if k[0] == name]:
            del self._landing[key]
        return True
