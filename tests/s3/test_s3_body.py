"""The zero-copy request body: what botocore reads from it and what goes on the wire."""

from __future__ import annotations

import io

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
