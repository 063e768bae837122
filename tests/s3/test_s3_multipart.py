"""S3 multipart uploads never leak: a put whose part fails, or which is cancelled, stops
its other parts and aborts its upload before it returns; `kvstore gc` aborts the uploads
a killed writer left behind (ListMultipartUploads under the prefix, AbortMultipartUpload),
and only those older than its threshold.  All against SeaweedFS, which implements
ListMultipartUploads, ListParts and AbortMultipartUpload."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import aiobotocore.session
import pytest
from botocore.exceptions import ClientError
from click.testing import CliRunner

from kvstore.backends import open_backend
from kvstore.backends.s3 import S3Backend
from kvstore.cli.main import cli
from kvstore.testing.fault_proxy import FaultProxy

BUCKET = "kvstore-test"
MiB = 1 << 20
MULTIPART = {"multipart_threshold": "5MiB", "part_size": "5MiB", "max_attempts": "1"}
_prefixes = itertools.count()


def fresh_prefix() -> str:
    return f"mpu{os.getpid()}-{next(_prefixes)}"


async def uploads(seaweed: Any, prefix: str) -> list[tuple[str, str]]:
    """(key, upload id) of every unfinished multipart upload under `prefix`/."""
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **seaweed.client_kwargs()) as client:
        page = await client.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{prefix}/")
        return [(u["Key"], u["UploadId"]) for u in page.get("Uploads", ())]


async def start_upload(seaweed: Any, key: str) -> str:
    """A multipart upload with one part stored and never finished, as a killed writer leaves."""
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **seaweed.client_kwargs()) as client:
        up = await client.create_multipart_upload(Bucket=BUCKET, Key=key)
        await client.upload_part(
            Bucket=BUCKET, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"p" * (5 * MiB)
        )
        return str(up["UploadId"])


@pytest.mark.parametrize("stream", ["true", "false"])
async def test_a_failed_part_stops_the_other_parts_and_aborts_the_upload(s3_env, stream) -> None:  # type: ignore[no-untyped-def]
    prefix = fresh_prefix()
    b = open_backend(s3_env.url(BUCKET, prefix, stream=stream, **MULTIPART))
    assert isinstance(b, S3Backend)
    await b.open()
    running: set[int] = set()
    finished: list[int] = []
    failure = ClientError({"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "UploadPart")

    if stream == "true":  # parts go through presigned PUTs on worker threads
        streams, _ = b._stream_pool()
        real_put = streams.put

        def put(url: str, body: Any, op: Any) -> Any:
            number = int(re.search(r"partNumber=(\d+)", url).group(1))  # type: ignore[union-attr]
            running.add(number)
            try:
                if number == 3:
                    time.sleep(0.2)  # the others are on their way when this one fails
                    raise failure
                time.sleep(1.0)  # slow parts: still sending when part 3 fails
                etag = real_put(url, body, op)
                finished.append(number)
                return etag
            finally:
                running.discard(number)

        streams.put = put  # type: ignore[method-assign]
    else:
        real_upload_part = b._client.upload_part

        async def upload_part(**kw: Any) -> Any:
            number = kw["PartNumber"]
            running.add(number)
            try:
                if number == 3:
                    await asyncio.sleep(0.2)
                    raise failure
                await asyncio.sleep(1.0)
                resp = await real_upload_part(**kw)
                finished.append(number)
                return resp
            finally:
                running.discard(number)

        b._client.upload_part = upload_part
    try:
        assert await b.put_many([("o/big", os.urandom(20 * MiB))]) == [False]
        assert running == set()  # no part of it is still being sent
        if stream == "false":
            assert finished == []  # the other parts were stopped, not left to land after the abort
        deadline = time.monotonic() + 10
        while await uploads(s3_env, prefix):  # aborted in the background, soon after
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert b.stats().extra["errors"].get("upload_abort_failed", 0) == 0
        await asyncio.sleep(1.2)
        assert await uploads(s3_env, prefix) == []
        assert await b.contains_many(["o/big"]) == [False]
    finally:
        await b.close()


@pytest.mark.parametrize("stream", ["true", "false"])
async def test_a_cancelled_put_ends_at_once_and_its_upload_is_aborted(s3_env, stream) -> None:  # type: ignore[no-untyped-def]
    """A put cancelled mid-upload returns once no part sends from the caller's buffers
    (it keeps its deadline); the upload's abort runs on in the background and lands
    soon after, and close() waits for it."""
    prefix = fresh_prefix()
    with FaultProxy(("127.0.0.1", s3_env.ports.s3), latency=0.3) as slow:  # a slow link
        b = open_backend(s3_env.url(BUCKET, prefix, endpoint_url=slow.url, stream=stream, **MULTIPART))
        await b.open()
        try:
            put = asyncio.ensure_future(b.put_many([("o/big", os.urandom(20 * MiB))]))
            deadline = time.monotonic() + 10
            while not await uploads(s3_env, prefix):
                assert time.monotonic() < deadline and not put.done()
                await asyncio.sleep(0.02)
            slow.latency = 1.0  # slower still: each abort request takes a second
            put.cancel()
            cancelled_at = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await put
            assert time.monotonic() - cancelled_at < 1.5  # not three rounds of aborts over a slow link
            deadline = time.monotonic() + 10
            while await uploads(s3_env, prefix):  # the abort lands in the background
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            await b.close()
    assert await uploads(s3_env, prefix) == []


def test_gc_aborts_only_stale_uploads_under_its_prefix(s3_env) -> None:  # type: ignore[no-untyped-def]
    prefix, other = fresh_prefix(), fresh_prefix()
    url = s3_env.url(BUCKET, prefix)
    old = asyncio.run(start_upload(s3_env, f"{prefix}/ns/m/vllm-1-0/old"))
    elsewhere = asyncio.run(start_upload(s3_env, f"{other}/ns/m/vllm-1-0/old"))
    time.sleep(5)
    fresh = asyncio.run(start_upload(s3_env, f"{prefix}/ns/m/vllm-1-0/fresh"))  # maybe a live writer's
    runner = CliRunner()

    dry = runner.invoke(cli, ["gc", url, "--stale-uploads", "3s", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["uploads_aborted"] == 1
    assert {u for _, u in asyncio.run(uploads(s3_env, prefix))} == {old, fresh}

    done = runner.invoke(cli, ["gc", url, "--stale-uploads", "3s"])
    assert done.exit_code == 0, done.output
    assert "1 unfinished uploads aborted" in done.output
    assert [u for _, u in asyncio.run(uploads(s3_env, prefix))] == [fresh]
    assert [u for _, u in asyncio.run(uploads(s3_env, other))] == [elsewhere]  # not under this prefix


def test_uploads_a_killed_writer_left_are_collected(s3_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """kill -9 in the middle of multipart puts: the uploads stay on the server until gc."""
    prefix = fresh_prefix()
    with FaultProxy(("127.0.0.1", s3_env.ports.s3), latency=0.5) as slow:
        url = s3_env.url(BUCKET, prefix, endpoint_url=slow.url, **MULTIPART)
        writer = textwrap.dedent(
            f"""
            import asyncio, os
            from kvstore.backends import open_backend
            async def main():
                b = open_backend({url!r})
                await b.put_many([(f"o/{{i}}", os.urandom(20 << 20)) for i in range(3)])
            asyncio.run(main())
            """
        )
        proc = subprocess.Popen([sys.executable, "-c", writer], env=os.environ.copy())
        try:
            deadline = time.monotonic() + 30
            while len(asyncio.run(uploads(s3_env, prefix))) < 3:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    time.sleep(2.5)
    assert len(asyncio.run(uploads(s3_env, prefix))) == 3  # nothing aborts them once killed
    out = CliRunner().invoke(cli, ["gc", s3_env.url(BUCKET, prefix), "--stale-uploads", "1s", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["uploads_aborted"] == 3
    assert asyncio.run(uploads(s3_env, prefix)) == []
