"""`kvstore bench`: throughput of a backend against a plain-client baseline, same run.

Owns: the `Baseline` protocol and the scheme → baseline table.  Each backend's baseline
(the plainest way to move the same bytes with the underlying library: ``os.write`` +
``fsync`` / ``os.preadv`` for disk, redis-py SET/GET for Redis, aiobotocore
put_object/get_object for S3) lives in ``kvstore/throughput/baseline_<scheme>.py`` as a
class named ``Baseline``.
"""

from __future__ import annotations

import importlib
from typing import Protocol
from urllib.parse import urlsplit


class Baseline(Protocol):
    """The plain-client reference a backend is measured against.

    `open` is given the backend URL (the baseline uses the same server / directory);
    `put` writes object `i` (bytes of one chunk); `get` reads object `i` into `into`
    (a reused buffer of the object's size) and returns the byte count.
    """

    name: str

    async def open(self, url: str) -> None: ...
    async def put(self, i: int, data: memoryview) -> None: ...
    async def get(self, i: int, into: memoryview) -> int: ...
    async def close(self) -> None: ...


_BASELINES = {
    "file": "kvstore.throughput.baseline_file",
    "mem": "kvstore.throughput.baseline_mem",
    "redis": "kvstore.throughput.baseline_redis",
    "rediss": "kvstore.throughput.baseline_redis",
    "unix": "kvstore.throughput.baseline_redis",
    "redis+cluster": "kvstore.throughput.baseline_redis",
    "s3": "kvstore.throughput.baseline_s3",
}


def baseline_for(url: str) -> Baseline:
    scheme = urlsplit(url).scheme.lower()
    module = _BASELINES.get(scheme)
    if module is None:
        raise ValueError(f"no baseline for scheme {scheme!r}; known: {sorted(_BASELINES)}")
    return importlib.import_module(module).Baseline()
