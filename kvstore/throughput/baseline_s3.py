"""The S3 baseline for `kvstore bench s3://...`: plain aiobotocore put_object / get_object.

Owns: the plainest way to move one chunk to and from the bucket the backend URL names,
with the same endpoint, region, credentials, connection pool size and botocore checksum
setting (so a ratio measures the backend, not a different client configuration).  Must
not touch: kvstore's backend code.  Objects go under ``<prefix>/bench-baseline/``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kvstore.backends.s3_options import S3Options


class Baseline:
    name = "aiobotocore put_object/get_object"

    def __init__(self) -> None:
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._options: S3Options | None = None

    async def open(self, url: str) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        o = self._options = S3Options.from_url(url)
        session = get_session()
        if o.profile:
            session.set_config_variable("profile", o.profile)
        config = AioConfig(
            max_pool_connections=o.concurrency,
            s3={"addressing_style": o.addressing_style},
            request_checksum_calculation=o.checksum,
            response_checksum_validation=o.checksum,
        )
        self._stack = contextlib.AsyncExitStack()
        self._client = await self._stack.enter_async_context(
            session.create_client("s3", endpoint_url=o.endpoint_url, region_name=o.region, config=config)
        )

    def _key(self, i: int) -> str:
        return self._opened().key(f"bench-baseline/{i}")

    def _opened(self) -> S3Options:
        if self._options is None:
            raise RuntimeError("open() the baseline first")
        return self._options

    async def put(self, i: int, data: memoryview) -> None:
        # botocore takes bytes/bytearray bodies: hand over the underlying buffer when the
        # view covers all of it, else the plain client has to copy
        whole = isinstance(data.obj, (bytes, bytearray)) and data.nbytes == len(data.obj)
        body = data.obj if whole else data.tobytes()
        await self._client.put_object(Bucket=self._opened().bucket, Key=self._key(i), Body=body)

    async def get(self, i: int, into: memoryview) -> int:
        resp = await self._client.get_object(Bucket=self._opened().bucket, Key=self._key(i))
        body = await resp["Body"].read()
        into[: len(body)] = body
        return len(body)

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = self._client = None
