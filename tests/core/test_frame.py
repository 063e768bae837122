from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from kvstore import codec
from kvstore.frame import (
    PREFIX_LEN,
    BadMagicError,
    ChecksumMismatchError,
    CorruptHeaderError,
    FrameError,
    FrameHeader,
    LengthMismatchError,
    UnsupportedVersionError,
    decode_frame,
    encode_frame,
)


def frame(payload: bytes = b"hello kv") -> bytearray:
    return bytearray(b"".join(encode_frame([payload], codec="raw", key="k", meta={"a": 1})))


def test_round_trip_payload_is_a_view() -> None:
    buf = frame()
    f = decode_frame(buf)
    assert bytes(f.payload) == b"hello kv"
    assert f.header.key == "k" and f.header.meta == {"a": 1}
    buf[-1] ^= 0  # payload is a view into buf, not a copy
    assert f.payload.obj is buf or f.payload.nbytes == 8


def test_payload_parts_are_not_joined() -> None:
    parts = encode_frame([b"ab", memoryview(b"cd")], codec="raw")
    assert [bytes(p) for p in parts[1:]] == [b"ab", b"cd"]
    assert bytes(decode_frame(b"".join(parts)).payload) == b"abcd"


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda b: b.__setitem__(0, ord("X")), BadMagicError),
        (lambda b: b.__setitem__(4, 99), UnsupportedVersionError),
        (lambda b: b.__setitem__(PREFIX_LEN + 3, b[PREFIX_LEN + 3] ^ 0xFF), CorruptHeaderError),
        (lambda b: b.__setitem__(len(b) - 1, b[-1] ^ 1), ChecksumMismatchError),
        (lambda b: b.__delitem__(slice(len(b) - 3, None)), LengthMismatchError),
        (lambda b: b.extend(b"xx"), LengthMismatchError),
        (lambda b: b.__delitem__(slice(10, None)), LengthMismatchError),
        (lambda b: struct.pack_into("<I", b, 8, 1 << 30), LengthMismatchError),
    ],
)
def test_every_defect_raises_a_frame_error(mutate, error) -> None:  # type: ignore[no-untyped-def]
    buf = frame()
    mutate(buf)
    with pytest.raises(error):
        decode_frame(buf)


def test_garbage_is_a_frame_error() -> None:
    for junk in (b"", b"KVSF", b"\x00" * 64, b"not a frame at all" * 10):
        with pytest.raises(FrameError):
            decode_frame(junk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
def test_raw_codec_contract(dtype: torch.dtype) -> None:
    raw = codec.get("raw")
    t = (torch.randn(2, 3, 5, 7) * 10).to(dtype)
    blob = raw.encode(t)
    back = raw.decode(blob)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    bad = bytearray(blob)
    bad[-2] ^= 0x10
    with pytest.raises(FrameError):
        raw.decode(bad)


def test_raw_codec_non_contiguous_and_empty() -> None:
    raw = codec.get("raw")
    t = torch.randn(4, 6).t()
    assert torch.equal(raw.decode(raw.encode(t)), t)
    e = torch.empty(0, 3)
    assert raw.decode(raw.encode(e)).shape == (0, 3)


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="raw"):
        codec.get("zstd-magic")


@pytest.mark.parametrize("key_len", [0, 1, 5, 40, 63, 64, 65, 200, 1000])
def test_payloads_start_at_an_aligned_offset(key_len: int) -> None:
    """Copies of a payload into a caller's (aligned) tensor run at full speed only when
    source and destination agree modulo 64: writers pad the header to that."""
    from kvstore.frame import PAD_MAX, PAYLOAD_ALIGN, read_header

    key = "k" * key_len
    parts = encode_frame([b"payload"], codec="raw", key=key, meta={"m": "x" * key_len})
    assert len(parts[0]) % PAYLOAD_ALIGN == 0
    header, off = read_header(b"".join(parts), key=key)
    assert off == len(parts[0]) and header.key == key and header.meta == {"m": "x" * key_len}
    unpadded = len(msgpack.packb(header.to_map(), use_bin_type=True)) + PREFIX_LEN
    assert 0 <= off - unpadded <= PAD_MAX


