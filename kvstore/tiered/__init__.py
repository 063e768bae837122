"""TieredStore: tensors by object name across ordered tiers (hot → cold), placed by policy.

Owns: carrying out the placement engine's decisions (`kvstore.policy.engine`) with real
tiers (`kvstore.tier.Tier` = backend + codec).  Must not touch: placement rules (the
engine decides, this package executes), frame or codec internals (`Tier`), backend
internals.  One concern per module:

* `store`     `TieredStore`, the public API composing the parts below
* `spec`      `TierSpec`, the engine's `Placement` from specs
* `lookup`    visibility, discovery of objects other processes stored, prefix lookup
* `reads`     get paths: grouping by source tier, fallback, discovery reads, hits
* `writes`    the put path: framing, quotas, the engine's writes, foreground writes
* `moves`     carrying out the engine's moves: drops now, copies in the background
* `inflight`  one ticket per operation under way (prepare / complete)
* `guard`     a deadline and a circuit breaker per tier
* `parts`     what the pieces share
* `stats`     `TierStats`, `StoreStats`

Build one::

    store = TieredStore.from_urls(
        ["mem://hot?capacity=1GiB", "file:///var/kv?capacity=10GiB", ("s3://b/p", "cachegen")],
        policy="chain",                       # default; or lru, lfu, arc, wtinylfu
        namespaces={"tenant-a": NamespaceRule(quota=2 << 30, ttl=3600)},
    )

A tier spec is a URL, ``(url, codec)`` or a `TierSpec`.  Store options in the URL query
(``capacity``, ``policy``, ``write=back|through``, ``high``, ``low``) are read once by
`kvstore.tier_options.TierOptions`.  ``capacity`` is the byte budget of the tier's
medium: the engine places within it and demotes first; a backend that enforces a budget
(``mem://``, ``file://``, shared by every process on the directory) keeps it too, as the
hard bound, and the names it evicts leave the store's books (`on_gone` is told).

API (all batched, all async except pin/unpin/stats):

* ``put_many([(name, tensor)], chained=False, parent=None) -> [bool]``  Store; True when
  the object is held (written now, or already held).  With ``chained=True`` the items are
  consecutive chunks of one prompt, in order, and `parent` names the chunk just before
  the first (the end of the prefix already cached): the policy then knows each chunk's
  place in its prefix chain.  A write becomes visible only once it has landed.
* ``put_many(..., layout="raw")``  `layout` tags the stored frame (e.g.
  ``"lmcache:KV_2LTD"``) and comes back in the header a reader sees.
* ``get_many(names, out=None) -> [tensor | None]``  Read from the highest tier holding
  each name; a hit in a lower tier is promoted in the background.  Defective frames are
  quarantined and read as misses.  ``out[i]`` may be a tensor to decode into, or a
  callable ``(FrameHeader) -> tensor | None`` called once the frame's header is read and
  checked, so the caller allocates exactly the stored shape (None: skip it, a miss
  that leaves the object stored; so is a tensor that does not fit).  With every
  ``out[i]`` given, a backend that streams (disk) reads a raw payload straight into the
  caller's tensor, hashing each block as it lands, and hands it back only if the
  checksum matches (the callable then runs on a backend worker thread: keep it
  thread-safe); other non-memory tiers read into pooled, reused buffers and decode into
  the caller's tensors.  Either way the payload is copied once.
* ``contains_many(names) -> [bool]``, ``delete_many(names) -> [bool existed]``.
* ``prefix_lookup(names) -> int``  How many leading names are held in some tier (the
  question LMCache asks before retrieving); changes no policy state.
* ``pin(names, ttl=None)`` / ``unpin(names)``  A pinned name is never evicted until
  unpinned or until its pin expires (`pin_ttl` seconds by default).
* ``known_prefix(names)`` / ``lookup_now(names, ttl)``  `prefix_lookup`, and
  `contains_many` + `pin` of what was found, answered on the caller's thread (any
  thread) from the books, or None when the event loop must answer.
* ``drain()``  Wait for background copies (promotions, demotions).
* ``stats() -> StoreStats``; ``metrics.text()`` for Prometheus; ``close()``.

With ``discover=True`` (the LMCache plugins' setting) names the engine does not know are
looked up in the tiers themselves: a lookup asks the backends, a read tries each tier in
order, and an object found is adopted into the engine's books.  That is how a process
finds what another process (or an earlier run) stored in a shared disk, Redis or S3
tier, and how a name forgotten after a failed read (a server down for a moment) hits
again once the server is back.

Guarantees: a name being written is invisible until complete; a name being read, written
or pinned is never chosen as a victim; a victim is demoted to the next tier (if that tier
admits it) instead of dropped, and stays readable from its old tier until the copy has
landed; at most `max_moves` copies run at once.  Byte budgets count frame bytes; a
demotion into a tier with another codec is accounted at the source size.
"""
from __future__ import annotations

from kvstore.tier_options import STORE_OPTIONS, TierOptions
from kvstore.tier_stream import DECLINED, GONE, HIT, Out
from kvstore.tiered.reads import UNAVAILABLE
from kvstore.tiered.spec import UNBOUNDED, TierSpec
from kvstore.tiered.stats import StoreStats, TierStats
from kvstore.tiered.store import TieredStore

__all__ = [
    "DECLINED",
    "GONE",
    "HIT",
    "STORE_OPTIONS",
    "UNAVAILABLE",
    "UNBOUNDED",
    "Out",
    "StoreStats",
    "TierOptions",
    "TierSpec",
    "TierStats",
    "TieredStore",
]
