"""Which names a TieredStore can serve: visibility, discovery, prefix lookup.

Owns: `Lookup`: whether a name is visible (held by the engine, not being written, not
expired) and servable (in a tier that answers), whether a name the engine does not know
may be looked for in the tiers (`discoverable`), and asking the tiers about such names
(`found_in_tiers`, counted as found).  Changes no policy state.  Must not touch: reads
and writes of data, the engine's decisions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvstore.tiered.parts import Parts

# `known` asks a tier's `contains_now` about `Backend.contains_now_batch` names a call
# (a disk tier stats no more than 8 on the caller's thread at once, and backs off after
# slow batches; a Redis tier asks up to 64 in one round trip; a disk tier that watches
# its files, and a memory tier, up to 1,024) and answers None past
# `Backend.contains_now_most` names the books do not hold: a long prompt's miss is then
# asked on the loop, whose stats leave the caller's thread free.


class Lookup:
    def __init__(self, parts: Parts, deleting: Sequence[Counter[str]] = ()) -> None:
        self.p = parts
        self._deleting = deleting  # per tier, names whose deletes are under way (`Mover.deleting`)

    def visible(self, name: str, now: float) -> int | None:
        """The tier serving `name`, or None (absent, still being written, or expired)."""
        p = self.p
        if p.inflight.writing(name) or p.book.is_expired(name, now):
            return None
        return p.placement.where(name)

    def servable(self, name: str, now: float) -> bool:
        """Visible in a tier that is answering (a failing tier's objects are not promised)."""
        j = self.visible(name, now)
        if j is None:
            return False
        p = self.p
        if not p.guard.refusing(j):  # tier j holds it (`visible` found it there): the common case
            return True
        return any(
            name in p.placement.tiers[k].resident and not p.guard.refusing(k) for k in range(j + 1, len(p.tiers))
        )

    def unknown(self, name: str) -> bool:
        """Unknown to the engine, and no write or copy of ours is under way."""
        return self.p.placement.where(name) is None and not self.p.inflight.busy(name)

    def discoverable(self, name: str) -> bool:
        """`unknown`, and no delete of ours is under way either (an evicted name leaves the
        books as it is decided, its bytes when the delete is over: found meanwhile, it
        would be promised, and pinned, and then be gone)."""
        return self.unknown(name) and not any(name in d for d in self._deleting)

    def servable_prefix(self, names: Sequence[str], now: float) -> int:
        """How many leading `names` are servable.  Reads the books only (membership
        tests, no iteration), so another thread may ask; whether the loop changed them
        meanwhile is for the caller to tell (`known_prefix`)."""
        return len(self._servable_each(names, now, prefix=True))

    def _servable_each(self, names: Sequence[str], now: float, *, prefix: bool = False) -> list[bool]:
        """`servable` of each name (with `prefix`, up to the first that is not: all True),
        unrolled (a lookup asks about every chunk of a prompt, per request): the same
        tests, as membership tests, a TTL asked about only where one is set.  Reads the
        books only, so another thread may ask."""
        p = self.p
        writing, book = p.inflight.writing_now, p.book
        expires = book.expires
        tiers = [(t.resident, p.guard.refusing(j)) for j, t in enumerate(p.placement.tiers)]
        out: list[bool] = []
        for name in names:
            held = False
            if name not in writing and not (expires and book.is_expired(name, now)):
                for resident, refusing in tiers:
                    if name in resident:  # `where`: the highest tier holding it
                        held = not refusing or self.servable(name, now)
                        break
            if prefix and not held:
                break
            out.append(held)
        return out

    def known_prefix(self, names: Sequence[str], now: float) -> int | None:
        """`prefix` from any thread without the event loop; None when it needs the tiers
        (with discovery, the first name not servable is unknown here, someone else may
        have stored it, and a tier cannot say at once that it has not: `_absent_now`)
        or when the loop changed the books in a way a reader must not see half of
        (`Parts.changing`) while they were read."""
        stamp = self.p.stamp()
        if stamp is None:  # the loop is in the middle of changing the books
            return None
        n = self.servable_prefix(names, now)
        if n < len(names) and self.p.discover and self.discoverable(names[n]) and not self._absent_now(names[n : n + 1]):
            return None
        # the loop may have changed the books while they were read: the reads could mix
        # two states (a name seen placed, then its failed write's mark seen cleared)
        return n if self.p.unchanged_since(stamp) else None

    def known(self, names: Sequence[str], now: float) -> list[bool] | None:
        """`contains` from any thread without the event loop, or None when that is not
        enough: the loop was changing the books while they were read (`Parts.changing`),
        or, with discovery, a name the books do not serve is one a tier holds (someone
        else stored it; the loop adopts it) or one a tier cannot rule out at once."""
        p = self.p
        stamp = p.stamp()
        if stamp is None:
            return None
        found = self._servable_each(names, now)
        if p.discover and not all(found):
            ask = [n for n, f in zip(names, found) if not f and self.discoverable(n)]
            if not self._absent_now(ask):
                return None
        return found if p.unchanged_since(stamp) else None

    def _absent_now(self, names: Sequence[str]) -> bool:
        """Every tier that answers says at once, on this thread, that it holds none of
        `names` (`Backend.contains_now`, asked `contains_now_batch` names at a time, and
        False past `contains_now_most` names; a tier failing fast holds nothing usable now)."""
        p = self.p
        for j, tier in enumerate(p.tiers):
            if p.guard.refusing(j):
                continue
            if len(names) > tier.backend.contains_now_most():
                return False
            batch = tier.backend.contains_now_batch()
            for k in range(0, len(names), batch):
                held = tier.backend.contains_now(names[k : k + batch])
                if held is None or any(held):
                    return False
        return True

    async def prefix(self, names: Sequence[str], now: float) -> int:
        """How many leading `names` are servable (or, with discovery, found in a tier)."""
        n = self.servable_prefix(names, now)
        # the first unknown name decides whether the rest are worth asking about
        if n < len(names) and self.p.discover and (await self.found_in_tiers(names[n : n + 1], now))[0]:
            n += 1
            for found in await self.found_in_tiers(names[n:], now):
                if not found:
                    break
                n += 1
        return n

    async def contains(self, names: Sequence[str], now: float) -> list[bool]:
        if self.p.discover:
            return await self.found_in_tiers(names, now)
        return [self.servable(n, now) for n in names]

    async def found_in_tiers(self, names: Sequence[str], now: float) -> list[bool]:
        """Visible, or (unknown to the engine) stored in some tier by someone else."""
        p = self.p
        found = [self.servable(n, now) for n in names]
        todo = [i for i, n in enumerate(names) if not found[i] and self.discoverable(n)]
        for j in range(len(p.tiers)):
            if not todo:
                break
            held = await p.guard.contains(j, [names[i] for i in todo])
            p.counters.found += sum(held)
            for i, h in zip(todo, held):
                found[i] = h
            todo = [i for i in todo if not found[i]]
        return found
