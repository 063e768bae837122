"""Gather writes for redis-py: send one Redis value made of several buffers without joining them.

Owns: `Gathered` (a value given as parts) and `gathering(connection_class)`, which
makes a redis.asyncio connection class that packs a `Gathered` argument as one RESP
bulk string whose parts go to the transport as they are.  The asyncio transport still
joins a command's pieces once when it writes (as it does for every redis-py command);
without this, a framed value (header + payload) would be joined once more first.
Must not touch: key layout, batching, faults.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from redis.asyncio.connection import AbstractConnection


class Gathered:
    """One Redis value spread over several flat byte views (e.g. a frame's header and payload)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts = list(parts)
        self.nbytes = sum(p.nbytes for p in self.parts)


@cache
def gathering(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """A subclass of `connection_class` whose `pack_command` accepts `Gathered` arguments."""
    plain_pack = connection_class.pack_command

    def pack_command(self: Any, *args: Any) -> list[Any]:
        if not any(isinstance(a, Gathered) for a in args):
            return plain_pack(self, *args)
        out: list[Any] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, Gathered):
                out.append(head + b"$%d\r\n" % arg.nbytes)
                out.extend(arg.parts)
                head = b"\r\n"
                continue
            data = self.encoder.encode(arg)
            if isinstance(data, memoryview) or len(data) > 6000:
                out.append(head + b"$%d\r\n" % len(data))
                out.append(data)
                head = b"\r\n"
            else:
                head += b"$%d\r\n%s\r\n" % (len(data), data)
        out.append(head)
        return out

    # built with type(): the base is only known at run time (plain, SSL or unix-socket connections)
    return type(f"Gathering{connection_class.__name__}", (connection_class,), {"pack_command": pack_command})
