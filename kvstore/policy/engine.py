"""Placement across an ordered list of tiers: which tier holds what, and which copies to make.

Owns: per-tier residency and byte accounting (`TierState`), the multi-tier rules
(`Placement`): stores land in the top tier (and in every write-through tier), a hit in a
lower tier is promoted to the top, a victim is demoted into the next tier instead of
dropped when that tier admits it, watermarks bound each tier, and a write batch's own
chunks are never evicted for its later ones (those go to a lower tier or are refused).  Decisions are returned as
typed moves (`Write`, `Copy`, `Drop`; `Move` is their union); nothing here does I/O, so `kvstore.tiered.TieredStore` (live) and
`kvstore.policy.simulate` (trace replay) run exactly the same bookkeeping.

Must not touch: backends, asyncio, clocks.

State changes happen at decision time: after `store()` returns, the key *is* resident
in the new tier as far as the policies are concerned; the store executes the returned
moves and keeps the source readable until each copy has landed.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Union

from kvstore.policy.base import NO_META, NOTHING, AnyOf, ChunkMeta, Policy


@dataclass(frozen=True, slots=True)
class Write:
    """The caller's data for `key` goes to tier `dst` (a store)."""

    key: str
    size: int
    dst: int
    kind: ClassVar[str] = "write"


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy `key` from tier `src` to tier `dst`: a promotion (the source copy stays) or a
    demotion (the source copy is deleted once the copy has landed)."""

    kind: Literal["promote", "demote"]
    key: str
    size: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Drop:
    """Delete `key` from tier `src`."""

    key: str
    size: int
    src: int
    kind: ClassVar[str] = "drop"


Move = Union[Write, Copy, Drop]
WriteMode = Literal["back", "through"]


@dataclass
class PlacementCounters:
    """What the engine decided for one tier (the simulator reports these)."""

    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    rejected: int = 0


@dataclass
class TierState:
    """One tier's residents under a byte budget, ordered by its policy.

    Watermarks: when a write would take the tier above `high` × capacity, victims go
    until it is at or below `low` × capacity (both 1.0: evict just enough).
    write: "back" — the tier receives data only by demotion from the tier above (or as the
    top tier); "through" — every store is also written here.
    """

    capacity: int
    policy: Policy
    name: str = ""
    write: WriteMode = "back"
    high: float = 1.0
    low: float = 1.0
    resident: dict[str, int] = field(default_factory=dict)
    used: int = 0
    counters: PlacementCounters = field(default_factory=PlacementCounters)

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high <= 1.0:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1 (got low={self.low}, high={self.high})"
            )
        if self.write not in ("back", "through"):
            raise ValueError(f"write mode must be 'back' or 'through', not {self.write!r}")

    def __contains__(self, key: object) -> bool:
        return key in self.resident

    def make_room(
        self, size: int, protected: Container[str] = NOTHING, own: Container[str] = NOTHING
    ) -> tuple[list[tuple[str, int]], bool]:
        """Evict for a write of `size`: (victims, already removed; whether it now fits).
        `own`: the keys the same write stored before (`Policy.victim`)."""
        cap = self.capacity
        if size > cap:
            return [], False
        if self.used + size <= self.high * cap:
            return [], True
        target = self.low * cap - size
        victims: list[tuple[str, int]] = []
        while self.used > target:
            key = self.policy.victim(protected, own)
            if key is None:
                break
            victims.append((key, self.take(key, evicted=True)))
        return victims, self.used + size <= cap

    def add(self, key: str, size: int, meta: ChunkMeta) -> None:
        self.resident[key] = size
        self.used += size
        self.policy.insert(key, size, meta)

    def take(self, key: str, evicted: bool = False) -> int:
        size = self.resident.pop(key)
        self.used -= size
        self.policy.remove(key, evicted=evicted)
        if evicted:
            self.counters.evictions += 1
        return size


class WriteBatch(Container[str]):
    """The keys one write (a prompt's chunks, in order) has stored or touched so far, with
    their bytes in each tier.  `Placement.store` records them; no tier evicts them to make
    room for the write's later keys, so while the write goes on they stay where they are
    and the byte counts stay true."""

    __slots__ = ("_bytes", "keys")

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self._bytes: dict[int, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def bytes_in(self, tier: int) -> int:
        """Bytes of the batch's keys that tier `tier` holds."""
        return self._bytes.get(tier, 0)

    def note(self, key: str, tiers: Sequence[TierState]) -> None:
        if key in self.keys:
            return
        self.keys.add(key)
        for j, t in enumerate(tiers):
            size = t.resident.get(key)
            if size is not None:
                self._bytes[j] = self._bytes.get(j, 0) + size


class Placement:
    """The placement engine over tiers ordered hot → cold."""

    def __init__(self, tiers: list[TierState], promote: bool = True) -> None:
        if not tiers:
            raise ValueError("a placement needs at least one tier")
        self.tiers = tiers
        self.promote = promote
        self.meta: dict[str, ChunkMeta] = {}  # ChunkMeta of every key held in some tier

    def where(self, key: str) -> int | None:
        """The highest tier holding `key`, or None."""
        for i, t in enumerate(self.tiers):
            if key in t.resident:
                return i
        return None

    def prefix(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are held in some tier (no policy state changes)."""
        n = 0
        tiers = self.tiers
        for k in keys:
            for t in tiers:
                if k in t.resident:
                    break
            else:
                return n
            n += 1
        return n

    def hit(self, key: str, meta: ChunkMeta = NO_META, protected: Container[str] = NOTHING) -> list[Move]:
        """`key` was read: touch it where it lives; promote it to the top tier if lower."""
        i = self.where(key)
        if i is None:
            return []
        if meta is NO_META:
            meta = self.meta.get(key, NO_META)
        tier = self.tiers[i]
        tier.policy.touch(key, meta)
        size = tier.resident[key]
        tier.counters.hits += 1
        tier.counters.bytes_read += size
        for t in self.tiers[:i]:
            t.policy.miss(key, meta)
        if i == 0 or not self.promote:
            return []
        moves: list[Move] = []
        top = self.tiers[0]
        # the data is read once: the promotion writes what the hit read
        if top.policy.admit(key, size, meta) and self._place(Copy("promote", key, size, i, 0), meta, protected, moves):
            top.counters.promotions_in += 1
        return moves

    def store(
        self,
        key: str,
        size: int,
        meta: ChunkMeta = NO_META,
        protected: Container[str] = NOTHING,
        batch: WriteBatch | None = None,
    ) -> list[Move]:
        """A write of `key`: land it in the top tier and every write-through tier.

        A key already held somewhere is a touch there (no rewrite).  `batch`: the write
        `key` belongs to (a prompt's chunks, in order; `key` is recorded in it).  No tier
        evicts a key the batch stored or touched before to make room for a later one: a
        later chunk of a prompt is of no use without the earlier ones (a policy may rank
        new chunks below old ones, as `chain` does while its estimate for never-reused
        chunks falls at a cold start).  When the top tier cannot make room otherwise, the
        write lands in the first write-back tier below that can, as a demotion would have
        put it there; when none can, it is refused and the batch keeps its prefix.  A tier
        that only the batch's own keys could make room in evicts nothing.
        """
        i = self.where(key)
        if i is not None:
            self.tiers[i].policy.touch(key, meta)
            if batch is not None:
                batch.note(key, self.tiers)
            return []
        moves: list[Move] = []
        no_room = False
        for j, tier in enumerate(self.tiers):
            if j and tier.write != "through":
                continue
            if self._write(Write(key, size, j), meta, protected, moves, batch) is False and j == 0:
                no_room = True
        if batch is not None:
            if no_room and self.where(key) is None:
                # the top tier had no room and no write-through tier took it: the first
                # write-back tier below that admits it and has room, as for a demotion
                for k in range(1, len(self.tiers)):
                    if self.tiers[k].write == "back" and self._write(Write(key, size, k), meta, protected, moves, batch):
                        break
            if self.where(key) is not None:
                batch.note(key, self.tiers)
        return moves

    def _write(
        self, w: Write, meta: ChunkMeta, protected: Container[str], moves: list[Move], batch: WriteBatch | None
    ) -> bool | None:
        """Offer write `w` to its tier: None if the tier's policy declines it, else whether
        it was placed."""
        tier = self.tiers[w.dst]
        tier.policy.miss(w.key, meta)
        if not tier.policy.admit(w.key, w.size, meta):
            tier.counters.rejected += 1
            return None
        return self._place(w, meta, protected, moves, batch)

    def _place(
        self,
        move: Write | Copy,
        meta: ChunkMeta,
        protected: Container[str],
        moves: list[Move],
        batch: WriteBatch | None = None,
    ) -> bool:
        """Make room for `move` in its destination tier and count it there: `moves` gets
        what made the room, then `move` itself; False (nothing of it) if there is none."""
        j, key, size = move.dst, move.key, move.size
        at = len(moves)
        tier = self.tiers[j]
        if batch is None:
            victims, ok = tier.make_room(size, protected)
        elif size + batch.bytes_in(j) > tier.capacity:
            victims, ok = [], False  # only the batch's own keys could make room: evict nothing
        else:
            victims, ok = tier.make_room(size, AnyOf(protected, batch), batch)
        for vkey, vsize in victims:
            self._demote(j, vkey, vsize, protected, moves, batch)
        if not ok:
            tier.counters.rejected += 1
            return False
        moves.insert(at, move)
        tier.add(key, size, meta)
        if meta is not NO_META:
            self.meta[key] = meta
        tier.counters.writes += 1
        tier.counters.bytes_written += size
        return True

    def _demote(
        self,
        j: int,
        key: str,
        size: int,
        protected: Container[str],
        moves: list[Move],
        batch: WriteBatch | None = None,
    ) -> None:
        """Tier `j` evicted `key`: hand it to the next tier if that admits it, else drop it."""
        nxt = j + 1
        if self.where(key) is None:
            meta = self.meta.get(key, NO_META)
            if nxt < len(self.tiers):
                below = self.tiers[nxt]
                below.policy.miss(key, meta)
                if below.policy.admit(key, size, meta) and self._place(
                    Copy("demote", key, size, j, nxt), meta, protected, moves, batch
                ):
                    below.counters.demotions_in += 1
                    return
            self.meta.pop(key, None)
        moves.append(Drop(key, size, j))

    def adopt(self, key: str, j: int, size: int, protected: Container[str] = NOTHING) -> list[Move]:
        """`key` was found already stored in tier `j` (written by another process or an
        earlier run): count it there, evicting for room like a write would.  No write
        move is returned (the bytes are there); if it does not fit, it is dropped."""
        if key in self.tiers[j].resident:
            return []
        moves: list[Move] = []
        tier = self.tiers[j]
        victims, ok = tier.make_room(size, protected)
        for vkey, vsize in victims:
            self._demote(j, vkey, vsize, protected, moves)
        if ok:
            tier.add(key, size, NO_META)
        else:
            tier.counters.rejected += 1
            moves.append(Drop(key, size, j))
        return moves

    def holders(self, key: str) -> list[int]:
        """Every tier holding `key`, top first."""
        return [i for i, t in enumerate(self.tiers) if key in t.resident]

    def forget(self, key: str, tier: int) -> None:
        """Undo a placement in `tier` whose copy never landed (a failed write or move)."""
        t = self.tiers[tier]
        if key in t.resident:
            t.take(key)
        if self.where(key) is None:
            self.meta.pop(key, None)

    def delete(self, key: str) -> list[Move]:
        """Remove `key` from every tier (no ghost entries)."""
        moves: list[Move] = []
        for j, t in enumerate(self.tiers):
            if key in t.resident:
                size = t.take(key)
                moves.append(Drop(key, size, j))
        self.meta.pop(key, None)
        return moves
