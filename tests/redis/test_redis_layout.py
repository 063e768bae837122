"""Pure logic of the Redis key layout: manifest self-check, part cutting, glob escaping, TTLs."""

from __future__ import annotations

import pytest

from kvstore.backends import redis_layout as layout


def test_manifest_round_trip_and_self_check():
    m = layout.Manifest.new(total=10 * 1024 + 1, part_size=1024)
    assert m.count == 11 and m.part_len(10) == 1 and m.part_len(0) == 1024
    raw = m.encode()
    assert len(raw) == layout.MANIFEST_LEN and layout.decode_manifest(raw) == m
    for i in range(len(raw)):  # any flipped byte: not a manifest (read as a plain value)
        bad = bytearray(raw)
        bad[i] ^= 0x01
        assert layout.decode_manifest(bytes(bad)) is None
    assert layout.decode_manifest(raw[:-1]) is None and layout.decode_manifest(None) is None
    assert layout.Manifest.new(100, 10).generation != layout.Manifest.new(100, 10).generation


@pytest.mark.parametrize("sizes", [[10], [3, 7], [0, 25, 0, 5], [1] * 23, [0]])
def test_split_parts_keeps_bytes_in_order_without_copies(sizes):
    data = bytes(range(256)) * 1
    views, pos = [], 0
    for n in sizes:
        views.append(memoryview(data)[pos : pos + n])
        pos += n
    pieces = layout.split_parts(views, 8)
    joined = [b"".join(bytes(v) for v in piece) for piece in pieces]
    assert b"".join(joined) == data[:pos]
    assert all(len(p) == 8 for p in joined[:-1]) and 0 <= len(joined[-1]) <= 8
    assert all(isinstance(v, memoryview) for piece in pieces for v in piece)


def test_keys_share_a_hash_tag_and_names_come_back():
    name = "ns/m/f-1-0/x}y"
    assert layout.name_of_key("kv:", layout.data_key("kv:", name)) == name
    assert layout.name_of_key("kv:", layout.parts_key("kv:", name)) is None
    with pytest.raises(ValueError, match="hash tags"):
        layout.check_prefix("a{b}:")


def _unescape_glob(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 1
        out.append(pattern[i])
        i += 1
    return "".join(out)


@pytest.mark.parametrize("prefix", ["a*", "a?", "a[b]", "a\\b", "plain"])
def test_scan_pattern_is_the_literal_prefix_then_star(prefix):
    pattern = layout.scan_pattern("kv:", prefix)
    assert pattern.endswith("*") and not pattern.endswith("\\*")
    body = pattern[:-1]
    assert _unescape_glob(body) == "kv:{" + prefix
    assert all(body[i - 1] == "\\" for i, c in enumerate(body) if c in "*?[]")


def test_ttl_by_namespace():
    ttls = {"short": 0.5, "never": 0}
    assert layout.ttl_ms_for("short/m/f-1-0/x", ttls, 60) == 500
    assert layout.ttl_ms_for("never/m/f-1-0/x", ttls, 60) is None
    assert layout.ttl_ms_for("other/m/f-1-0/x", ttls, 60) == 60_000
    assert layout.ttl_ms_for("other/m/f-1-0/x", ttls, None) is None
