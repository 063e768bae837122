"""The zero-copy request body: what botocore reads from it and what goes on the wire."""

from __future__ import annotations

import io
import os

import aiohttp.payload
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.backends.s3_body import PartsBody, slice_parts

parts_strategy = st.lists(st.binary(max_size=50), max_size=6)


@given(parts_strategy, st.integers(0, 400), st.integers(-1, 60))
def test_read_seek_tell_match_bytesio(parts, start, n):
    whole = b"".join(parts)
    body = PartsBody([memoryview(p) for p in parts])
    ref = io.BytesIO(whole)
    assert len(body) == len(whole)
    assert body.seek(start) == ref.seek(min(start, len(whole)))
    assert body.read(n) == ref.read(n)
    assert body.tell() == ref.tell()
    body.seek(0)
    assert body.read() == whole and body.read(5) == b""


@given(parts_strategy, st.integers(0, 300), st.integers(0, 300))
def test_slice_parts_is_the_byte_range_without_copies(parts, a, b):
    lo, hi = min(a, b), max(a, b)
    views = [memoryview(p) for p in parts]
    out = slice_parts(views, lo, hi)
    assert b"".join(out) == b"".join(parts)[lo:hi]
    assert all(any(v.obj is src.obj for src in views) for v in out)  # views of the caller's buffers


@pytest.mark.parametrize("queues_views", [False, True])
async def test_a_body_reaches_the_transport_as_the_buffers_or_as_copies_where_they_would_be_queued(
    monkeypatch, queues_views
):
    """Where a transport queues a memoryview without copying it (Python 3.12 and later),
    the body goes in copied pieces: a request cancelled by its deadline keeps sending
    the queue, and the caller may have refilled its buffer by then."""
    import kvstore.backends.s3_body as body_module

    monkeypatch.setattr(body_module, "QUEUES_VIEWS", queues_views)
    monkeypatch.setattr(body_module, "PIECE", 1000)
    buf = bytearray(os.urandom(2500))
    sent: list[object] = []

    class Writer:
        async def write(self, chunk):  # type: ignore[no-untyped-def]
            sent.append(chunk)

    payload = aiohttp.payload.get_payload(body_module.PartsBody([memoryview(buf)]))
    await payload.write(Writer())
    if queues_views:
        assert [type(c) for c in sent] == [bytes, bytes, bytes]
        buf[:] = bytes(2500)  # the caller refills its buffer: what was handed over stays
        assert b"".join(sent) != bytes(buf)
    else:
        assert len(sent) == 1 and isinstance(sent[0], memoryview)
    assert sum(len(c) for c in sent) == 2500
