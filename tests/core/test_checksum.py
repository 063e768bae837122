"""kvstore.checksum: the frame checksum gives the crc32c package's values on every path.

On a CPU with VPCLMULQDQ (AVX-512 or AVX2) these run the compiled kernels; elsewhere the fallback
(the package).  The fallback is also tested directly (KVSTORE_CRC32C=package in a
fresh process), so both paths are covered on any machine that has the kernels.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import crc32c as pkg
import pytest

from kvstore import checksum
from kvstore.frame import ChecksumMismatchError, decode_frame, encode_frame

LENGTHS = [0, 1, 7, 8, 63, 64, 65, 255, 256, 257, 511, 1023, 1024, 1025, 4096 + 17, 65536, (256 << 10) + 3]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("misalign", [0, 1, 13])
def test_crc32c_matches_the_package(n: int, misalign: int) -> None:
    rng = random.Random(n * 31 + misalign)
    raw = rng.randbytes(n + misalign)
    view = memoryview(raw)[misalign:]
    start = rng.getrandbits(32)
    assert checksum.crc32c(view, start) == pkg.crc32c(view, start)
    assert checksum.crc32c(bytearray(view)) == pkg.crc32c(view)


def test_crc32c_continues_across_pieces() -> None:
    data = random.Random(1).randbytes(3 << 20)
    value = 0
    for cut in range(0, len(data), 300_001):
        value = checksum.crc32c(data[cut : cut + 300_001], value)
    assert value == pkg.crc32c(data)


def test_crc32c_combine_joins_pieces_hashed_apart() -> None:
    rng = random.Random(7)
    data = rng.randbytes((3 << 20) + 4099)
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(6)), 1, 2, 8 << 10})
    pieces = [data[a:b] for a, b in itertools.pairwise(cuts)]
    value = 0
    for piece in pieces:  # each hashed from 0, as a parallel range reader does
        value = checksum.crc32c_combine(value, checksum.crc32c(piece), len(piece))
    assert value == pkg.crc32c(data)
    assert checksum.crc32c_combine(pkg.crc32c(b"abc"), 0, 0) == pkg.crc32c(b"abc")
    with pytest.raises(ValueError):
        checksum.crc32c_combine(1, 2, -1)


@pytest.mark.parametrize("n", LENGTHS)
def test_copy_crc32c_copies_and_hashes(n: int) -> None:
    src = random.Random(n).randbytes(n + 5)[5:]
    dst = bytearray(n + 3)
    got = checksum.copy_crc32c(memoryview(dst)[3:], src, 42)
    assert bytes(dst[3:]) == src
    assert dst[:3] == b"\0\0\0"  # nothing written outside the destination
    assert got == pkg.crc32c(src, 42)


def test_copy_crc32c_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="destination is 3 bytes, source 4"):
        checksum.copy_crc32c(bytearray(3), b"abcd")


@pytest.mark.parametrize("size", [0, 100, (256 << 10) - 1, (1 << 20) + 77])
def test_pread_crc32c_reads_a_file_range(size: int) -> None:
    data = random.Random(size).randbytes(size + 64)
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            dst = bytearray(size)
            got, value = checksum.pread_crc32c(fd, dst, 64, 5)
            assert got == size and bytes(dst) == data[64:]
            assert value == pkg.crc32c(data[64:], 5)
            # past the end: short, and the checksum covers only what was read
            longer = bytearray(size + 1000)
            got, value = checksum.pread_crc32c(fd, longer, 64)
            assert got == size and value == pkg.crc32c(data[64:])
        finally:
            os.close(fd)


def test_pread_crc32c_error_is_an_oserror() -> None:
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    with pytest.raises(OSError):
        checksum.pread_crc32c(r, bytearray(4096), 0)


@pytest.mark.parametrize("size", [0, 100, (1 << 20) - 1, (3 << 20) + 77])
@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_pwrite_crc32c_writes_and_hashes_what_it_wrote(size: int, block: int) -> None:
    data = random.Random(size).randbytes(size)
    with tempfile.NamedTemporaryFile() as f:
        fd = os.open(f.name, os.O_WRONLY)
        try:
            value = checksum.pwrite_crc32c(fd, data, 64, 5, block=block)
        finally:
            os.close(fd)
        assert value == pkg.crc32c(data, 5)
        on_disk = Path(f.name).read_bytes()
        assert on_disk[64:] == data and on_disk[:64] == bytes(64 if size else 0)


def test_pwrite_crc32c_error_is_an_oserror() -> None:
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    with pytest.raises(OSError):
        checksum.pwrite_crc32c(w, b"x" * 8192, 0)
    with tempfile.NamedTemporaryFile() as f:
        fd = os.open(f.name, os.O_RDONLY)  # not open for writing: EBADF, not a silent short write
        try:
            with pytest.raises(OSError):
                checksum.pwrite_crc32c(fd, b"x" * (2 << 20), 0)
        finally:
            os.close(fd)


def test_frames_checked_with_the_fast_path_catch_a_flipped_bit() -> None:
    payload = bytearray(random.Random(3).randbytes(1 << 20))
    parts = encode_frame([payload], codec="raw", key="k")
    blob = bytearray(b"".join(bytes(p) for p in parts))
    assert bytes(decode_frame(blob, key="k").payload) == payload
    blob[-12345] ^= 0x10
    with pytest.raises(ChecksumMismatchError):
        decode_frame(blob, key="k")


def test_the_package_fallback_gives_the_same_values() -> None:
    code = (
        "import random, crc32c, os, tempfile\n"
        "from kvstore import checksum\n"
        "assert not checksum.fast()\n"
        "d = random.Random(0).randbytes(70000)\n"
        "assert checksum.crc32c(d, 3) == crc32c.crc32c(d, 3)\n"
        "b = bytearray(len(d)); assert checksum.copy_crc32c(b, d) == crc32c.crc32c(d) and b == d\n"
        "f = tempfile.NamedTemporaryFile(); f.write(d); f.flush(); fd = os.open(f.name, os.O_RDONLY)\n"
        "b = bytearray(len(d) + 9); assert checksum.pread_crc32c(fd, b, 0) == (len(d), crc32c.crc32c(d))\n"
        "g = tempfile.NamedTemporaryFile(); wd = os.open(g.name, os.O_WRONLY)\n"
        "assert checksum.pwrite_crc32c(wd, d, 3, 1, block=4096) == crc32c.crc32c(d, 1)\n"
        "assert open(g.name, 'rb').read() == bytes(3) + d\n"
        "print('ok')\n"
    )
    assert _in_fresh_process(code, crc32c_mode="package") == "ok"


def _in_fresh_process(code: str, *, crc32c_mode: str) -> str:
    """What `code` prints, run in a new interpreter with ``KVSTORE_CRC32C=crc32c_mode``
    (the kernels are chosen once per process)."""
    env = {**os.environ, "KVSTORE_CRC32C": crc32c_mode}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_256_bit_kernels_give_the_same_values() -> None:
    """AVX2's kernels (forced where AVX-512's would serve), checked in a fresh process."""
    code = (
        "import random, crc32c, os, tempfile\n"
        "from kvstore import checksum\n"
        "if not checksum.fast(): print('none'); raise SystemExit\n"
        "assert checksum.vector_bits() == 256, checksum.vector_bits()\n"
        "rng = random.Random(0)\n"
        "for n in (0, 1, 63, 64, 255, 256, 257, 1024, 4113, 65536, 70001, (8 << 20) + 77):\n"
        "    for skew in (0, 1, 13):\n"
        "        d = memoryview(rng.randbytes(n + skew))[skew:]\n"
        "        assert checksum.crc32c(d, 3) == crc32c.crc32c(d, 3), (n, skew)\n"
        "        b = memoryview(bytearray(n + 64))[skew : skew + n]\n"
        "        assert checksum.copy_crc32c(b, d, 5) == crc32c.crc32c(d, 5) and b == d, (n, skew)\n"
        "d = rng.randbytes(3 << 20)\n"
        "f = tempfile.NamedTemporaryFile(); f.write(d); f.flush(); fd = os.open(f.name, os.O_RDONLY)\n"
        "b = bytearray(len(d) + 9); assert checksum.pread_crc32c(fd, b, 0) == (len(d), crc32c.crc32c(d))\n"
        "g = tempfile.NamedTemporaryFile(); wd = os.open(g.name, os.O_WRONLY)\n"
        "assert checksum.pwrite_crc32c(wd, d, 0, 2) == crc32c.crc32c(d, 2) and open(g.name, 'rb').read() == d\n"
        "print('ok')\n"
    )
    said = _in_fresh_process(code, crc32c_mode="avx2")
    if said == "none":
        pytest.skip("this CPU has no VPCLMULQDQ with AVX2")
    assert said == "ok"


def test_warm_up_compiles_once_and_changes_no_value() -> None:
    checksum.warm_up()
    checksum.warm_up()
    data = random.Random(9).randbytes(5000)
    assert checksum.crc32c(data) == pkg.crc32c(data)


@pytest.mark.parametrize("skew", [0, 8])
def test_copy_crc32c_large_aligned_and_unaligned_destinations(skew: int) -> None:
    """From 8 MiB a 64-byte-aligned destination takes streaming stores; both paths must
    copy exactly and give the package's value."""
    import torch

    n = checksum.NT_MIN + 100
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(skew))
    room = torch.zeros(n + 128, dtype=torch.uint8)
    start = (-room.data_ptr()) % 64 + skew
    dst = room[start : start + n]
    got = checksum.copy_crc32c(dst.numpy().data, src.numpy().data, 11)
    assert got == pkg.crc32c(src.numpy().data, 11)
    assert torch.equal(dst, src)
    assert int(room[:start].sum()) == 0 and int(room[start + n :].sum()) == 0


