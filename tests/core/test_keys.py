from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvstore.keys import (
    ChunkKey,
    InvalidKeyError,
    check_object_name,
    chunk_hash_of,
    escape_component,
    namespace_prefix,
)


def test_round_trip_with_negative_hash() -> None:
    key = ChunkKey("meta-llama/Llama-3.1-8B", 2, 1, -0x1234ABCD, "vllm", "tenant-a")
    name = key.object_name()
    assert name.startswith(namespace_prefix("tenant-a", "meta-llama/Llama-3.1-8B"))
    assert "-1234abcd" in name
    assert ChunkKey.from_object_name(name) == key


@pytest.mark.parametrize("chunk_hash", [0, 1, -1, 2**63, -(2**63), b"\x00\xff", "abc", "deadbeef", "../x"])
def test_hash_kinds_round_trip(chunk_hash: int | str | bytes) -> None:
    key = ChunkKey("m", 1, 0, chunk_hash)
    assert ChunkKey.from_object_name(key.object_name()).chunk_hash == chunk_hash


@pytest.mark.parametrize(
    "hostile",
    ["..", "../../etc/passwd", "/abs/path", "a\x00b", ".", "", "x" * 5000, "a/b", "ü/..", "%2F"],
    ids=range(10),
)
def test_hostile_components_stay_one_safe_segment(hostile: str) -> None:
    name = ChunkKey(hostile, 1, 0, 7, hostile, hostile).object_name()
    segments = name.split("/")
    assert len(segments) == 4
    assert not name.startswith("/")
    assert "\x00" not in name and ".." not in segments and "." not in segments
    assert len(name) <= 320
    check_object_name(name)


def test_namespaces_cannot_share_a_prefix() -> None:
    a = ChunkKey("m", 1, 0, 1, namespace="a").object_name()
    ab = ChunkKey("m", 1, 0, 1, namespace="a/b").object_name()
    assert not ab.startswith(namespace_prefix("a"))
    assert a.startswith(namespace_prefix("a"))


@given(st.text(max_size=60), st.text(max_size=60), st.text(max_size=30), st.integers())
def test_any_text_round_trips(ns: str, model: str, fmt: str, h: int) -> None:
    assume(all("~" not in escape_component(t) for t in (ns, model, fmt)))  # not digested
    key = ChunkKey(model, 4, 3, h, fmt, ns)
    assert ChunkKey.from_object_name(key.object_name()) == key


@pytest.mark.parametrize("bad", ["", "/a", "a//b", "a/../b", "a/./b", "a\x00", "a\\b", "x" * 400])
def test_check_object_name_rejects(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        check_object_name(bad)


def test_worker_outside_world_is_rejected() -> None:
    with pytest.raises(InvalidKeyError, match="world_size"):
        ChunkKey("m", 2, 2, 1).object_name()


def test_long_components_are_digested_distinctly() -> None:
    a = ChunkKey("m" * 500 + "a", 1, 0, 1).object_name()
    b = ChunkKey("m" * 500 + "b", 1, 0, 1).object_name()
    assert a != b and len(a) < 200
    with pytest.raises(InvalidKeyError, match="digest"):
        ChunkKey.from_object_name(a)
    # the chunk hash still reads back: a caller that knows the rest of the key can rebuild it
    assert chunk_hash_of(ChunkKey("m" * 500, 1, 0, b"\x01\xff").object_name()) == b"\x01\xff"
    assert chunk_hash_of(a) == 1


@pytest.mark.parametrize(
    ("key", "name"),
    [
        (ChunkKey("meta-llama/Llama-3.1-8B", 2, 1, -0x1234ABCD, "vllm", "tenant-a"), "tenant-a/meta-llama%2FLlama-3%2E1-8B/vllm-2-1/-1234abcd"),
        (ChunkKey("m x.é", 1, 0, b"\x00\xff", "bfloat16.L3", "default"), "default/m%20x%2E%C3%A9/bfloat16%2EL3-1-0/h00ff"),
        (ChunkKey("m", 1, 0, "../x", "f", "n"), "n/m/f-1-0/s%2E%2E%2Fx"),
    ],
)
def test_names_are_spelled_as_earlier_versions_wrote_them(key: ChunkKey, name: str) -> None:
    """Objects stored by an earlier version are found by name: the spelling never changes."""
    assert key.object_name() == name


@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=40), st.one_of(st.integers(), st.binary(max_size=40), st.text(max_size=40)))
def test_a_name_is_the_escaped_components_joined_and_always_a_valid_object_name(
    ns: str, model: str, fmt: str, h: int | bytes | str
) -> None:
    key = ChunkKey(model, 4, 3, h, fmt, ns)
    name = key.object_name()
    assert check_object_name(name) == name
    assert name.rsplit("/", 1)[0] == f"{escape_component(ns)}/{escape_component(model)}/{escape_component(fmt)}-4-3"
    if "~" not in name:  # no component shortened with a digest: the name reads back as the key
        assert ChunkKey.from_object_name(name) == key