def test_frames_written_without_padding_still_read() -> None:
    """Frames from before the padding (header packed as is) decode the same way."""
    import zlib

    from kvstore.frame import MAGIC, PREFIX, VERSION, checksum

    payload = b"older frame payload"
    header = FrameHeader(
        codec="raw", dtype="uint8", shape=(len(payload),), layout="bytes", plen=len(payload),
        csum=checksum([payload]), key="old",
    )
    hbytes = msgpack.packb(header.to_map(), use_bin_type=True)
    blob = PREFIX.pack(MAGIC, VERSION, 0, 0, len(hbytes), zlib.crc32(hbytes)) + hbytes + payload
    frame = decode_frame(blob, key="old")
    assert bytes(frame.payload) == payload and frame.header == header


@pytest.mark.parametrize("csum", [0, 5, 127, 200, 70000, 2**31 + 3, 0xFFFFFFFF])
@pytest.mark.parametrize("key_len", [1, 40, 200])
def test_an_unsealed_frame_seals_to_the_frame_a_sealed_encode_writes(csum: int, key_len: int) -> None:
    """Whatever its checksum packs to, the sealed header has the placeholder's length (the
    payload was written after it) and the payload stays aligned."""
    from kvstore.frame import PAYLOAD_ALIGN, UnsealedFrame, read_header

    key = "k" * key_len
    f = encode_frame([b"payload"], codec="raw", key=key, ctime=1.5, sealed=False)
    assert isinstance(f, UnsealedFrame) and not f.sealed
    head_len = len(f[0])
    assert f.claim() and not f.claim()
    f.seal(csum)
    assert f.sealed and len(f[0]) == head_len == f.head_len and head_len % PAYLOAD_ALIGN == 0
    header, off = read_header(b"".join(f), key=key)
    assert off == head_len and header.csum == csum and header.ctime == 1.5


def test_an_unsealed_frame_reads_as_no_frame_until_sealed_then_as_the_sealed_encode() -> None:
    from kvstore.frame import UnsealedFrame

    payload = bytes(range(256)) * 300
    f = encode_frame([payload], codec="raw", key="k", ctime=2.0, sealed=False)
    assert isinstance(f, UnsealedFrame)
    with pytest.raises(BadMagicError):  # written by mistake before its seal: a defect, never a chunk
        decode_frame(b"".join(f), key="k")
    f.ensure_sealed()
    f.ensure_sealed()  # once sealed, a no-op
    assert b"".join(f) == b"".join(encode_frame([payload], codec="raw", key="k", ctime=2.0))
    assert bytes(decode_frame(b"".join(f), key="k").payload) == payload


def test_ensure_sealed_waits_for_the_claimant_or_takes_over_from_one_that_gave_up() -> None:
    import threading

    from kvstore.frame import UnsealedFrame, checksum

    payload = b"x" * 5000
    f = encode_frame([payload], codec="raw", key="k", sealed=False)
    assert isinstance(f, UnsealedFrame) and f.claim()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (f.ensure_sealed(), done.set()))
    waiter.start()
    assert not done.wait(0.05)  # the claimant has it: wait
    f.seal(checksum([payload]))
    assert done.wait(5)
    waiter.join()

    g = encode_frame([payload], codec="raw", key="k", sealed=False)
    assert isinstance(g, UnsealedFrame) and g.claim()
    done.clear()
    waiter = threading.Thread(target=lambda: (g.ensure_sealed(), done.set()))
    waiter.start()
    g.release()  # the claimant's write failed: the waiter computes the checksum itself
    assert done.wait(5)
    waiter.join()
    assert decode_frame(b"".join(g), key="k").header.csum == checksum([payload])
    with pytest.raises(RuntimeError, match="without the claim"):
        g.seal(1)