@pytest.mark.parametrize("size", [1024, 4096, 65536 + 7, (2 << 20) + 77])
@pytest.mark.parametrize("offset", [0, 64, 4095, 4096, 12345])
@pytest.mark.parametrize("skew", [0, 1])
def test_mapped_crc32c_copies_a_file_range(size: int, offset: int, skew: int) -> None:
    if not checksum.fast():
        pytest.skip("the mapped read needs the vpclmulqdq kernels (this CPU reads with pread)")
    data = random.Random(size + offset).randbytes(size + offset + 100)
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            buf = bytearray(size + 128)
            dst = memoryview(buf)[64 + skew : 64 + skew + size]  # aligned (streamed) and not
            got = checksum.mapped_crc32c(fd, dst, offset, 9)
            assert got == (size, pkg.crc32c(data[offset : offset + size], 9))
            assert bytes(dst) == data[offset : offset + size]
            assert buf[: 64 + skew] == bytes(64 + skew), "nothing written before the destination"
            assert buf[64 + skew + size :] == bytes(len(buf) - 64 - skew - size), "nor after it"
        finally:
            os.close(fd)


def test_mapped_crc32c_declines_what_it_cannot_map() -> None:
    """A descriptor that cannot be mapped (a pipe, a closed one) is None: the caller
    reads with pread_crc32c, which reports the error."""
    r, w = os.pipe()
    try:
        assert checksum.mapped_crc32c(r, bytearray(4096), 0) is None
    finally:
        os.close(r)
        os.close(w)
    assert checksum.mapped_crc32c(r, bytearray(4096), 0) is None


