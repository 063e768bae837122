"""The backend protocol: async, batched, bytes in / bytes out.

Owns: the `Backend` ABC every storage backend implements, the values that cross it
(`ObjectInfo`, `BackendStats`) and the shared error counters.  Must not touch: frames,
codecs, tensors, placement policy.  A backend stores opaque objects under names that
`kvstore.keys.check_object_name` accepts.

Primitives (all batched; one call moves many objects):

* ``put_many([(name, value), ...]) -> [bool]``  value = one buffer or a list of parts
  (gather write, so a frame's header and payload are never joined); False = not
  known to be stored (error counted, never raised): the write failed, or a remote one
  was cut off by its deadline after the server had it, and may still land, whole.
* ``get_many(names, alloc=None) -> [memoryview | None]``  None = miss.  With `alloc`,
  the object is read into ``alloc(size)`` (a caller's buffer of at least `size` bytes)
  and the returned view points into it.
* ``contains_many(names) -> [bool]``, ``delete_many(names) -> [bool]`` (True = existed
  and is gone now; an object that could not be deleted is False, counted in
  ``delete_errors``, never reported deleted).
* ``list(prefix) -> AsyncIterator[ObjectInfo]`` with sizes.
* ``quarantine(name, reason, found)`` takes a corrupt object out of service (default: delete),
  with `found` (a `Defect`) only while it still is what a check found.
* ``read_heads(names, nbytes)`` the first `nbytes` of each object (frame headers for
  listing tools); the default reads whole objects, backends override with ranged reads.
* ``check()`` raises `BackendUnavailableError` saying what to fix when the backend
  cannot be used at all (server unreachable, bucket missing, bad credentials).
* ``retention_risks() -> [str]`` the ways the store may drop an object it accepted
  without being asked (a byte budget, a TTL, a server's eviction policy), each naming
  the setting and its fix; empty when what is written stays until deleted.  The base
  class answers for `capacity`.
* ``capacity`` the byte budget a backend that declares ``enforces_capacity`` keeps its
  medium under (None: unbounded); ``on_evict`` (settable) is told the names it evicted
  to stay under it, so a store above stops promising them.
* ``stats() -> BackendStats``, ``close()``.
* ``capabilities`` (a `Capabilities`): what a backend can do beyond the primitives,
  declared by each backend class, so callers never sniff URLs or attributes.  A backend
  with ``streamed_reads`` implements ``read_streamed`` (see `kvstore.backends.stream`).

Faults (server down, disk full, permission denied) are counted in `stats()` and turned
into False / None; only programming errors (bad arguments) raise.  A fault of one
object (a file that is a directory, a key of the wrong type, a name that cannot be
encoded) stays that object's: the rest of the batch is served.  An object larger than
`Backend.max_object_bytes` (URL option ``max_object_size``, default 1GiB) is neither
stored nor read into memory: puts refuse it, and a stored one (a file extended, a
manifest claiming a huge total) is a miss counted in ``rejected`` and left where it is
(another process may have written it under a larger limit; raise the reader's).
What a listing could not read is recorded in `Backend.unlisted` (what, why) instead of
ending the listing.
"""

from __future__ import annotations

import abc
import builtins
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Union

from kvstore.backends.stream import StreamSink
from kvstore.keys import printable_name
from kvstore.options import option_size
from kvstore.redact import redact_url

log = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]
Value = Union[Buffer, Sequence[Buffer]]
Alloc = Callable[[int], memoryview]


class BackendUnavailableError(RuntimeError):
    """The backend cannot be used at all; the message says what to fix."""


def as_parts(value: Value) -> list[memoryview]:
    """Normalise a put value to a list of flat byte views (no copies)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = [value]
    out = []
    for part in value:
        mv = part if isinstance(part, memoryview) else memoryview(part)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        out.append(mv)
    return out


def parts_len(parts: Sequence[memoryview]) -> int:
    return sum(p.nbytes for p in parts)


def bytearray_alloc(size: int) -> memoryview:
    """Default allocator: a fresh buffer per object."""
    return memoryview(bytearray(size))


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object."""

    name: str
    size: int
    mtime: float = 0.0


