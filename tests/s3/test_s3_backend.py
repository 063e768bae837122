"""The S3 backend against a real S3-protocol server (SeaweedFS with signature checks)."""

from __future__ import annotations

import dataclasses
import os

import aiobotocore.session
import pytest

from kvstore.backends import open_backend
from kvstore.backends.base import Defect
from kvstore.backends.s3 import S3Backend, S3OpenError
from kvstore.throughput import baseline_for

MiB = 1 << 20


@pytest.fixture
async def backend(s3_url):
    b = open_backend(s3_url())
    assert isinstance(b, S3Backend)
    await b.open()
    yield b
    await b.close()


async def plain_get(server, key: str) -> bytes:
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **server.client_kwargs()) as client:
        resp = await client.get_object(Bucket="kvstore-test", Key=key)
        return await resp["Body"].read()


async def test_round_trip_small_32mib_and_multipart(backend):
    small, big, multi = os.urandom(1000), os.urandom(32 * MiB), os.urandom(40 * MiB + 123)
    header = os.urandom(77)
    ok = await backend.put_many(
        [
            ("m/small", small),
            ("m/big", big),
            ("m/multi", [memoryview(header), memoryview(multi)]),
            ("m/empty", b""),
        ]
    )
    assert ok == [True] * 4
    got = await backend.get_many(["m/small", "m/big", "m/multi", "m/empty", "m/absent"])
    assert [None if g is None else bytes(g) for g in got] == [small, big, header + multi, b"", None]
    c = backend.counters
    assert (c.puts, c.hits, c.misses, c.get_errors, c.put_errors) == (4, 4, 1, 0, 0)


async def test_multipart_upload_is_one_object_of_many_parts(backend, s3_env):
    data = os.urandom(20 * MiB + 5)  # threshold 16 MiB, parts of at least 8 MiB: two of 10 MiB
    assert await backend.put("mp/obj", data)
    session = aiobotocore.session.get_session()
    async with session.create_client("s3", **s3_env.client_kwargs()) as client:
        head = await client.head_object(Bucket="kvstore-test", Key=backend.options.key("mp/obj"))
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-2")  # S3 marks multipart ETags with the part count


async def test_ranged_parallel_get_equals_plain_get_into_callers_buffer(backend, s3_env):
    data = os.urandom(30 * MiB + 17)  # first range + three more, the last one short
    assert await backend.put("r/obj", data)
    buffers = []

    def alloc(size: int) -> memoryview:
        buffers.append(bytearray(size + 10))
        return memoryview(buffers[-1])

    (view,) = await backend.get_many(["r/obj"], alloc=alloc)
    assert len(buffers) == 1 and view.obj is buffers[0]  # read straight into the caller's buffer
    assert view.nbytes == len(data)
    assert bytes(view) == await plain_get(s3_env, backend.options.key("r/obj")) == data


async def test_listing_and_contains_and_deletes_past_1000_keys(s3_url):
    async with open_backend(s3_url(concurrency=32)) as b:
        names = [f"many/k{i:05d}" for i in range(1105)]
        assert all(await b.put_many([(n, n.encode()) for n in names]))
        await b.put("other/x", b"x")
        listed = [info async for info in b.list("many/")]
        assert sorted(i.name for i in listed) == names
        assert {i.size for i in listed} == {len(names[0])}

        probe = names[::2] + [f"many/k{i:05d}x" for i in range(50)]
        expected = [True] * len(names[::2]) + [False] * 50
        b.options = dataclasses.replace(b.options, contains="list")
        assert await b.contains_many(probe) == expected
        # auto with a budget of one listing page: the keys past the first 1000 are HEADed
        b.options = dataclasses.replace(b.options, contains="auto", contains_list_min=500)
        assert await b.contains_many(probe) == expected
        b.options = dataclasses.replace(b.options, contains="head")
        assert await b.contains_many(probe[:40] + probe[-5:]) == expected[:40] + expected[-5:]

        gone = await b.delete_many([*names, "many/never"])
        assert gone == [True] * len(names) + [False]
        assert [i.name async for i in b.list()] == ["other/x"]
        assert await b.get("many/k00001") is None


async def test_bad_names_are_counted_not_raised(backend):
    assert await backend.put_many([("../escape", b"x"), ("ok/name", b"y")]) == [False, True]
    assert await backend.get_many(["/abs", "ok/name"]) == [None, memoryview(b"y")]
    assert backend.counters.put_errors == 1 and backend.counters.get_errors == 1