def _cachestat_works(fd: int) -> bool:
    import ctypes

    rng = (ctypes.c_uint64 * 2)(0, 4096)
    stat = (ctypes.c_uint64 * 5)()
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(stat), 0) == 0


@pytest.mark.parametrize("no_cachestat", [0, 1])
def test_mapped_crc32c_leaves_a_cold_range_to_pread(tmp_path, monkeypatch, no_cachestat: int) -> None:  # type: ignore[no-untyped-def]
    """A range not in the page cache is not mapped (None): a cold read goes through
    pread_crc32c, whose large requests read ahead, and whose I/O errors are errors.
    Decided by cachestat(2), or (kernels before 6.5, ``no_cachestat``) by mincore on an
    unpopulated mapping."""
    if not checksum.fast():
        pytest.skip("the mapped read needs the vpclmulqdq kernels")
    monkeypatch.setitem(checksum._state, "no_cachestat", no_cachestat)
    path = tmp_path / "cold"
    data = random.Random(5).randbytes(1 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        if not no_cachestat and not _cachestat_works(fd):
            pytest.skip("cachestat(2) is not available here (kernel before 6.5, or refused by seccomp)")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1)], 4096, os.RWF_NOWAIT)
            pytest.skip("this file system keeps the pages after POSIX_FADV_DONTNEED")
        except BlockingIOError:
            pass
        dst = bytearray(len(data) - 64)
        assert checksum.mapped_crc32c(fd, dst, 64) is None
        assert checksum.pread_crc32c(fd, dst, 64) == (len(dst), pkg.crc32c(data[64:]))
        got = checksum.mapped_crc32c(fd, dst, 64, 3)  # warm now: mapped
        assert got == (len(dst), pkg.crc32c(data[64:], 3)) and bytes(dst) == data[64:]
    finally:
        os.close(fd)
