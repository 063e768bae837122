"""The warning for a cache that is never reused after a restart.

Owns: `ReuseWatch`, pure bookkeeping that decides when to warn, once, that a store
holding chunks from before this start sees lookups but never finds one of those old
chunks: the classic cause is chunk keys that change on every start (in-process LMCache
under vLLM hashes with a random seed unless ``PYTHONHASHSEED`` is set).  Must not
touch: I/O (the runtime feeds it counts), logging (the caller logs the message).
"""

from __future__ import annotations

from dataclasses import dataclass

MESSAGE = (
    "kvstore: {existing}{more} chunks were stored under namespace {namespace!r} before this start, "
    "and none of the {lookups} chunks looked up since was one of them. If this server restarted "
    "with the same prompts, its chunk keys changed: in-process LMCache under vLLM hashes chunks "
    "with a random seed unless PYTHONHASHSEED is set, so set PYTHONHASHSEED to the same value "
    "on every server (MP mode's blake3 keys do not depend on it). Other causes: another model "
    "name, chunk size, KV dtype or parallel layout than the run that stored them."
)


@dataclass
class ReuseWatch:
    """Counts fed by the runtime; `check` returns the warning the first time it applies."""

    namespace: str = "default"
    min_existing: int = 32  # old chunks needed before the silence means something
    min_lookups: int = 256  # chunk lookups needed before it does
    existing: int = 0  # chunks found in the tiers at start (counting stops at min_existing)
    complete: bool = False  # the start-up count is finished
    lookups: int = 0
    warned: bool = False

    def saw_lookups(self, n: int) -> None:
        self.lookups += n

    def due(self) -> bool:
        """Enough seen to judge, and not warned yet (cheap: call it on every lookup)."""
        return (
            not self.warned
            and self.complete
            and self.existing >= self.min_existing
            and self.lookups >= self.min_lookups
        )

    def check(self, reused: int) -> str | None:
        """`reused`: old chunks found by lookups or reads since start (the store's discoveries)."""
        if not self.due():
            return None
        if reused:
            self.warned = True  # old chunks are being found: nothing to say, ever
            return None
        self.warned = True
        more = "+" if self.existing >= self.min_existing else ""
        return MESSAGE.format(existing=self.existing, more=more, namespace=self.namespace, lookups=self.lookups)


__all__ = ["ReuseWatch"]
