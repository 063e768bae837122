"""Reading s3:// URLs: defaults, options, and errors that say what to write."""

from __future__ import annotations

import itertools

import pytest

from kvstore.backends.s3_options import S3Options


def test_defaults_and_keys():
    o = S3Options.from_url("s3://bucket/a/b/")
    assert (o.bucket, o.prefix, o.checksum, o.retry_mode) == ("bucket", "a/b", "when_required", "standard")
    assert o.key("ns/x") == "a/b/ns/x" and o.name("a/b/ns/x") == "ns/x"
    assert S3Options.from_url("s3://bucket").key("x") == "x"


def test_options_are_parsed():
    o = S3Options.from_url(
        "s3://b/p?endpoint_url=http://127.0.0.1:9000&region=eu-west-1&addressing_style=path"
        "&part_size=16MiB&multipart_threshold=64MiB&concurrency=32&checksum=when_supported"
        "&retry_mode=adaptive&timeout=2.5&contains=head"
    )
    assert o.endpoint_url == "http://127.0.0.1:9000" and o.region == "eu-west-1"
    assert (o.part_size, o.multipart_threshold, o.concurrency) == (16 << 20, 64 << 20, 32)
    assert (o.checksum, o.retry_mode, o.timeout, o.contains) == ("when_supported", "adaptive", 2.5, "head")
    cfg = o.botocore_config()
    assert cfg.max_pool_connections == 32
    assert cfg.request_checksum_calculation == "when_supported"
    assert cfg.retries == {"mode": "adaptive", "total_max_attempts": 4}


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("s3://key:secret@bucket/p", "never from the URL"),
        ("s3://b/p?colour=red", "known"),
        ("s3://b/p?checksum=always", "when_required"),
        ("s3://b/p?part_size=1MiB", "5MiB"),
        ("s3://b/p?concurrency=0", "positive"),
        ("s3://b/p?timeout=soon", "not a number"),
    ],
)
def test_bad_urls_say_what_to_fix(url, words):
    with pytest.raises(ValueError, match=words):
        S3Options.from_url(url)


@pytest.mark.parametrize(
    ("size", "part", "sizes"),
    [
        ((16 << 20) + 200, 8 << 20, [(8 << 20) + 100, (8 << 20) + 100]),  # a frame past 16 MiB: two parts
        (20 << 20, 5 << 20, [5 << 20] * 4),
        ((5 << 20) + 1, 8 << 20, [(5 << 20) + 1]),  # under one part: one
        ((24 << 20) - 1, 8 << 20, [12 << 20, (12 << 20) - 1]),  # not three: one would be short
    ],
)
def test_multipart_parts_are_even_and_never_under_part_size(size, part, sizes):
    from kvstore.backends.s3 import part_bounds

    bounds = part_bounds(size, part)
    assert [hi - lo for _, lo, hi in bounds] == sizes
    assert [n for n, _, _ in bounds] == list(range(1, len(sizes) + 1))
    assert bounds[0][1] == 0 and bounds[-1][2] == size
    assert all(a[2] == b[1] for a, b in itertools.pairwise(bounds))