@dataclass(slots=True)
class Counters:
    """Operation counters every backend keeps; `stats()` reports them."""

    puts: int = 0
    put_bytes: int = 0
    put_errors: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    get_errors: int = 0
    deletes: int = 0
    delete_errors: int = 0
    evictions: int = 0
    quarantined: int = 0
    rejected: int = 0


@dataclass(frozen=True, slots=True)
class BackendStats:
    """A snapshot of one backend: where it is, how full, and what happened so far."""

    url: str
    objects: int | None = None
    bytes: int | None = None
    capacity_bytes: int | None = None
    counters: Counters = field(default_factory=Counters)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: one object streamed into a sink by a blocking step: (object size, bytes read, the
#: sink's verdict); raises `OSError` or another exception where it found no usable object
ReadStep = Callable[[str, StreamSink], "tuple[int, int, object]"]


@dataclass(frozen=True)
class ReadsNow:
    """A backend's reads off the event loop (`Backend.reader_now`): the step, and how
    many may run at once."""

    step: ReadStep
    concurrency: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Optional abilities a backend declares (`Backend.capabilities`, set on the class).

    streamed_reads: implements ``read_streamed(names, open_sink)``: an object's bytes land
        where its sink says, block by block (`kvstore.backends.stream`).
    streams_on_loop: its ``read_streamed`` writes into the caller's buffers only from the
        event loop, so cancelling the read stops those writes at once (worker threads,
        as the disk backend's, finish their block first).
    cancels_cleanly: its ``read_streamed`` may be cancelled: it stops its transfers and
        returns (raises) only once no worker writes into the caller's buffers any more.
    in_memory: objects live in this process; reads hand back views of them (zero copy),
        so reading into pooled buffers gains nothing.
    ranged_reads: ``read_heads`` reads only the first bytes of an object.
    server_ttl: the server can expire objects by itself (a TTL option).
    seals_frames: takes an `kvstore.frame.UnsealedFrame` as a value and computes its
        checksum while it writes the payload (one pass over the bytes instead of two);
        `Tier.put_frames` seals frames first for every other backend.
    enforces_capacity: takes a ``capacity`` URL option (bytes of its medium) and keeps
        the medium under it itself, evicting least recently used objects and telling
        `Backend.on_evict` which (see `kvstore.tier_options` for what capacity means).
    """

    streamed_reads: bool = False
    streams_on_loop: bool = False
    cancels_cleanly: bool = False
    in_memory: bool = False
    ranged_reads: bool = False
    server_ttl: bool = False
    enforces_capacity: bool = False
    seals_frames: bool = False


DEFAULT_MAX_OBJECT = 1 << 30
#: the most names one lookup asks at once of a tier that answers from memory (no I/O)
MEMORY_LOOKUP_MOST = 1 << 10
MAX_OBJECT_OPTION = "max_object_size"


class Backend(abc.ABC):
    """An async, batched object store of bytes.  See the module docstring."""

    schemes: ClassVar[tuple[str, ...]] = ()
    #: declared by the class; an instance may narrow it from its options (S3's ``stream=false``)
    capabilities: Capabilities = Capabilities()

    def __init__(self, url: str) -> None:
        self.url = url
        self.counters = Counters()
        self.capacity: int | None = None  # bytes of the medium, enforced here (`enforces_capacity`)
        #: told the names this backend evicted to stay under `capacity` (this process's evictions)
        self.on_evict: Callable[[builtins.list[str]], None] | None = None
        self.max_object_bytes = DEFAULT_MAX_OBJECT
        self.unlisted: list[tuple[str, str]] = []  # (what, why) a listing could not read

    def set_max_object(self, value: str | int | None) -> None:
        """Apply the ``max_object_size`` URL option (None keeps the default)."""
        if value is not None:
            self.max_object_bytes = (
                option_size(MAX_OBJECT_OPTION, value, unbounded=False) or DEFAULT_MAX_OBJECT
            )

    def too_large(self, name: str, size: int) -> bool:
        """Whether `size` bytes exceed `max_object_bytes` (logged once per call)."""
        if size <= self.max_object_bytes:
            return False
        log.warning(
            "kvstore: %s is %d bytes, over %s=%d; not read into memory (raise %s if it is real)",
            printable_name(name),
            size,
            MAX_OBJECT_OPTION,
            self.max_object_bytes,
            MAX_OBJECT_OPTION,
        )
        return True

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str) -> Backend:
        """Build from a URL of one of `schemes`; raise ValueError saying what is wrong."""

    @classmethod
    def open_existing(cls, url: str) -> Backend:
        """Open a store that must already exist, creating nothing (read-only tools).  Raise
        `BackendUnavailableError` if it is not there; backends that create storage on open
        (a disk directory) override this."""
        return cls.from_url(url)

    @abc.abstractmethod
    async def put_many(self, items: Sequence[tuple[str, Value]]) -> list[bool]: ...

    @abc.abstractmethod
    async def get_many(self, names: Sequence[str], alloc: Alloc | None = None) -> list[memoryview | None]: ...

    @abc.abstractmethod
    async def contains_many(self, names: Sequence[str]) -> list[bool]: ...

    def contains_now(self, names: Sequence[str]) -> builtins.list[bool] | None:
        """`contains_many` answered at once on the caller's thread (any thread), changing
        nothing, or None where the answer needs the network or the event loop (the
        default).  A lookup that misses asks this before it hops to the store's loop."""
        return None

    def reader_now(self) -> ReadsNow | None:
        """Streamed reads of single objects as blocking steps any thread may run, outside
        the event loop (`kvstore.tiered.direct`), or None where reads need the loop (the
        default, or not now).  The objects such steps found go on the backend's books through
        `read_off_loop`."""
        return None

    def read_off_loop(self, names: Sequence[str], sizes: Sequence[int], got: Sequence[int]) -> None:
        """On the loop: objects `reader_now`'s steps found (sizes, bytes read) go on the
        books as the backend's own reads would (a backend without `reader_now`: never
        called)."""
        return None

    def contains_now_batch(self) -> int:
        """How many names a lookup asks `contains_now` about per call (it stops at the
        first batch holding one): a disk tier that stats each name takes a few at a
        time, a Redis tier asks all in one round trip."""
        return 8

    def contains_now_most(self) -> int:
        """The most names one lookup asks `contains_now` about, in all: past it the
        lookup goes to the store's loop (a long prompt's stats leave the caller's thread)."""
        return 64

    @abc.abstractmethod
    async def delete_many(self, names: Sequence[str]) -> list[bool]: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]: ...

    async def read_streamed(
        self, names: Sequence[str], open_sink: Callable[[str], StreamSink]
    ) -> builtins.list[object | None]:
        """Stream each object into the sink ``open_sink(name)`` gives; the sinks' verdicts,
        None for a miss (see `kvstore.backends.stream`).  Only for backends whose
        `capabilities` declare ``streamed_reads``."""
        raise NotImplementedError(f"{type(self).__name__} does not stream reads")

    async def quarantine(self, name: str, reason: str, found: Defect | None = None) -> bool:
        """Take a corrupt object out of service; True when it was taken.

        With `found` (what a check found defective), only while the object still is
        that: a copy written since the check (a repair, a rewrite) stays in service.
        Here: read again, compare, delete (a write landing between the comparison and
        the delete goes too); backends with a conditional delete or a side area
        override this.
        """
        if found is not None and found.conditional and not await self._still(name, found):
            return False
        await self.delete_many([name])
        self.counters.quarantined += 1
        return True

    async def _still(self, name: str, found: Defect) -> bool:
        """Whether `name` reads back as what `found` says a check read (a failed read
        tells nothing, so it is no)."""
        errors = self.counters.get_errors
        (now,) = await self.get_many([name])
        if now is None and self.counters.get_errors != errors:
            return False
        return found.matches(now)

    async def read_heads(self, names: Sequence[str], nbytes: int) -> builtins.list[memoryview | None]:
        """The first `nbytes` of each object (None = missing)."""
        return [None if v is None else v[:nbytes] for v in await self.get_many(names)]

    async def retention_risks(self) -> builtins.list[str]:
        """How this store may drop objects it accepted without being asked to, one sentence
        each naming the setting and how to turn it off (empty: objects stay until deleted).

        Here: the byte budget (`capacity`).  Backends with expiry or a server that evicts
        override this, asking the server where the answer lives there.  `kvstore migrate
        --delete-source` refuses a destination that answers anything.
        """
        if self.capacity is None:
            return []
        return [
            f"{redact_url(self.url)} has a byte budget (capacity={self.capacity}) and evicts the least "
            "recently used objects to stay under it; open it without capacity="
        ]

    def key_space(self) -> tuple[str, str] | None:
        """(where this store's keys live, its prefix there): two stores of one space whose
        prefixes contain one another share keys (``s3://b`` and ``s3://b/p``). None where
        that cannot be said from the URL (a directory of its own, process memory)."""
        return None

    async def make_durable(self, names: Sequence[str] | None = None) -> None:  # noqa: B027 - optional hook
        """Make every object this backend has written so far, and the objects `names`
        (whoever wrote them, e.g. an earlier run with syncing off), survive a crash or
        power loss, where a successful put alone does not (a disk store's renames, until
        their directories are synced). Here: nothing to do. `kvstore migrate
        --delete-source` calls it with the names whose sources it is about to delete."""

    def evicted(self, names: builtins.list[str]) -> None:
        """Tell `on_evict` that `names` were evicted to stay under `capacity` (counted)."""
        self.counters.evictions += len(names)
        if names and self.on_evict is not None:
            try:
                self.on_evict(names)
            except Exception:
                log.exception("kvstore: on_evict callback failed")

    async def check(self) -> None:  # noqa: B027 - optional hook
        """Raise `BackendUnavailableError` if the backend cannot be used; no-op by default."""

    def stats(self) -> BackendStats:
        return BackendStats(url=redact_url(self.url), counters=self.counters)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files; the backend is unusable afterwards."""

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # convenience wrappers for a single object
    async def put(self, name: str, value: Value) -> bool:
        return (await self.put_many([(name, value)]))[0]

    async def get(self, name: str, alloc: Alloc | None = None) -> memoryview | None:
        return (await self.get_many([name], alloc))[0]


def same_bytes(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview) -> bool:
    """Whether two buffers hold the same bytes (compared in slices, without copying either)."""
    va, vb = memoryview(a).cast("B"), memoryview(b).cast("B")
    if va.nbytes != vb.nbytes:
        return False
    step = 1 << 22
    return all(va[i : i + step] == vb[i : i + step] for i in range(0, va.nbytes, step))


@dataclass(frozen=True, slots=True)
class Defect:
    """What a check found defective, handed to `Backend.quarantine` so that it takes the
    object only while it still is that.

    ``read``: the bytes read (taken only while the object holds exactly these);
    ``absent``: the object was listed but read as absent (taken only while it still
    reads so); ``fails``: the check the object failed, where its bytes were not kept
    (a read streamed into the caller's buffer): taken only while the object read back
    still fails it; ``since``: when the read began (backends that can tell when an
    object last changed, as disk can, take it only if it has not changed since, and
    need neither of the two before).
    """

    read: bytes | memoryview | None = None
    absent: bool = False
    since: float | None = None
    fails: Callable[[memoryview], bool] | None = None

    @property
    def conditional(self) -> bool:
        """Whether reading the object back can tell if it still is what was found."""
        return self.read is not None or self.absent or self.fails is not None

    def matches(self, now: bytes | memoryview | None) -> bool:
        """Whether an object read back as `now` is still what was found."""
        if self.absent:
            return now is None
        if self.read is not None:
            return now is not None and same_bytes(now, self.read)
        if self.fails is not None:
            return now is not None and self.fails(memoryview(now))
        return True