async def test_wrong_credentials_rejected_with_clear_error(s3_url, monkeypatch):
    url = s3_url()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    b = open_backend(url)
    with pytest.raises(S3OpenError, match=r"rejected the credentials.*AWS_ACCESS_KEY_ID"):
        await b.open()
    # on first use the same check turns into counted failures, never an exception
    assert await b.put_many([("a/b", b"x")]) == [False]
    assert await b.get_many(["a/b"]) == [None]
    assert await b.contains_many(["a/b"]) == [False]
    assert b.counters.put_errors == 1 and b.counters.get_errors == 1
    assert "rejected the credentials" in b.stats().extra["last_open_error"]
    await b.close()

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(S3OpenError, match="rejected the credentials"):
        await open_backend(url).open()


async def test_missing_bucket_says_create_it(s3_env):
    b = open_backend(s3_env.url("no-such-bucket-here", "p"))
    with pytest.raises(S3OpenError, match=r"does not exist.*create it"):
        await b.open()
    await b.close()


async def test_botocore_checksums_can_be_switched_on(s3_url):
    async with open_backend(s3_url(checksum="when_supported")) as b:
        data = os.urandom(3 * MiB)
        assert await b.put("c/x", data)
        assert bytes(await b.get("c/x")) == data


async def test_failing_alloc_is_counted_not_raised(backend):
    assert await backend.put("a/x", b"abc")

    def broken(size: int) -> memoryview:
        raise MemoryError("no room")

    assert await backend.get_many(["a/x"], alloc=broken) == [None]
    assert backend.stats().extra["errors"] == {"other": 1}
    assert backend.counters.get_errors == 1


async def test_baseline_moves_the_same_bytes(s3_url):
    url = s3_url()
    base = baseline_for(url)
    await base.open(url)
    data = memoryview(bytearray(os.urandom(3 * MiB)))
    await base.put(7, data)
    into = memoryview(bytearray(3 * MiB))
    assert await base.get(7, into) == 3 * MiB and into == data
    await base.close()
    async with open_backend(url) as b:  # under the backend's prefix, where `kvstore bench` looks
        assert [i.name async for i in b.list("bench-baseline/")] == ["bench-baseline/7"]


async def test_no_credentials_and_unreachable_endpoint_say_what_to_fix(s3_env, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    b = open_backend(s3_env.url("kvstore-test", "p"))
    with pytest.raises(S3OpenError, match="no AWS credentials found; set AWS_ACCESS_KEY_ID"):
        await b.open()
    await b.close()

    for k, v in s3_env.env().items():
        monkeypatch.setenv(k, v)
    from kvstore.testing.seaweed import free_port

    b = open_backend(
        f"s3://kvstore-test/p?endpoint_url=http://127.0.0.1:{free_port()}&connect_timeout=0.5&max_attempts=1"
    )
    with pytest.raises(S3OpenError, match=r"cannot reach http://127\.0\.0\.1:.*check endpoint_url"):
        await b.open()
    assert await b.get_many(["x"]) == [None]  # and on first use: a counted miss
    await b.close()


async def test_quarantine_deletes_only_the_copy_it_compared(s3_url) -> None:  # type: ignore[no-untyped-def]
    """A copy written between quarantine's read and its delete stays: the delete is
    conditional on the ETag of the read (If-Match), and the server answers 412."""
    b = open_backend(s3_url())
    name = "ns/m/vllm-1-0/q"
    bad, good = os.urandom(4096), os.urandom(4096)
    assert await b.put_many([(name, bad)]) == [True]
    client = b._client
    real = client.delete_object

    async def delete_after_a_rewrite(**kw):  # type: ignore[no-untyped-def]
        assert await b.put_many([(name, good)]) == [True]
        return await real(**kw)

    client.delete_object = delete_after_a_rewrite
    assert await b.quarantine(name, "test", Defect(read=bad)) is False
    client.delete_object = real
    (got,) = await b.get_many([name])
    assert got is not None and bytes(got) == good
    assert await b.quarantine(name, "test", Defect(read=bytes(got))) is True
    assert await b.contains_many([name]) == [False]
    await b.close()


async def test_quarantine_refuses_where_deletes_ignore_if_match(s3_url) -> None:  # type: ignore[no-untyped-def]
    """A server that deletes regardless of If-Match (asked once, on a probe object)
    quarantines nothing: the delete could take a copy written since the read."""
    b = open_backend(s3_url())
    name = "ns/m/vllm-1-0/q2"
    bad = os.urandom(4096)
    assert await b.put_many([(name, bad)]) == [True]
    client = b._client
    real = client.delete_object

    async def unconditional(**kw):  # type: ignore[no-untyped-def]
        kw.pop("IfMatch", None)
        return await real(**kw)

    client.delete_object = unconditional
    assert await b.quarantine(name, "test", Defect(read=bad)) is False
    assert await b.contains_many([name]) == [True]
    assert [i.name async for i in b.list("")] == [name]  # the probe object went too
    client.delete_object = real
    await b.close()
